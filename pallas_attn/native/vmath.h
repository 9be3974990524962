// Vector math for the native kernels: 16-lane float32 vectors (one AVX-512 register, two AVX2
// ones), exp and bfloat16 rounding. Scalar libm calls in the elementwise parts of a decode step
// (the SiLU of 8 rows x 1536 units, the softmax) cost as much as the products around them.
#pragma once

#include <cstdint>
#include <cstring>

namespace pallas_attn::vmath {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }

// exp(x) on every float32: Cephes' expf polynomial on x = n ln2 + r, |r| <= ln2 / 2 (relative
// error about 2e-7); 0 below -87, +inf above 88.7 (where float32 overflows), NaN stays NaN.
// For x <= 0 this is the softmax's exp (kv_attention.cc) bit for bit.
inline vf vexp(vf x) {
  const vi dead = x < splat(-87.0f), big = x > splat(88.7f);
  const vi nan = x != x;
  x = dead ? splat(-87.0f) : big ? splat(0.0f) : x;
  const vf t = x * splat(1.44269504088896341f);
  const vf half = t < splat(0.0f) ? splat(-0.5f) : splat(0.5f);
  const vi n = __builtin_convertvector(t + half, vi);  // round half away from zero
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
  y = dead ? splat(0.f) : y;
  y = big ? splat(__builtin_inff()) : y;
  return nan ? x + splat(0.0f) : y;  // x is still the NaN here (the selects above kept it)
}

// Each lane rounded to bfloat16 (nearest even, as XLA's convert) and widened back to float32.
inline vf round_bf16(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof(u));
  const vi nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu q = (u | 0x00400000u) & 0xffff0000u;  // a quiet NaN keeps its sign and top bits
  const vu out = nan ? q : r;
  vf y;
  std::memcpy(&y, &out, sizeof(y));
  return y;
}

}  // namespace pallas_attn::vmath
