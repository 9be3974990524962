// One decoder layer of a Llama-family model for a decode step (or a short verification) on CPU,
// as one XLA FFI call: models/fused_decode.py is the Python side.
//
// XLA:CPU runs a layer of a decode step as dozens of small ops (norms, RoPE, the cache scatter,
// the attention call, residual adds, SiLU * up), each a few microseconds, around four few-row
// products; at B = 1 on a small model those ops took most of the step. Here the layer is
//
//   h = rmsnorm(x) * w_in;  qkv = h @ W_qkv (+ bias);  q, k = rope(q, k);  cache[pos] = k, v
//   x = x + attention(q, cache) @ W_o;  h = rmsnorm(x) * w_post;  g, u = h @ W_gate_up
//   x = x + (silu(g) * u) @ W_down
//
// for M = B * T rows (T new tokens per row at positions lengths[b] + t), the products by
// rows_matmul.cc's kernels (float32 / bfloat16 / Q8_0 / Q4_0 / Q4_1 panels, through
// rows_matmul.h) and the attention by kv_attention.cc's (through kv_attention.h), both sharing
// their work with XLA's intra-op pool as their own handlers do, as SiLU * up does at several
// rows; the rest of the elementwise work is on the calling thread (a few thousand values). The
// caches are aliased to the outputs and written in place (paged [num_pages, P, Hkv, D] through
// the block table; a contiguous [B, S, Hkv, D] cache is passed with table[b] = b and P = S);
// positions with no slot are dropped, as the jnp scatter drops them.
//
// Roundings: with bfloat16 activations every value the unfused layer stores in bfloat16 (the
// norms' outputs, each product's output, RoPE's, the attention's, the residual sums) is rounded
// to bfloat16 here at the same point, so both compute the same quantities up to float32
// reassociation; with float32 activations nothing is rounded.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_attention.h"
#include "parallel.h"
#include "rows_matmul.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// A vector in float32 or bfloat16 (x, norm weights, bias, the caches' elements).
struct View {
  const void* p;
  bool bf16;
  float operator[](int64_t i) const {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i])
                : static_cast<const float*>(p)[i];
  }
};

// dst[i] = src[i] in float32, src float32 or bfloat16 (exact).
void widen(const void* src, bool bf16, float* dst, int64_t n) {
  if (!bf16) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(h[i]);
}

