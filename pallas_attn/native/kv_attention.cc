// Attention of a few new queries over a KV cache on CPU, in one pass over each row's keys: the
// attention step of attention_with_kvcache's "xla" path on the CPU backend (pallas_attn/cpu.py).
//
// Tasks are (group of batch rows reading the same keys, span of those keys); a task walks its
// span position by position, reading each position's keys and values of all Hkv heads (adjacent
// in the cache) once for all Tq x Hq queries of the group's rows, in place (paged through the
// block table, or a contiguous row; float32, bfloat16, float16 or FP8 e4m3 with a per-(row,
// head) descale), in chunks of kChunk keys with an online softmax (natural-log lse); a query's
// spans are merged at the end (split-KV).
// Within a chunk, each query row's scores come 16 keys at a time (16 products summed across lanes
// by one shuffle tree; long rows (kLongRow): per key, for 8 query rows at once; AVX2 without
// AVX-512: 8 keys at a time, horizontal adds), and values are accumulated for 8 query rows at a
// time in registers. 16-bit and FP8 caches are converted to float32 a few keys (one head's
// values) at a time, into buffers that stay in L1.
// The masks are masks.visible's: keys [kv_start, kv_len), query i at q_offset + i, window
// (left, right) with -1 unbounded, and an optional tree mask over the last Tq keys. Rows that
// see no key give 0 and lse -inf.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "rows.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using pallas_attn::vmath::kLanes;
using pallas_attn::vmath::kNative;
using pallas_attn::vmath::loadn;
using pallas_attn::vmath::loadv;
using pallas_attn::vmath::splatn;
using pallas_attn::vmath::storen;
using pallas_attn::vmath::storev;
using pallas_attn::vmath::vexp;  // the softmax's exp (x <= 0, -inf -> 0)
using vf = pallas_attn::vmath::vf;
using vn = pallas_attn::vmath::vn;
constexpr int kChunk = 4 * kLanes;  // keys per online-softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hsum(vf v) {  // a tree of halvings (4 adds), not 15 scalar ones
  return pallas_attn::vmath::hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
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

// The H x D row of one position (all KV heads) -> float32, head h times scale[h] (FP8 descale;
// 1 otherwise); float32 rows unscaled are read in place.
// float16 and bfloat16 go 8 at a time through F16C's vcvtph2ps and a 16-bit shift: GCC leaves
// the scalar _Float16 conversion unvectorized (a libgcc call per element without AVX512-FP16), and
// a float16 cache read 9x slower than a float32 one at batch 8. Both conversions are exact, so the
// floats are the scalar loop's.
template <typename E>
inline void convert8(const typename E::T* src, float* dst, float s) {
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (std::is_same_v<E, F16> || std::is_same_v<E, BF16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m256 f;
    if constexpr (std::is_same_v<E, F16>)
      f = _mm256_cvtph_ps(h);
    else
      f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(dst, s == 1.f ? f : _mm256_mul_ps(f, _mm256_set1_ps(s)));  // x * 1 == x
    return;
  }
#endif
  for (int i = 0; i < 8; ++i) dst[i] = E::get(src[i]) * s;
}

template <typename E>
inline const float* as_float(const typename E::T* src, float* buf, int64_t H, int64_t D,
                             const float* scale, bool unscaled) {
  if constexpr (std::is_same_v<E, F32>) {
    if (unscaled) return src;
  }
  for (int64_t h = 0; h < H; ++h) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) convert8<E>(src + h * D + d, buf + h * D + d, scale[h]);
    for (; d < D; ++d) buf[h * D + d] = E::get(src[h * D + d]) * scale[h];
  }
  return buf;
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

// out[j] = q . k[j][off : off + D] for j < cnt <= 16 (lanes >= cnt are 0): the 16 products'
// vectors are summed across lanes together, by a tree of two-source shuffles (15 adds for 16
// dot products instead of a horizontal sum each).
inline vf load_part(const float* p, int64_t cnt) {
  float t[kLanes] = {};
  std::memcpy(t, p, cnt * sizeof(float));
  return loadv(t);
}

