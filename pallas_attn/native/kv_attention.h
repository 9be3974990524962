// Entry point into kv_attention.cc for other native kernels (decode_layer.cc): attention of a
// few queries over a KV cache as written, without an FFI call.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace pallas_attn {

// The pallas_attn_kv_attention handler's work: q [B, Tq, Hq, D] float32 over caches
// [num_pages, P, Hkv, D] of `cache_type` (F32, BF16, F16, F8E4M3FN) addressed through table
// [B, max_blocks] (contiguous: [B, 1] with P = S); keys [kv_start, kv_len) of each row, query i
// at q_offset + i, window (left, right) with -1 unbounded; descale [2, B, Hkv]; tree
// [B, Tq, Tq] or null. Writes out [B, Tq, Hq, D] and lse [B, Hq, Tq]. False for an unsupported
// cache type.
bool kv_attention(xla::ffi::ThreadPool& pool, xla::ffi::DataType cache_type, int64_t B, int64_t Tq,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t num_pages, int64_t P,
                  int64_t max_blocks, float scale, float softcap, int64_t left, int64_t right,
                  const float* q, const void* k_cache, const void* v_cache, const int32_t* table,
                  const int32_t* q_offset, const int32_t* kv_start, const int32_t* kv_len,
                  const float* descale, const int32_t* tree, float* out, float* lse);

}  // namespace pallas_attn
