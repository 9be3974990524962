// Vector math for the native kernels: 16-lane float32 vectors (one AVX-512 register, two AVX2
// ones) for the products, register-wide ones for the elementwise parts, exp and bfloat16
// rounding. Scalar libm calls in the elementwise parts of a decode step (the SiLU of 8 rows x
// 1536 units, the softmax) cost as much as the products around them.
#pragma once

#include <cstdint>
#include <cstring>

namespace pallas_attn::vmath {

// The kernels' block of lanes: the products' partial sums run in 16 lanes on every machine, so
// their sums (and roundings) are the same on AVX2 and AVX-512.
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * 4), aligned(4)));

// Loads and stores through a may_alias type: GCC lowers a std::memcpy of a vector wider than the
// registers into narrower stores and a wide reload (a failed store forward each time), and this
// into plain unaligned moves.
typedef float vf_mem __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
inline vf loadv(const float* p) { return *reinterpret_cast<const vf_mem*>(p); }
inline void storev(float* p, vf v) { *reinterpret_cast<vf_mem*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

// N-lane float32, int32 and uint32 vectors.
template <int N>
struct Lanes {
  typedef float f __attribute__((vector_size(N * 4)));
  typedef int32_t i __attribute__((vector_size(N * 4)));
  typedef uint32_t u __attribute__((vector_size(N * 4)));
  typedef float mem __attribute__((vector_size(N * 4), aligned(4), may_alias));
};

// The register's width. GCC lowers the compares, selects and conversions of a vector twice as
// wide lane by lane, through memory (an exp of 16 lanes cost about 10 ns a float on AVX2, 8
// lanes about 1 ns), so the elementwise loops below run on vn. kLanes is a multiple of it.
#if defined(__AVX512F__)
constexpr int kNative = 16;
#else
constexpr int kNative = 8;
#endif
typedef Lanes<kNative>::f vn;
inline vn loadn(const float* p) { return *reinterpret_cast<const Lanes<kNative>::mem*>(p); }
inline void storen(float* p, vn v) { *reinterpret_cast<Lanes<kNative>::mem*>(p) = v; }
inline vn splatn(float x) { return vn{} + x; }

// exp(x) on every float32: Cephes' expf polynomial on x = n ln2 + r, |r| <= ln2 / 2 (relative
// error about 2e-7); 0 below -87, +inf above 88.7 (where float32 overflows), NaN stays NaN.
// For x <= 0 this is the softmax's exp (kv_attention.cc).
inline vn vexp(vn x) {
  typedef Lanes<kNative>::i vi;
  const vi dead = x < splatn(-87.0f), big = x > splatn(88.7f);
  const vi nan = x != x;
  x = dead ? splatn(-87.0f) : big ? splatn(0.0f) : x;
  const vn t = x * splatn(1.44269504088896341f);
  const vn half = t < splatn(0.0f) ? splatn(-0.5f) : splatn(0.5f);
  const vi n = __builtin_convertvector(t + half, vi);  // round half away from zero
  const vn nf = __builtin_convertvector(n, vn);
  const vn r = x - nf * splatn(0.693359375f) + nf * splatn(2.12194440e-4f);
  vn p = splatn(1.9875691500e-4f);
  p = p * r + splatn(1.3981999507e-3f);
  p = p * r + splatn(8.3334519073e-3f);
  p = p * r + splatn(4.1665795894e-2f);
  p = p * r + splatn(1.6666665459e-1f);
  p = p * r + splatn(5.0000001201e-1f);
  vn y = p * r * r + r + splatn(1.0f);
  vi bits;
  std::memcpy(&bits, &y, sizeof(y));
  bits += n << 23;
  std::memcpy(&y, &bits, sizeof(y));
  y = dead ? splatn(0.f) : y;
  y = big ? splatn(__builtin_inff()) : y;
  return nan ? x + splatn(0.0f) : y;  // x is still the NaN here (the selects above kept it)
}

// Each lane rounded to bfloat16 (nearest even, as XLA's convert) and widened back to float32.
inline vn round_bf16(vn x) {
  typedef Lanes<kNative>::i vi;
  typedef Lanes<kNative>::u vu;
  vu u;
  std::memcpy(&u, &x, sizeof(u));
  const vi nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu q = (u | 0x00400000u) & 0xffff0000u;  // a quiet NaN keeps its sign and top bits
  const vu out = nan ? q : r;
  vn y;
  std::memcpy(&y, &out, sizeof(y));
  return y;
}

inline vn vmax(vn a, vn b) { return a > b ? a : b; }

// The sum of kLanes lanes held as kLanes / kNative register-wide parts (lanes 0-15 in order), by
// a tree of halvings: 8 + 8, then 4 + 4, then (0 + 2) + (1 + 3), on every machine.
typedef Lanes<8>::f v8;
typedef Lanes<4>::f v4;
inline float hsum8(v8 a) {
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float hsum_parts(const vn (&parts)[kLanes / kNative]) {
#if defined(__AVX512F__)
  const vn v = parts[0];
  return hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  return hsum8(parts[0] + parts[1]);
#endif
}

}  // namespace pallas_attn::vmath
