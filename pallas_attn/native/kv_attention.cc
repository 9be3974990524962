// Attention of a few new queries over a KV cache on CPU, in one pass over each row's keys: the
// attention step of attention_with_kvcache's "xla" path on the CPU backend (pallas_attn/cpu.py).
//
// One task per (batch row, KV head): the Tq x G queries of that head (G = Hq / Hkv) meet each key
// and value row once, read in place from the cache (paged through the block table, or a
// contiguous row; float32, bfloat16, float16 or FP8 e4m3 with a per-(row, head) descale), in
// chunks of kChunk keys with an online softmax (natural-log lse). The masks are masks.visible's:
// keys [kv_start, kv_len), query i at q_offset + i, window (left, right) with -1 unbounded, and
// an optional tree mask over the last Tq keys. Rows that see no key give 0 and lse -inf.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kChunk = 4 * kLanes;  // keys per online-softmax step
typedef float vf __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4), aligned(4)));
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }

inline float hsum(vf v) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// exp(x) for x <= 0 (scores minus a running max), -inf -> 0; Cephes' expf polynomial on
// x = n ln2 + r, |r| <= ln2 / 2: relative error about 2e-7.
inline vf vexp(vf x) {
  const vi dead = x < splat(-87.0f);
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf t = x * splat(1.44269504088896341f);
  const vi n = -__builtin_convertvector(splat(0.5f) - t, vi);  // round(t), t <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  vf y = p * r * r + r + splat(1.0f);
  vi bits;
  std::memcpy(&bits, &y, sizeof(y));
  bits += n << 23;
  std::memcpy(&y, &bits, sizeof(y));
  return dead ? splat(0.f) : y;
}

// Cache element -> float32.
struct F8Table {
  float v[256];
  F8Table() {
    for (int u = 0; u < 256; ++u) {
      const int e = (u >> 3) & 15, m = u & 7;
      float x = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[u] = u & 128 ? -x : x;
    }
  }
};
const F8Table kF8;

struct F32 { using T = float; static float get(float x) { return x; } };
struct BF16 {
  using T = uint16_t;
  static float get(uint16_t x) {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct F16 { using T = _Float16; static float get(_Float16 x) { return float(x); } };
struct F8 { using T = uint8_t; static float get(uint8_t x) { return kF8.v[x]; } };

// Row of D elements -> float32 buffer, times scale (FP8 descale; 1 otherwise).
template <typename E>
inline const float* as_float(const typename E::T* src, float* buf, int64_t D, float scale) {
  if constexpr (std::is_same_v<E, F32>) {
    if (scale == 1.f) return src;
  }
  for (int64_t d = 0; d < D; ++d) buf[d] = E::get(src[d]) * scale;
  return buf;
}

inline float dot(const float* a, const float* b, int64_t D) {
  vf acc{};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc += loadv(a + d) * loadv(b + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t D) {
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) storev(y + d, loadv(y + d) + a * loadv(x + d));
  for (; d < D; ++d) y[d] += a * x[d];
}

struct Problem {
  int64_t B, Tq, Hq, Hkv, D, G, P, num_pages, max_blocks;
  float scale, softcap;
  int64_t left, right;
  const float* q;           // [B, Tq, Hq, D]
  const int32_t* table;     // [B, max_blocks]: page of each block (contiguous: [B, 1], P = S)
  const int32_t* q_offset;  // [B]
  const int32_t* kv_start;  // [B]
  const int32_t* kv_len;    // [B]
  const float* descale;     // [2, B, Hkv]
  const int32_t* tree;      // [B, Tq, Tq] or null
  float* out;               // [B, Tq, Hq, D]
  float* lse;               // [B, Hq, Tq]
};

template <typename E>
void head(const Problem& p, const typename E::T* kc, const typename E::T* vc, int64_t b,
          int64_t h) {
  const int64_t R = p.Tq * p.G, D = p.D;
  std::vector<float> qs(R * D), acc(R * D, 0.f), s(R * kChunk), m(R, kNegInf), l(R, 0.f);
  std::vector<int64_t> lo(R), hi(R);
  std::vector<float> kbuf(D), vbuf(D);
  const float kd = p.descale[b * p.Hkv + h], vd = p.descale[(p.B + b) * p.Hkv + h];
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int64_t i = 0; i < p.Tq; ++i) {
    const int64_t pos = int64_t(p.q_offset[b]) + i;
    int64_t a = p.kv_start[b], e = p.kv_len[b];
    if (p.left >= 0 && pos - p.left > a) a = pos - p.left;
    if (p.right >= 0 && pos + p.right + 1 < e) e = pos + p.right + 1;
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t r = i * p.G + g;
      lo[r] = a;
      hi[r] = e;
      const float* src = p.q + ((b * p.Tq + i) * p.Hq + h * p.G + g) * D;
      std::memcpy(&qs[r * D], src, D * sizeof(float));
    }
    if (e > a) first = a < first ? a : first, last = e > last ? e : last;
  }
  const int64_t tree_start = p.q_offset[b];
  const int32_t* tree = p.tree ? p.tree + b * p.Tq * p.Tq : nullptr;
  auto key_row = [&](const typename E::T* cache, int64_t pos) {
    int64_t page = p.table[b * p.max_blocks + pos / p.P];
    page = page < 0 ? 0 : page >= p.num_pages ? p.num_pages - 1 : page;
    return cache + ((page * p.P + pos % p.P) * p.Hkv + h) * D;
  };
  for (int64_t c0 = first; c0 < last; c0 += kChunk) {
    const int64_t n = last - c0 < kChunk ? last - c0 : kChunk;
    for (int64_t c = 0; c < n; ++c) {  // scores, each key row read once for the R queries
      const float* k = as_float<E>(key_row(kc, c0 + c), kbuf.data(), D, kd);
      for (int64_t r = 0; r < R; ++r) {
        float x = dot(&qs[r * D], k, D) * p.scale;
        if (p.softcap > 0.f) x = p.softcap * std::tanh(x / p.softcap);
        s[r * kChunk + c] = x;
      }
    }
    for (int64_t r = 0; r < R; ++r) {  // masks, then the online softmax
      float* sr = &s[r * kChunk];
      const int64_t i = r / p.G;
      float cm = kNegInf;
      for (int64_t c = 0; c < kChunk; ++c) {
        const int64_t pos = c0 + c;
        bool ok = c < n && pos >= lo[r] && pos < hi[r];
        if (ok && tree && pos >= tree_start && pos < tree_start + p.Tq)
          ok = tree[i * p.Tq + (pos - tree_start)] != 0;
        sr[c] = ok ? sr[c] : kNegInf;
        cm = sr[c] > cm ? sr[c] : cm;
      }
      if (cm == kNegInf) {
        for (int64_t c = 0; c < kChunk; ++c) sr[c] = 0.f;
        continue;
      }
      const float mn = m[r] > cm ? m[r] : cm;
      const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - mn);
      m[r] = mn;
      vf sum{};
      for (int64_t c = 0; c < kChunk; c += kLanes) {
        const vf e = vexp(loadv(sr + c) - splat(mn));
        storev(sr + c, e);
        sum += e;
      }
      l[r] = l[r] * corr + hsum(sum);
      if (corr != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= corr;
    }
    for (int64_t c = 0; c < n; ++c) {  // values, each row read once
      const float* v = as_float<E>(key_row(vc, c0 + c), vbuf.data(), D, vd);
      for (int64_t r = 0; r < R; ++r) {
        const float w = s[r * kChunk + c];
        if (w != 0.f) axpy(w, v, &acc[r * D], D);
      }
    }
  }
  for (int64_t i = 0; i < p.Tq; ++i) {
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t r = i * p.G + g, hq = h * p.G + g;
      float* o = p.out + ((b * p.Tq + i) * p.Hq + hq) * D;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      p.lse[(b * p.Hq + hq) * p.Tq + i] = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
    }
  }
}

constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all

template <typename E>
void run(ffi::ThreadPool& pool, const Problem& p, const void* kc, const void* vc) {
  int64_t keys = 0;
  for (int64_t b = 0; b < p.B; ++b) keys += p.kv_len[b] - p.kv_start[b];
  const bool parallel = 2 * keys * p.Hq * p.Tq * p.D >= kParallelWork;
  const auto* k = static_cast<const typename E::T*>(kc);
  const auto* v = static_cast<const typename E::T*>(vc);
  pallas_attn::parallel_for(pool, p.B * p.Hkv, parallel, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) head<E>(p, k, v, t / p.Hkv, t % p.Hkv);
  });
}

ffi::Error KVAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                       ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> table,
                       ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_start,
                       ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::F32> descale,
                       ffi::Buffer<ffi::S32> tree, float scale, float softcap, int64_t left,
                       int64_t right, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || td.size() != 2 || td[0] != qd[0] ||
      cd[3] != qd[3] || qd[2] % cd[2] != 0 || v_cache.element_type() != k_cache.element_type())
    return ffi::Error::InvalidArgument("kv_attention: inconsistent shapes");
  Problem p;
  p.B = qd[0], p.Tq = qd[1], p.Hq = qd[2], p.D = qd[3];
  p.num_pages = cd[0], p.P = cd[1], p.Hkv = cd[2], p.G = p.Hq / p.Hkv;
  p.max_blocks = td[1];
  p.scale = scale, p.softcap = softcap, p.left = left, p.right = right;
  p.q = q.typed_data(), p.table = table.typed_data(), p.q_offset = q_offset.typed_data();
  p.kv_start = kv_start.typed_data(), p.kv_len = kv_len.typed_data();
  p.descale = descale.typed_data();
  p.tree = tree.element_count() ? tree.typed_data() : nullptr;
  p.out = out->typed_data(), p.lse = lse->typed_data();
  const void *kc = k_cache.untyped_data(), *vc = v_cache.untyped_data();
  switch (k_cache.element_type()) {
    case ffi::DataType::F32: run<F32>(pool, p, kc, vc); break;
    case ffi::DataType::BF16: run<BF16>(pool, p, kc, vc); break;
    case ffi::DataType::F16: run<F16>(pool, p, kc, vc); break;
    case ffi::DataType::F8E4M3FN: run<F8>(pool, p, kc, vc); break;
    default: return ffi::Error::InvalidArgument("kv_attention: unsupported cache dtype");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnKVAttention, KVAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_offset
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .Arg<ffi::Buffer<ffi::F32>>()  // descale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse
