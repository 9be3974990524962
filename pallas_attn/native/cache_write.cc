// Rows written into a cache in place: cache[i0[n], i1[n], ...] = rows[n, ...] for every n whose
// (i0, i1) lies inside the cache's first two dimensions (the others are dropped, as the jnp
// scatter's mode="drop" drops them); pallas_attn/cache.py set_rows is the Python side.
//
// Why: XLA:CPU computes a scatter into a 16-bit float array (bfloat16, float16) in float32, so
// it widens the whole operand, scatters, and narrows it back: for a KV pool that is every page of
// the layer on every prefill chunk (SmolLM2 in bfloat16 with a pool of 1088 pages wrote 300 MB of
// fresh memory per chunk and ran 2-4x slower than in float32), and a bitcast to uint16 around the
// scatter is materialized as two copies. Here the bytes move and nothing else is touched. The
// cache is aliased to the output (input_output_aliases), so it is written in place.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error CacheWrite(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> i0, ffi::Buffer<ffi::S32> i1,
                      ffi::AnyBuffer rows, ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), rd = rows.dimensions();
  const int64_t n = i0.element_count();
  if (cd.size() < 2 || rd.size() != cd.size() - 1 || i1.element_count() != n || rd[0] != n ||
      rows.element_type() != cache.element_type() || out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument(
        "cache_write: want cache [A, B, ...], i0 [N], i1 [N], rows [N, ...] of the cache's type");
  int64_t row_elems = 1;
  for (size_t d = 2; d < cd.size(); ++d) {
    if (rd[d - 1] != cd[d]) return ffi::Error::InvalidArgument("cache_write: row shape");
    row_elems *= cd[d];
  }
  const int64_t A = cd[0], Bd = cd[1];
  const int64_t row_bytes = row_elems * int64_t(cache.size_bytes() / cache.element_count());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data())  // not aliased (XLA may copy): start from the cache
    std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t *a = i0.typed_data(), *b = i1.typed_data();
  for (int64_t r = 0; r < n; ++r) {
    if (a[r] < 0 || a[r] >= A || b[r] < 0 || b[r] >= Bd) continue;
    std::memcpy(dst + (int64_t(a[r]) * Bd + b[r]) * row_bytes, src + r * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