inline void scores16(const float* q, const float* const* k, int64_t off, int64_t cnt, int64_t D,
                     float* out) {
  vf a[kLanes];
  for (int j = 0; j < kLanes; ++j) a[j] = vf{};
  int64_t d = 0;
  if (cnt == kLanes) {
    for (; d + kLanes <= D; d += kLanes) {
      const vf qv = loadv(q + d);
      for (int j = 0; j < kLanes; ++j) a[j] += qv * loadv(k[j] + off + d);
    }
  } else {
    for (; d + kLanes <= D; d += kLanes) {
      const vf qv = loadv(q + d);
      for (int j = 0; j < cnt; ++j) a[j] += qv * loadv(k[j] + off + d);
    }
  }
  if (d < D) {
    const vf qv = load_part(q + d, D - d);
    for (int j = 0; j < cnt; ++j) a[j] += qv * load_part(k[j] + off + d, D - d);
  }
  vf b[8], c[4], e[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: key j's 8 partial sums, 8-15: key j + 8's
    b[j] = __builtin_shufflevector(a[j], a[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                   22, 23) +
           __builtin_shufflevector(a[j], a[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                   29, 30, 31);
  for (int j = 0; j < 4; ++j)  // quads: keys j, j + 4, j + 8, j + 12
    c[j] = __builtin_shufflevector(b[j], b[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                                   26, 27) +
           __builtin_shufflevector(b[j], b[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                                   30, 31);
  for (int j = 0; j < 2; ++j)  // pairs: keys j, j + 2, .., j + 14
    e[j] = __builtin_shufflevector(c[j], c[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                   28, 29) +
           __builtin_shufflevector(c[j], c[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                   30, 31);
  const vf r = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                       28, 14, 30) +
               __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                       29, 15, 31);
  if (cnt == kLanes) {
    storev(out, r);
  } else {
    float t[kLanes];
    storev(t, r);
    std::memcpy(out, t, cnt * sizeof(float));
  }
}

// f(r0, RB) over rows [begin, end) in blocks of up to 8 (pallas_attn::with_rows): RB rows from
// r0, RB a compile-time count, so a block's accumulators stay in registers.
template <typename F>
inline void row_blocks(int64_t begin, int64_t end, F&& f) {
  for (int64_t r0 = begin; r0 < end; r0 += pallas_attn::kMaxRows)
    pallas_attn::with_rows(end - r0, [&](auto RB) { f(r0, RB); });
}

// acc[r, :] += sum over c < n of w[r * kChunk + c] * v[c][off : off + D], for RB rows. DB
// vectors of D at a time, so that RB x DB independent accumulators hide the FMA latency (one
// accumulator per row had each position wait for the last: 4 cycles per FMA). Each accumulator
// still sums c = 0, 1, .. in order.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// weigh_values in AVX2's 256-bit registers (GCC compiles the 16-lane form through memory there).
// The same sums: each accumulator adds w * v for c = 0, 1, .. as one FMA each.
template <int RB>
void weigh_values(const float* const* v, int64_t n, int64_t off, const float* w, float* acc,
                  int64_t D) {
  constexpr int DB = RB <= 1 ? 8 : RB <= 2 ? 6 : RB <= 3 ? 4 : RB <= 6 ? 2 : 1;  // <= 12 registers
  int64_t d = 0;
  auto pass = [&](auto db) {
    constexpr int B = decltype(db)::value;
    __m256 a[RB][B];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < B; ++j) a[r][j] = _mm256_loadu_ps(acc + r * D + d + 8 * j);
    for (int64_t c = 0; c < n; ++c) {
      const float* vc = v[c] + off + d;
      for (int j = 0; j < B; ++j) {
        const __m256 x = _mm256_loadu_ps(vc + 8 * j);
        for (int r = 0; r < RB; ++r)
          a[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(w[r * kChunk + c]), x, a[r][j]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < B; ++j) _mm256_storeu_ps(acc + r * D + d + 8 * j, a[r][j]);
  };
  for (; d + 8 * DB <= D; d += 8 * DB) pass(std::integral_constant<int, DB>{});
  for (; d + 8 <= D; d += 8) pass(std::integral_constant<int, 1>{});
  for (; d < D; ++d)
    for (int r = 0; r < RB; ++r) {
      float a = acc[r * D + d];
      for (int64_t c = 0; c < n; ++c) a += w[r * kChunk + c] * v[c][off + d];
      acc[r * D + d] = a;
    }
}
#else
template <int RB>
void weigh_values(const float* const* v, int64_t n, int64_t off, const float* w, float* acc,
                  int64_t D) {
  constexpr int DB = RB <= 2 ? 8 : RB <= 4 ? 4 : 2;  // RB x DB <= 16 registers
  int64_t d = 0;
  for (; d + DB * kLanes <= D; d += DB * kLanes) {
    vf a[RB][DB];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < DB; ++j) a[r][j] = loadv(acc + r * D + d + j * kLanes);
    for (int64_t c = 0; c < n; ++c) {
      const float* vc = v[c] + off + d;
      for (int j = 0; j < DB; ++j) {
        const vf x = loadv(vc + j * kLanes);
        for (int r = 0; r < RB; ++r) a[r][j] += w[r * kChunk + c] * x;
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < DB; ++j) storev(acc + r * D + d + j * kLanes, a[r][j]);
  }
  for (; d + kLanes <= D; d += kLanes) {
    vf a[RB];
    for (int r = 0; r < RB; ++r) a[r] = loadv(acc + r * D + d);
    for (int64_t c = 0; c < n; ++c) {
      const vf x = loadv(v[c] + off + d);
      for (int r = 0; r < RB; ++r) a[r] += w[r * kChunk + c] * x;
    }
    for (int r = 0; r < RB; ++r) storev(acc + r * D + d, a[r]);
  }
  for (; d < D; ++d)
    for (int r = 0; r < RB; ++r) {
      float a = acc[r * D + d];
      for (int64_t c = 0; c < n; ++c) a += w[r * kChunk + c] * v[c][off + d];
      acc[r * D + d] = a;
    }
}
#endif

// Rows of at least this many elements get their scores position-major (score_rows: a horizontal
// sum per score is cheap next to the row's products, and streaming positions in order keeps the
// hardware prefetcher on when the cache is in DRAM); shorter ones per query row (scores16). With
// AVX-512, 64-element rows (SmolLM2, Llama 3.2 1B) go per query row too: 16 keys' sums share
// one shuffle tree, where a 64-element row's horizontal sum costs as much as its 4 FMAs (a
// decode step's attention at batch 8 over 200 keys 1.3x faster). AVX2 compiles scores16's
// 16-lane shuffles through memory (1.7x slower there), so it keeps 64.
#if defined(__AVX512F__)
constexpr int64_t kLongRow = 128;
#else
constexpr int64_t kLongRow = 64;
#endif

// s[r * kChunk] = q[r] . k[0 : D] for RB query rows: the key row is loaded once for all of them.
#if defined(__AVX2__) && !defined(__AVX512F__)
// score_rows in AVX2's 256-bit registers: GCC compiles hsum's 16-lane shuffles through memory
// there, which made the scores 12x the cost of the values' products on a decode step (a third of
// a SmolLM2 step at batch 8). The same sums: each row's 16 lanes as two 8-lane halves, one FMA
// per lane and block of 16, then hsum8 of the halves' sum; more than 4 rows (8 accumulators) go
// 4 at a time, so nothing spills.
template <int RB>
void score_rows(const float* q, const float* k, int64_t D, float* s) {
  if constexpr (RB > 4) {
    score_rows<4>(q, k, D, s);
    score_rows<RB - 4>(q + 4 * D, k, D, s + 4 * kChunk);
  } else {
    static_assert(kNative == 8, "AVX2 without AVX-512: vn is one 256-bit register");
    vn lo[RB], hi[RB];
    for (int r = 0; r < RB; ++r) lo[r] = hi[r] = vn{};
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const vn k0 = loadn(k + d), k1 = loadn(k + d + 8);
      for (int r = 0; r < RB; ++r) {
        lo[r] += loadn(q + r * D + d) * k0;
        hi[r] += loadn(q + r * D + d + 8) * k1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      float x = pallas_attn::vmath::hsum8(lo[r] + hi[r]);
      for (int64_t e = d; e < D; ++e) x += q[r * D + e] * k[e];
      s[r * kChunk] = x;
    }
  }
}
#else
template <int RB>
void score_rows(const float* q, const float* k, int64_t D, float* s) {
  vf a[RB];
  for (int r = 0; r < RB; ++r) a[r] = vf{};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const vf kv = loadv(k + d);
    for (int r = 0; r < RB; ++r) a[r] += loadv(q + r * D + d) * kv;
  }
  for (int r = 0; r < RB; ++r) {
    float x = hsum(a[r]);
    for (int64_t e = d; e < D; ++e) x += q[r * D + e] * k[e];
    s[r * kChunk] = x;
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// out[j] = q . k[j][off : off + D] for j < cnt <= 8, D a multiple of 8, in AVX2 registers: one
// accumulator per key (q's vector loaded once for the 8 keys), the 8 sums reduced together by a
// tree of horizontal adds (9 instructions for 8 scores). score_rows' per-key call, with a
// horizontal sum per query row, took 2.5x the time of the values' products at Hkv = 3, G = 3.
inline void scores8(const float* q, const float* const* k, int64_t off, int64_t cnt, int64_t D,
                    float* out) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  if (cnt == 8) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j)
        a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + off + d), a[j]);
    }
  } else {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < cnt; ++j)
        a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + off + d), a[j]);
    }
  }
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0 = _mm256_hadd_ps(h01, h23), h1 = _mm256_hadd_ps(h45, h67);
  // h0: lanes 0-3 keys 0-3 over dims 0-3 of each 8, lanes 4-7 the same keys over dims 4-7.
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                 _mm256_permute2f128_ps(h0, h1, 0x31));
  if (cnt == 8) {
    _mm256_storeu_ps(out, r);
  } else {
    float t[8];
    _mm256_storeu_ps(t, r);
    std::memcpy(out, t, cnt * sizeof(float));
  }
}
constexpr bool kScores8 = true;
#else
inline void scores8(const float*, const float* const*, int64_t, int64_t, int64_t, float*) {}
constexpr bool kScores8 = false;
#endif