inline bool float_type(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

struct Layer {
  int64_t B, T, M, dim, Hq, Hkv, D, mlp, F;  // F = (Hq + 2 Hkv) D: qkv features
  int64_t num_pages, P, max_blocks;
  float eps, scale, softcap;
  int64_t left, right;
  bool bf16;  // activations in bfloat16
  // Rounds to the activation dtype (identity for float32).
  float r(float v) const { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }
};

// v[i] = r(v[i]) for i < n, a register at a time (vmath::round_bf16 is L.r lane-wise; identity
// in float32). A scalar rounding per value of the products' outputs, the norms, RoPE and the
// residuals cost about 0.3 ms per row of a SmolLM2 bfloat16 step, on the calling thread alone.
void round_all(const Layer& L, float* v, int64_t n) {
  if (!L.bf16) return;
  using namespace pallas_attn::vmath;
  int64_t i = 0;
  for (; i + kNative <= n; i += kNative) storen(v + i, round_bf16(loadn(v + i)));
  for (; i < n; ++i) v[i] = L.r(v[i]);
}

// out[m, :] = r(w * r(x[m] / rms(x[m]))), statistics in float32 (models.transformer.RMSNorm);
// w the weights in float32. The sum of squares in kNative lanes, then across them.
void rmsnorm(const Layer& L, const float* x, const float* w, float* out) {
  using namespace pallas_attn::vmath;
  for (int64_t m = 0; m < L.M; ++m) {
    const float* xm = x + m * L.dim;
    float* om = out + m * L.dim;
    vn acc = splatn(0.f);
    int64_t i = 0;
    for (; i + kNative <= L.dim; i += kNative) acc += loadn(xm + i) * loadn(xm + i);
    float ss = 0.f;
    for (int j = 0; j < kNative; ++j) ss += acc[j];
    for (; i < L.dim; ++i) ss += xm[i] * xm[i];
    const float inv = 1.0f / std::sqrt(ss * (1.0f / float(L.dim)) + L.eps);
    i = 0;
    if (L.bf16)
      for (; i + kNative <= L.dim; i += kNative)
        storen(om + i, round_bf16(loadn(w + i) * round_bf16(loadn(xm + i) * splatn(inv))));
    else
      for (; i + kNative <= L.dim; i += kNative)
        storen(om + i, loadn(w + i) * (loadn(xm + i) * splatn(inv)));
    for (; i < L.dim; ++i) om[i] = L.r(w[i] * L.r(xm[i] * inv));
  }
}

// Rotates dims (i, i + D/2) of a head row in place (models.transformer.apply_rope).
inline void rope(const Layer& L, float* v, const float* cos, const float* sin) {
  using namespace pallas_attn::vmath;
  const int64_t half = L.D / 2;
  int64_t i = 0;
  for (; i + kNative <= half; i += kNative) {
    const vn a = loadn(v + i), b = loadn(v + i + half), c = loadn(cos + i), s = loadn(sin + i);
    vn x = a * c - b * s, y = b * c + a * s;
    if (L.bf16) x = round_bf16(x), y = round_bf16(y);
    storen(v + i, x);
    storen(v + i + half, y);
  }
  for (; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = L.r(a * cos[i] - b * sin[i]);
    v[i + half] = L.r(b * cos[i] + a * sin[i]);
  }
}

inline void store(void* cache, bool bf16, int64_t at, const float* src, int64_t n) {
  if (bf16) {
    auto* c = static_cast<uint16_t*>(cache) + at;
    for (int64_t i = 0; i < n; ++i) c[i] = float_to_bf16(src[i]);
  } else {
    std::memcpy(static_cast<float*>(cache) + at, src, n * sizeof(float));
  }
}

// act[i] = silu(gate[i]) * up[i] for gu = [n, 2] (gate, up pairs): jax.nn.silu as XLA runs
// it, g * (1 / (1 + exp(-g))), each op rounded to the activation dtype; a register of units at a
// time (a scalar exp per unit cost as much as the layer's down projection at 8 rows).
void silu_mul(const Layer& L, const float* gu, float* act, int64_t n) {
  using namespace pallas_attn::vmath;
  constexpr int N = kNative;
  const auto r = [&](vn v) { return L.bf16 ? round_bf16(v) : v; };
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const vn a = loadn(gu + 2 * i), b = loadn(gu + 2 * i + N);
#if defined(__AVX512F__)
    const vn g = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
    const vn u = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                         29, 31);
#else
    const vn g = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    const vn u = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
    const vn sig = r(splatn(1.0f) / r(splatn(1.0f) + r(vexp(-g))));
    storen(act + i, r(r(g * sig) * u));
  }
  if (i < n) {  // the tail through a zero-padded vector, the same arithmetic
    float a[2 * N] = {};
    std::memcpy(a, gu + 2 * i, 2 * (n - i) * sizeof(float));
    float out[N];
    silu_mul(L, a, out, N);
    std::memcpy(act + i, out, (n - i) * sizeof(float));
  }
}