// Running softmax state of every query row of one batch row over a span of its keys: per head
// h and row r = i * G + g, the max m, the sum l and the unnormalised output acc [D].
struct Partial {
  float *m, *l, *acc;  // [rows], [rows], [rows * D]: views of run's one buffer
  void bind(float* at, int64_t rows) { m = at, l = at + rows, acc = at + 2 * rows; }
  void reset(int64_t rows, int64_t D) {  // by the task itself: in parallel, and into its cache
    for (int64_t r = 0; r < rows; ++r) m[r] = kNegInf, l[r] = 0.f;
    std::memset(acc, 0, rows * D * sizeof(float));
  }
};

// A thread's scratch, kept across calls: a decode step runs this kernel once per layer with
// tasks of a few dozen keys each, where allocating per task was a tenth of the kernel's time.
template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(n);
  return v.data();
}

// Keys [lo, hi) that query i of batch row b may see (before the tree mask): masks.visible's
// rule, [kv_start, kv_len) cut to the window around its position q_offset + i.
inline void key_range(const Problem& p, int64_t b, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t pos = int64_t(p.q_offset[b]) + i;
  lo = p.kv_start[b], hi = p.kv_len[b];
  if (p.left >= 0 && pos - p.left > lo) lo = pos - p.left;
  if (p.right >= 0 && pos + p.right + 1 < hi) hi = pos + p.right + 1;
}

// Batch rows that read the same keys: their block tables agree on every page any of them reads,
// with the same FP8 descale and no tree mask. A ragged verification's draft rows are rows of
// their request's pages (one row per draft token, each seeing one key more), so one pass over a
// request's keys serves its row and its draft rows, as a row of Tq queries does. rows[0]'s table
// and descale are read.
struct Group {
  const int64_t* rows;
  int64_t n;
};

// Keys are cut into spans at fixed absolute positions, each span of a group a task whose partial
// result is merged by lse in span order. The cut depends on the positions only, not on the row's
// length, the batch, its groups or the thread count, so a query's output is the same bit for bit
// whichever rows share its call (the engine's batches change every step) or its pass over the
// keys (a group), and however many threads run it. Spans are kSplitKeys long below kSplitLongAt,
// kSplitLong past it: a decode step's few hundred keys are still worth both threads (each
// layer's cache comes from memory, the weights streamed since have evicted it), while a long
// context is not cut into a span per 64 keys, each with its partial to fill and merge (a bfloat16
// row of 8192 keys read 15% slower than in spans of 512). Spans stay equal past kSplitLongAt
// because a thread claims a run of consecutive tasks: spans growing with the position (a
// power-of-two range cut in 4) put a third of a long row in one thread's run.
constexpr int64_t kSplitKeys = 64, kSplitLongAt = 512, kSplitLong = 256;
static_assert(kSplitKeys % kChunk == 0 && kSplitLong % kChunk == 0 &&
                  kSplitLongAt % kSplitKeys == 0 && kSplitLongAt % kSplitLong == 0,
              "spans are whole chunks, cut at multiples of their length");

// The end of the span holding key position pos.
inline int64_t span_end(int64_t pos) {
  const int64_t step = pos < kSplitLongAt ? kSplitKeys : kSplitLong;
  return (pos / step + 1) * step;
}