ffi::Error DecodeLayer(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> cos,
                       ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer, ffi::AnyBuffer,
                       ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                       ffi::AnyBuffer norm_in, ffi::AnyBuffer w_qkv, ffi::AnyBuffer b_qkv,
                       ffi::AnyBuffer w_o, ffi::AnyBuffer norm_post, ffi::AnyBuffer w_gu,
                       ffi::AnyBuffer w_down, float eps, float scale, float softcap, int64_t left,
                       int64_t right, int64_t num_heads, int32_t kind_qkv, int32_t kind_o,
                       int32_t kind_gu, int32_t kind_down, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto xd = x.dimensions(), cd = k_out->dimensions(), td = table.dimensions();
  const auto gd = w_gu.dimensions(), dd = w_down.dimensions();
  if (xd.size() != 3 || cd.size() != 4 || td.size() != 2 || td[0] != xd[0] || gd.size() != 3 ||
      dd.size() != 3 || !float_type(x.element_type()) || y->element_type() != x.element_type() ||
      !float_type(k_out->element_type()) || v_out->element_type() != k_out->element_type() ||
      num_heads % cd[2] != 0 || cd[3] % 2 != 0 || cos.dimensions().size() != 3 ||
      cos.dimensions()[2] * 2 != cd[3] || cos.element_count() != xd[0] * xd[1] * cd[3] / 2)
    return ffi::Error::InvalidArgument(
        "decode_layer: want x [B, T, dim], caches [num_pages, P, Hkv, D], table [B, blocks], "
        "cos/sin [B, T, D / 2]");
  Layer L;
  L.B = xd[0], L.T = xd[1], L.M = L.B * L.T, L.dim = xd[2];
  L.num_pages = cd[0], L.P = cd[1], L.Hkv = cd[2], L.D = cd[3], L.Hq = num_heads;
  L.max_blocks = td[1];
  L.F = (L.Hq + 2 * L.Hkv) * L.D;
  // The MLP width: the down projection's K (float panels [P, K, 32]; quantized [P, K / 32, ..]).
  const bool float_down = kind_down == pallas_attn::kWeightF32 ||
                          kind_down == pallas_attn::kWeightBF16 ||
                          kind_down == pallas_attn::kWeightBF16Exact;
  L.mlp = float_down ? dd[1] : dd[1] * 32;
  L.eps = eps, L.scale = scale, L.softcap = softcap, L.left = left, L.right = right;
  L.bf16 = x.element_type() == ffi::DataType::BF16;
  if (norm_in.element_count() != L.dim || norm_post.element_count() != L.dim ||
      (b_qkv.element_count() != 0 && b_qkv.element_count() != L.F) ||
      !float_type(norm_in.element_type()) || !float_type(norm_post.element_type()) ||
      (b_qkv.element_count() != 0 && !float_type(b_qkv.element_type())) ||
      gd[0] * 32 < 2 * L.mlp)
    return ffi::Error::InvalidArgument("decode_layer: norm weights [dim], qkv bias [F] or [0]");
  const bool cache_bf16 = k_out->element_type() == ffi::DataType::BF16;
  const int64_t M = L.M, D = L.D, G = L.Hq / L.Hkv, HD = L.Hq * D;

  // Scratch, reused across calls of this thread (sizes change only with the model).
  thread_local std::vector<float> buf;
  const int64_t need = 3 * M * L.dim + M * L.F + 2 * M * HD + 3 * M * L.mlp + L.B * L.Hq * L.T +
                       2 * L.B * L.Hkv + 3 * L.B + 2 * L.dim;
  if (int64_t(buf.size()) < need) buf.resize(need);
  float* res = buf.data();       // [M, dim] the residual stream
  float* h = res + M * L.dim;    // [M, dim] norm outputs, then product outputs
  float* o = h + M * L.dim;      // [M, dim]
  float* qkv = o + M * L.dim;    // [M, F]
  float* q = qkv + M * L.F;      // [B, T, Hq, D]
  float* att = q + M * HD;       // [B, T, Hq, D]
  float* gu = att + M * HD;      // [M, 2 mlp]
  float* act = gu + 2 * M * L.mlp;  // [M, mlp]
  float* lse = act + M * L.mlp;     // [B, Hq, T]
  float* descale = lse + L.B * L.Hq * L.T;  // [2, B, Hkv] ones
  auto* i32 = reinterpret_cast<int32_t*>(descale + 2 * L.B * L.Hkv);
  int32_t *q_offset = i32, *kv_start = i32 + L.B, *kv_len = i32 + 2 * L.B;
  float* w_in = reinterpret_cast<float*>(i32 + 3 * L.B);  // [dim] the norms' weights, float32
  float* w_post = w_in + L.dim;                           // [dim]
  static_assert(sizeof(float) == sizeof(int32_t), "int32 scratch in the float arena");

  widen(x.untyped_data(), L.bf16, res, M * L.dim);
  widen(norm_in.untyped_data(), norm_in.element_type() == ffi::DataType::BF16, w_in, L.dim);
  widen(norm_post.untyped_data(), norm_post.element_type() == ffi::DataType::BF16, w_post, L.dim);
  const int32_t* len = lengths.typed_data();
  const int32_t* tab = table.typed_data();
  for (int64_t b = 0; b < L.B; ++b) q_offset[b] = len[b], kv_start[b] = 0, kv_len[b] = len[b] + L.T;
  for (int64_t i = 0; i < 2 * L.B * L.Hkv; ++i) descale[i] = 1.f;

  auto matmul = [&](int32_t kind, const float* in, int64_t K, const ffi::AnyBuffer& w, float* out,
                    int64_t N) {
    if (!pallas_attn::rows_matmul_packed(pool, kind, in, M, K, w.untyped_data(), out, N))
      return false;
    round_all(L, out, M * N);
    return true;
  };
  const ffi::Error bad_kind = ffi::Error::InvalidArgument("decode_layer: unknown weight kind");

  // Attention half.
  rmsnorm(L, res, w_in, h);
  if (!matmul(kind_qkv, h, L.dim, w_qkv, qkv, L.F)) return bad_kind;
  if (b_qkv.element_count()) {
    const View bias{b_qkv.untyped_data(), b_qkv.element_type() == ffi::DataType::BF16};
    for (int64_t m = 0; m < M; ++m)
      for (int64_t f = 0; f < L.F; ++f) qkv[m * L.F + f] = L.r(qkv[m * L.F + f] + bias[f]);
  }
  void* kc = k_out->untyped_data();
  void* vc = v_out->untyped_data();
  for (int64_t m = 0; m < M; ++m) {  // qkv features are [Hkv, G + 2, D]: G queries, key, value
    const int64_t b = m / L.T, t = m % L.T, pos = int64_t(len[b]) + t;
    const float* c = cos.typed_data() + m * (D / 2);
    const float* s = sin.typed_data() + m * (D / 2);
    const int64_t blk = pos / L.P;
    const int64_t page = blk < L.max_blocks && pos >= 0 ? tab[b * L.max_blocks + blk] : -1;
    const bool slot = page >= 0 && page < L.num_pages;
    for (int64_t kh = 0; kh < L.Hkv; ++kh) {
      float* unit = qkv + m * L.F + kh * (G + 2) * D;
      for (int64_t g = 0; g < G; ++g) {
        rope(L, unit + g * D, c, s);
        std::memcpy(q + (m * L.Hq + kh * G + g) * D, unit + g * D, D * sizeof(float));
      }
      rope(L, unit + G * D, c, s);
      if (slot) {
        const int64_t at = ((page * L.P + pos % L.P) * L.Hkv + kh) * D;
        store(kc, cache_bf16, at, unit + G * D, D);
        store(vc, cache_bf16, at, unit + (G + 1) * D, D);
      }
    }
  }
  if (!pallas_attn::kv_attention(pool, k_out->element_type(), L.B, L.T, L.Hq, L.Hkv, D,
                                 L.num_pages, L.P, L.max_blocks, L.scale, L.softcap, L.left,
                                 L.right, q, kc, vc, tab, q_offset, kv_start, kv_len, descale,
                                 nullptr, att, lse))
    return ffi::Error::InvalidArgument("decode_layer: unsupported cache dtype");
  round_all(L, att, M * HD);
  if (!matmul(kind_o, att, HD, w_o, o, L.dim)) return bad_kind;
  // The residual keeps the sum in the activation dtype; the norm reads it unrounded, as XLA's
  // fusion of the bfloat16 add into the norm's float32 statistics does.
  for (int64_t i = 0; i < M * L.dim; ++i) o[i] += res[i], res[i] = o[i];
  round_all(L, res, M * L.dim);

  // MLP half: gate_up features are [mlp, 2] (gate, up of each hidden unit).
  rmsnorm(L, o, w_post, h);
  if (!matmul(kind_gu, h, L.dim, w_gu, gu, 2 * L.mlp)) return bad_kind;
  // SiLU * up: an exp per unit, 12k of them at 8 rows (a twentieth of the layer on one thread
  // while the others wait); split in runs of whole registers, so each unit's arithmetic is the
  // same wherever the cut falls.
  const int64_t units = M * L.mlp, run = 1024;
  const auto silu_runs = [&](int64_t c0, int64_t c1) {
    const int64_t u0 = c0 * run, u1 = c1 * run < units ? c1 * run : units;
    silu_mul(L, gu + 2 * u0, act + u0, u1 - u0);
  };
  pallas_attn::parallel_for(pool, (units + run - 1) / run, units >= 2 * run, silu_runs);
  if (!matmul(kind_down, act, L.mlp, w_down, o, L.dim)) return bad_kind;
  if (L.bf16) {
    auto* out = static_cast<uint16_t*>(y->untyped_data());
    for (int64_t i = 0; i < M * L.dim; ++i) o[i] += res[i];
    round_all(L, o, M * L.dim);  // exact in bfloat16 now: the top half of each float's bits
    for (int64_t i = 0; i < M * L.dim; ++i) {
      uint32_t u;
      std::memcpy(&u, &o[i], 4);
      out[i] = uint16_t(u >> 16);
    }
  } else {
    auto* out = static_cast<float*>(y->untyped_data());
    for (int64_t i = 0; i < M * L.dim; ++i) out[i] = res[i] + o[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnDecodeLayer, DecodeLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [B, T, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [B, T, D / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::AnyBuffer>()         // k_cache (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()         // v_cache (aliased to v_out)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table [B, max_blocks]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths [B]
                                  .Arg<ffi::AnyBuffer>()         // input norm weight [dim]
                                  .Arg<ffi::AnyBuffer>()         // qkv panels
                                  .Arg<ffi::AnyBuffer>()         // qkv bias [F] or [0]
                                  .Arg<ffi::AnyBuffer>()         // o panels
                                  .Arg<ffi::AnyBuffer>()         // post-attention norm [dim]
                                  .Arg<ffi::AnyBuffer>()         // gate_up panels
                                  .Arg<ffi::AnyBuffer>()         // down panels
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int32_t>("kind_qkv")
                                  .Attr<int32_t>("kind_o")
                                  .Attr<int32_t>("kind_gu")
                                  .Attr<int32_t>("kind_down")
                                  .Ret<ffi::AnyBuffer>()   // y [B, T, dim], x's dtype
                                  .Ret<ffi::AnyBuffer>()   // k_cache
                                  .Ret<ffi::AnyBuffer>());  // v_cache