// Keys [k0, k1) of a group of batch rows, position-major: at each key position the rows of all
// Hkv heads are adjacent in the cache (one contiguous Hkv * D run), so the pass reads its keys
// front to back (hardware prefetch and TLB friendly) and every head's queries use it: the
// group's n * Tq queries, query j = m * Tq + i being query i of batch row rows[m].
// The keys are `nparts` consecutive spans (span_end, the first holding k0), each into its own
// partial parts[j]: one pass, one setup and one prefetch stream for a thread's run of spans,
// with the same partials as one pass per span.
template <typename E>
void span(const Problem& p, const typename E::T* kc, const typename E::T* vc, Group grp,
          int64_t k0, int64_t k1, Partial* parts, int64_t nparts) {
  const int64_t b = grp.rows[0], Q = grp.n * p.Tq;
  const int64_t R = Q * p.G, D = p.D, H = p.Hkv, rows = H * R;
  for (int64_t j = 0; j < nparts; ++j) parts[j].reset(rows, D);
  // The group's queries, scaled, as qs[h * R + r] (r = j * G + g): query j of head h * G + g,
  // times scale; the scores s; a chunk converted to float32 (else read in place: kbuf, vbuf null).
  thread_local std::vector<float> qs_v, s_v, kbuf_v, vbuf_v;
  thread_local std::vector<int64_t> range_v;
  float* qs = scratch(qs_v, rows * D);
  float* s = scratch(s_v, rows * kChunk);
  int64_t* lo = scratch(range_v, 2 * Q + kChunk);
  int64_t *hi = lo + Q, *at = hi + Q;
  const float *kp[kChunk], *vp[kChunk];  // each position's H x D keys / values as float32
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t j = r / p.G, row = grp.rows[j / p.Tq], i = j % p.Tq;
      const float* src = p.q + ((row * p.Tq + i) * p.Hq + h * p.G + r % p.G) * D;
      for (int64_t d = 0; d < D; ++d) qs[(h * R + r) * D + d] = src[d] * p.scale;
    }
  for (int64_t j = 0; j < Q; ++j) key_range(p, grp.rows[j / p.Tq], j % p.Tq, lo[j], hi[j]);
  const int64_t tree_start = p.q_offset[b];
  const int32_t* tree = p.tree ? p.tree + b * p.Tq * p.Tq : nullptr;
  const int32_t* blocks = p.table + b * p.max_blocks;
  const float* kd = p.descale + b * H;
  const float* vd = p.descale + (p.B + b) * H;
  bool k_unscaled = true, v_unscaled = true;
  for (int64_t h = 0; h < H; ++h) k_unscaled = k_unscaled && kd[h] == 1.f;
  for (int64_t h = 0; h < H; ++h) v_unscaled = v_unscaled && vd[h] == 1.f;
  constexpr bool f32 = std::is_same_v<E, F32>;
  // Converted keys of kLanes positions and values of one head over a chunk: buffers that stay
  // in L1 (the whole chunk's keys and values, 96 KB at Hkv = 3, D = 64, went through L2 and
  // made a bfloat16 cache 1.8x slower to read than a float32 one at twice the bytes).
  float* kbuf = f32 && k_unscaled ? nullptr : scratch(kbuf_v, kLanes * H * D);
  float* vbuf = f32 && v_unscaled ? nullptr : scratch(vbuf_v, kChunk * D);
  // Cache offset of each position's row (pages clamped into the pool: masked keys read junk).
  const auto row_at = [&](int64_t pos) {
    int64_t page = blocks[pos / p.P];
    page = page < 0 ? 0 : page >= p.num_pages ? p.num_pages - 1 : page;
    return (page * p.P + pos % p.P) * H * D;
  };
  // Asks for the key and value rows of positions [c0, c1) ahead of their use. Left to demand
  // misses, a decode step's cache (evicted by the weights streamed since the last step) came in
  // at a third of the memory bandwidth: one row of Hkv x D at a time, with the products between.
  constexpr int64_t kLine = 64;
  const int64_t row_bytes = H * D * int64_t(sizeof(typename E::T));
  const auto prefetch = [&](int64_t c0, int64_t c1) {
    for (int64_t pos = c0; pos < c1; ++pos) {
      const char* kr = reinterpret_cast<const char*>(kc + row_at(pos));
      const char* vr = reinterpret_cast<const char*>(vc + row_at(pos));
      for (int64_t b = 0; b < row_bytes; b += kLine) {
        __builtin_prefetch(kr + b);
        __builtin_prefetch(vr + b);
      }
    }
  };
  prefetch(k0, k1 - k0 < kChunk ? k1 : k0 + kChunk);
  for (int64_t c0 = k0, n, j = 0, cut = span_end(k0); c0 < k1; c0 += n) {
    if (c0 >= cut) ++j, cut = span_end(c0);  // the next span (spans are whole chunks)
    n = k1 - c0 < kChunk ? k1 - c0 : kChunk;
    n = c0 + n > cut ? cut - c0 : n;
    Partial& part = parts[j];
    if (c0 + n < k1) prefetch(c0 + n, k1 - c0 - n < kChunk ? k1 : c0 + n + kChunk);
    for (int64_t c = 0; c < n; ++c) at[c] = row_at(c0 + c);
    for (int64_t cb = 0; cb < n; cb += kLanes) {  // scores, kLanes key positions at a time
      const int64_t ce = n - cb < kLanes ? n : cb + kLanes;
      for (int64_t c = cb; c < ce; ++c)
        kp[c] = as_float<E>(kc + at[c], kbuf ? kbuf + (c - cb) * H * D : nullptr, H, D, kd,
                            k_unscaled);
      if (kScores8 && D % 8 == 0) {  // AVX2: per query row, 8 keys at a time
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = cb; c < ce; c += 8)
            scores8(&qs[r * D], kp + c, (r / R) * D, ce - c < 8 ? ce - c : 8, D,
                    &s[r * kChunk + c]);
      } else if (D >= kLongRow) {  // position-major, each key row shared by 8 query rows at once
        for (int64_t c = cb; c < ce; ++c)
          for (int64_t h = 0; h < H; ++h)
            row_blocks(h * R, (h + 1) * R, [&](int64_t r0, auto RB) {
              score_rows<RB>(&qs[r0 * D], kp[c] + h * D, D, &s[r0 * kChunk + c]);
            });
      } else {  // per query row, the block's keys at once
        for (int64_t r = 0; r < rows; ++r)
          scores16(&qs[r * D], kp + cb, (r / R) * D, ce - cb, D, &s[r * kChunk + cb]);
      }
    }
    if (p.softcap > 0.f)
      for (int64_t hr = 0; hr < rows; ++hr)
        for (int64_t c = 0; c < n; ++c) {
          float& x = s[hr * kChunk + c];
          x = p.softcap * std::tanh(x / p.softcap);
        }
    const bool tree_here = tree && c0 < tree_start + p.Tq && c0 + n > tree_start;
    for (int64_t hr = 0; hr < rows; ++hr) {  // masks, then the online softmax
      float* sr = &s[hr * kChunk];
      const int64_t i = (hr % R) / p.G;  // the group's query (one row's own where there is a tree)
      float cm = kNegInf;
      if (!tree_here) {  // the visible keys are one run [a, e) of the chunk: mask its ends
        const int64_t a = lo[i] - c0 < 0 ? 0 : lo[i] - c0 > n ? n : lo[i] - c0;
        int64_t e = hi[i] - c0 > n ? n : hi[i] - c0;
        e = e < a ? a : e;
        for (int64_t c = 0; c < a; ++c) sr[c] = kNegInf;
        for (int64_t c = e; c < kChunk; ++c) sr[c] = kNegInf;
        vn mv = splatn(kNegInf);
        for (int64_t c = 0; c < kChunk; c += kNative) mv = pallas_attn::vmath::vmax(loadn(sr + c), mv);
        for (int j = 0; j < kNative; ++j) cm = mv[j] > cm ? mv[j] : cm;
      } else {
        for (int64_t c = 0; c < kChunk; ++c) {
          const int64_t pos = c0 + c;
          bool ok = c < n && pos >= lo[i] && pos < hi[i];
          if (ok && tree_here && pos >= tree_start && pos < tree_start + p.Tq)
            ok = tree[i * p.Tq + (pos - tree_start)] != 0;
          sr[c] = ok ? sr[c] : kNegInf;
          cm = sr[c] > cm ? sr[c] : cm;
        }
      }
      if (cm == kNegInf) {
        for (int64_t c = 0; c < kChunk; ++c) sr[c] = 0.f;
        continue;
      }
      float& m = part.m[hr];
      const float mn = m > cm ? m : cm;
      const float corr = m == kNegInf ? 0.f : std::exp(m - mn);
      m = mn;
      vn sum[kLanes / kNative] = {};  // lane j sums the keys c = j mod kLanes
      for (int64_t c = 0; c < kChunk; c += kLanes)
        for (int h = 0; h < kLanes / kNative; ++h) {
          const vn e = vexp(loadn(sr + c + h * kNative) - splatn(mn));
          storen(sr + c + h * kNative, e);
          sum[h] += e;
        }
      part.l[hr] = part.l[hr] * corr + pallas_attn::vmath::hsum_parts(sum);
      if (corr != 1.f)
        for (int64_t d = 0; d < D; ++d) part.acc[hr * D + d] *= corr;
    }
    for (int64_t h = 0; h < H; ++h) {  // values: blocks of 8 query rows accumulate in registers
      int64_t off = h * D;  // head h of each position's row (in place), or of the converted one
      for (int64_t c = 0; c < n; ++c) {
        if (vbuf)
          vp[c] = as_float<E>(vc + at[c] + off, vbuf + c * D, 1, D, vd + h, v_unscaled);
        else
          vp[c] = reinterpret_cast<const float*>(vc + at[c]);
      }
      if (vbuf) off = 0;
      row_blocks(h * R, (h + 1) * R, [&](int64_t r0, auto RB) {
        weigh_values<RB>(vp, n, off, &s[r0 * kChunk], &part.acc[r0 * D], D);
      });
    }
  }
}

// out and lse of the group's rows from the partials of its spans (natural-log lse merge), each
// query over the spans in order; a span where it saw no key (l = 0) adds nothing.
void combine(const Problem& p, Group grp, const Partial* parts, int64_t spans) {
  const int64_t Rm = p.Tq * p.G, R = grp.n * Rm, D = p.D;
  for (int64_t m = 0; m < grp.n; ++m) {
    const int64_t b = grp.rows[m];
    for (int64_t h = 0; h < p.Hkv; ++h) {
      for (int64_t r = 0; r < Rm; ++r) {
        const int64_t hr = h * R + m * Rm + r, i = r / p.G, hq = h * p.G + r % p.G;
        float M = kNegInf;
        for (int64_t t = 0; t < spans; ++t)
          if (parts[t].l[hr] > 0.f && parts[t].m[hr] > M) M = parts[t].m[hr];
        float* o = p.out + ((b * p.Tq + i) * p.Hq + hq) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        float L = 0.f;
        for (int64_t t = 0; t < spans; ++t) {
          if (parts[t].l[hr] <= 0.f) continue;
          const float w = std::exp(parts[t].m[hr] - M);
          L += parts[t].l[hr] * w;
          axpy(w, &parts[t].acc[hr * D], o, D);
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        p.lse[(b * p.Hq + hq) * p.Tq + i] = L > 0.f ? M + std::log(L) : kNegInf;
      }
    }
  }
}

constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all
// Partials of one wave of groups at most (bytes): a long context at a large batch would
// otherwise hold a partial per span of every row at once.
constexpr int64_t kWaveBytes = int64_t(64) << 20;

// Whether batch rows a and b read the same keys (Group): the same pages for every block either
// reads ([0, last) covers both), the same descale, no tree mask.
bool same_keys(const Problem& p, int64_t a, int64_t b, int64_t last) {
  if (p.tree) return false;
  const int32_t *ta = p.table + a * p.max_blocks, *tb = p.table + b * p.max_blocks;
  int64_t blocks = (last + p.P - 1) / p.P;
  blocks = blocks > p.max_blocks ? p.max_blocks : blocks;
  for (int64_t j = 0; j < blocks; ++j)
    if (ta[j] != tb[j]) return false;
  for (int64_t s = 0; s < 2; ++s)
    for (int64_t h = 0; h < p.Hkv; ++h)
      if (p.descale[(s * p.B + a) * p.Hkv + h] != p.descale[(s * p.B + b) * p.Hkv + h])
        return false;
  return true;
}

// Tasks: (group, span of its keys); each fills its own Partial, and a group's partials are
// merged once all are done.
template <typename E>
void run(ffi::ThreadPool& pool, const Problem& p, const void* kc, const void* vc) {
  std::vector<int64_t> first(p.B), last(p.B);
  int64_t keys = 0;
  for (int64_t b = 0; b < p.B; ++b) {  // the union of the rows' key ranges
    int64_t unused;  // the first query sees the lowest keys, the last query the highest
    key_range(p, b, 0, first[b], unused);
    key_range(p, b, p.Tq - 1, unused, last[b]);
    if (last[b] < first[b]) last[b] = first[b];
    keys += last[b] - first[b];
  }
  // Groups, in order of their first rows: members[gbeg[g], gbeg[g + 1]).
  std::vector<int64_t> members, gbeg{0}, gfirst, glast;
  std::vector<char> taken(p.B, 0);
  for (int64_t a = 0; a < p.B; ++a) {
    if (taken[a]) continue;
    int64_t lo = first[a], hi = last[a];
    members.push_back(a);
    for (int64_t b = a + 1; b < p.B; ++b) {
      if (taken[b] || p.table[a * p.max_blocks] != p.table[b * p.max_blocks]) continue;
      if (!same_keys(p, a, b, hi > last[b] ? hi : last[b])) continue;
      taken[b] = 1;
      members.push_back(b);
      lo = first[b] < lo ? first[b] : lo;
      hi = last[b] > hi ? last[b] : hi;
    }
    gbeg.push_back(int64_t(members.size()));
    gfirst.push_back(lo);
    glast.push_back(hi);
  }
  const int64_t groups = int64_t(gfirst.size());
  const bool parallel = 2 * keys * p.Hq * p.Tq * p.D >= kParallelWork;
  const auto* k = static_cast<const typename E::T*>(kc);
  const auto* v = static_cast<const typename E::T*>(vc);
  std::vector<int64_t> task0, tgroup, tspan;  // per wave: task -> (group, its first key)
  std::vector<Partial> parts;
  std::unique_ptr<float[]> states;
  for (int64_t g0 = 0; g0 < groups;) {  // waves of groups
    task0.assign(1, 0), tgroup.clear(), tspan.clear();
    int64_t bytes = 0, g1 = g0, floats = 0;
    for (; g1 < groups; ++g1) {
      int64_t spans = 1;  // [gfirst, glast) in spans (one, empty, where it is empty)
      for (int64_t pos = span_end(gfirst[g1]); pos < glast[g1]; pos = span_end(pos)) ++spans;
      const int64_t per = (gbeg[g1 + 1] - gbeg[g1]) * p.Hkv * p.Tq * p.G * (p.D + 2);
      if (g1 > g0 && bytes + spans * per * 4 > kWaveBytes) break;
      bytes += spans * per * 4;
      for (int64_t j = 0, pos = gfirst[g1]; j < spans; ++j, pos = span_end(pos))
        tgroup.push_back(g1), tspan.push_back(pos);
      task0.push_back(int64_t(tgroup.size()));
      floats += spans * per;
    }
    parts.resize(tgroup.size());
    states.reset(new float[floats]);  // each task resets its own, in parallel
    for (int64_t t = 0, at = 0; t < int64_t(tgroup.size()); ++t) {
      const int64_t g = tgroup[t], n = gbeg[g + 1] - gbeg[g], rows = n * p.Hkv * p.Tq * p.G;
      parts[t].bind(&states[at], rows);
      at += rows * (p.D + 2);
    }
    const auto task_keys = [&](int64_t t, int64_t& a, int64_t& e) {  // task t's keys [a, e)
      const int64_t g = tgroup[t];
      a = tspan[t];
      e = span_end(a) < glast[g] ? span_end(a) : glast[g];
      e = e < a ? a : e;
    };
    pallas_attn::parallel_for(pool, int64_t(tgroup.size()), parallel, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0, t2; t < t1; t = t2) {  // a group's consecutive spans in one pass
        const int64_t g = tgroup[t];
        for (t2 = t + 1; t2 < t1 && tgroup[t2] == g;) ++t2;
        const Group grp{&members[gbeg[g]], gbeg[g + 1] - gbeg[g]};
        int64_t a, e, unused;
        task_keys(t, a, unused);
        task_keys(t2 - 1, unused, e);
        span<E>(p, k, v, grp, a, e > a ? e : a, &parts[t], t2 - t);
      }
    });
    for (int64_t g = g0; g < g1; ++g)
      combine(p, Group{&members[gbeg[g]], gbeg[g + 1] - gbeg[g]}, &parts[task0[g - g0]],
              task0[g - g0 + 1] - task0[g - g0]);
    g0 = g1;
  }
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

// ---- Entry point for other kernels (kv_attention.h; decode_layer.cc owns this block) ----------

#include "kv_attention.h"

namespace pallas_attn {

bool kv_attention(xla::ffi::ThreadPool& pool, xla::ffi::DataType cache_type, int64_t B, int64_t Tq,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t num_pages, int64_t P,
                  int64_t max_blocks, float scale, float softcap, int64_t left, int64_t right,
                  const float* q, const void* k_cache, const void* v_cache, const int32_t* table,
                  const int32_t* q_offset, const int32_t* kv_start, const int32_t* kv_len,
                  const float* descale, const int32_t* tree, float* out, float* lse) {
  Problem p;
  p.B = B, p.Tq = Tq, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.G = Hq / Hkv;
  p.num_pages = num_pages, p.P = P, p.max_blocks = max_blocks;
  p.scale = scale, p.softcap = softcap, p.left = left, p.right = right;
  p.q = q, p.table = table, p.q_offset = q_offset, p.kv_start = kv_start, p.kv_len = kv_len;
  p.descale = descale, p.tree = tree, p.out = out, p.lse = lse;
  switch (cache_type) {
    case ffi::DataType::F32: run<F32>(pool, p, k_cache, v_cache); return true;
    case ffi::DataType::BF16: run<BF16>(pool, p, k_cache, v_cache); return true;
    case ffi::DataType::F16: run<F16>(pool, p, k_cache, v_cache); return true;
    case ffi::DataType::F8E4M3FN: run<F8>(pool, p, k_cache, v_cache); return true;
    default: return false;
  }
}

}  // namespace pallas_attn
