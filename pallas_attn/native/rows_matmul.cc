// y[M, N] = x[M, K] @ W[K, N] for few rows M (decode steps, speculative verification) on CPU.
//
// W is packed once as panels wp[P, K, 32] (P = ceil(N / 32); panel p holds columns 32p .. 32p + 31,
// zero-padded), so each panel is one contiguous stream, read once per block of up to 8 rows while
// 2 x 8 vector accumulators stay in registers. XLA:CPU's own product streams [K, N] weights at
// about half this rate for 2 <= M <= 16 (measurements in models/rows_matmul.py). float32 x and y,
// float32 or bfloat16 weights, float32 accumulation. Panels are shared out between the calling
// thread and XLA's intra-op thread pool. An XLA FFI handler: pallas_attn/native.py builds it,
// models/rows_matmul.py is the Python side.
//
// bfloat16 panels hold their rows in pairs, [P, K2 / 2, 32 columns, 2] (K2 = K rounded up to
// even, the pad row zero): one 32-bit lane per column holds weights k = 2j and 2j + 1, the
// operand of AVX-512 BF16's vdpbf16ps (two bfloat16 products summed into a float32 lane). Two
// ways (the kind attribute, rows_matmul.h):
// * kWeightBF16Exact (panel_bf16_exact): each weight widened to float32 and multiplied by the
//   float32 activation, in the order k = 0, 1, ...: the float kernel's sums bit for bit;
// * kWeightBF16 (bf16_dot_panel, where the CPU has avx512_bf16; else the exact way): the
//   activations split once per call as x = hi + lo, both bfloat16 (hi = x rounded, lo = x - hi
//   rounded), and one vdpbf16ps per pair and part. Where every lo is zero (activations already
//   bfloat16, as every bfloat16 model's are) the lo pass is skipped and the products are exact;
//   otherwise x is represented to 2^-16 of itself (|x - hi - lo| <= 2^-18 |x| roughly).
//
// PallasAttnRowsMatmulQ is the same product over GGUF-style block-quantized weights (Q8_0, Q4_0,
// Q4_1: blocks of 32 weights along K with a float16 scale, and a float16 minimum for Q4_1; see
// models/quant.py), panels wq[P, K / 32, bytes per block] in uint8 (layout at block_bytes), at
// 8.5 (Q8_0), 4.5 (Q4_0) or 5 (Q4_1) bits per weight read. Two ways (the fmt attribute):
// * float32 activations (run_q): each weight is dequantized in registers to exactly the float32
//   value gguf.quants gives it and accumulated in the same order as the float kernel, so the
//   result equals rows_matmul on the dequantized float32 weights bit for bit;
// * 8-bit activations (run_q8, fmt + kQ8Activations): the activations are quantized per block
//   of 32 once per call and each block's dot product is an int32 sum (VNNI where the build has
//   it), scaled and accumulated in float32.
//
// NOTE for the entry-point block at the end of this file: the quant bytes of a block are in
// groups of 4 k per column ([g][32 columns][4], Q8_0 offset by 128), not [k][32 columns];
// models/rows_matmul.pack_quantized writes it, run_q / run_q8 / run_quantized read it, with
// unchanged signatures (run_q stays the bit-exact float-activation product).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "parallel.h"
#include "rows.h"
#include "rows_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;       // floats per vector: one AVX-512 register, two AVX2 ones
constexpr int kNB = 2 * kLanes;  // panel width (columns)
constexpr int kMB = 8;           // rows per block
static_assert(kMB == pallas_attn::kMaxRows, "rows per block: what with_rows dispatches");
typedef float vf __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int8_t vb __attribute__((vector_size(kLanes), aligned(1)));
typedef uint8_t vub __attribute__((vector_size(kLanes), aligned(1)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf as_float(vu u) {
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline vu load_pairs(const uint16_t* p) {  // kLanes 32-bit lanes of bfloat16 pairs
  vu u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}

// Keeps the panel row in registers: left alone, GCC folds its load into every row's FMA as a
// memory operand (panel<4>: 8 loads per k instead of 2, and M = 4 ran slower than M = 5).
inline void in_registers(vf& a, vf& b) {
#if defined(__AVX512F__)  // a 64-byte vector is one register only with AVX-512
  asm("" : "+v"(a), "+v"(b));
#endif
}

template <int MB>
inline void store_rows(vf (&acc)[MB][2], float* y, int64_t ldy, int64_t cols) {
  for (int m = 0; m < MB; ++m) {
    float out[kNB];
    std::memcpy(out, &acc[m][0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[m][1], sizeof(vf));
    std::memcpy(y + m * ldy, out, cols * sizeof(float));
  }
}

// Rows [0, MB) of x (row stride K) times one panel w [K, kNB] -> y[:, 0:cols] (row stride ldy).
template <int MB, typename W>
void panel(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t cols) {
  vf acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf w0 = load(w + k * kNB), w1 = load(w + k * kNB + kLanes);
    in_registers(w0, w1);
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * K + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
    }
  }
  store_rows<MB>(acc, y, ldy, cols);
}

// The same over one bfloat16 pair panel w [K2 / 2, kNB, 2]: weights widened to float32 (a pair
// lane's low half is k = 2j, its high half 2j + 1), multiplied in panel()'s order.
template <int MB>
void panel_bf16_exact(const float* x, int64_t K, const uint16_t* w, float* y, int64_t ldy,
                      int64_t cols) {
  vf acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vf{};
  for (int64_t j = 0; 2 * j < K; ++j) {
    const vu u0 = load_pairs(w + j * 2 * kNB), u1 = load_pairs(w + j * 2 * kNB + 2 * kLanes);
    vf e0 = as_float(u0 << 16), e1 = as_float(u1 << 16);
    vf o0 = as_float(u0 & 0xffff0000u), o1 = as_float(u1 & 0xffff0000u);
    in_registers(e0, e1);
    in_registers(o0, o1);
    const bool odd = 2 * j + 1 < K;
    for (int m = 0; m < MB; ++m) {
      const float xe = x[m * K + 2 * j];
      acc[m][0] += xe * e0;
      acc[m][1] += xe * e1;
      if (odd) {
        const float xo = x[m * K + 2 * j + 1];
        acc[m][0] += xo * o0;
        acc[m][1] += xo * o1;
      }
    }
  }
  store_rows<MB>(acc, y, ldy, cols);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// panel() and panel_bf16_exact() for AVX2 builds, in 256-bit registers: GCC compiles the 16-lane
// form through memory there (MB x 2 accumulators of two registers each, and the weights, do not
// fit AVX2's 16), which made it compute-bound even at one row. Here a pass takes CV vectors of 8
// columns for R rows (R x CV accumulators, at most 12) and reads each weight vector once for all
// R rows; a block of rows takes 1 or 2 passes per chunk of the panel's rows (panel_rows_avx2:
// the later passes and blocks read it from L1). Each accumulator lane is still one column of one
// row, summed k = 0, 1, .. by one FMA each from +0 (what GCC contracts `acc += x * w` to), the
// partial sums stored and reloaded exactly between chunks: the generic kernels' results bit for
// bit.
inline __m256 widen_even(__m256i u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
inline __m256 widen_odd(__m256i u) {
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// Rows [0, R) of x times column vectors [v0, v0 + CV) of weight rows [k0, k1) of one panel
// (float32 [K, kNB], or bfloat16 pairs [K2 / 2, kNB, 2]; k0 even), added to the float32 sums
// t[R, kNB] (stored and reloaded exactly).
template <int R, int CV, typename W>
void panel_pass(const float* x, int64_t K, const W* w, int64_t k0, int64_t k1, float* t, int v0,
                int64_t ahead = 0, int64_t limit = 0) {
  __m256 acc[R][CV];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < CV; ++c) acc[m][c] = _mm256_loadu_ps(t + m * kNB + 8 * (v0 + c));
  // The weight rows `ahead` on (below `limit`), this pass's columns of them, towards L1: one
  // row of kNB weights per k (float32) or per pair of k (bfloat16) is 128 bytes.
  const auto prefetch = [&](int64_t row) {
    const char* p = reinterpret_cast<const char*>(w) + row * 128 + 32 * v0;
    _mm_prefetch(p, _MM_HINT_T0);
    if (CV == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
  };
  if constexpr (sizeof(W) == 4) {
    const int64_t kp = ahead > 0 ? std::min(k1, limit - ahead) : k0;  // [k0, kp) prefetch
    for (int64_t k = k0; k < k1; ++k) {
      if (k < kp) prefetch(k + ahead);
      __m256 wv[CV];
      for (int c = 0; c < CV; ++c) wv[c] = _mm256_loadu_ps(w + k * kNB + 8 * (v0 + c));
      for (int m = 0; m < R; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
        for (int c = 0; c < CV; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
      }
    }
  } else {
    const int64_t J = k1 / 2;  // full pairs; an odd K's last weight row comes after
    const auto pairs = [&](int64_t j, int c) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 2 * kNB + 16 * (v0 + c)));
    };
    const int64_t jp = ahead > 0 ? std::min(J, (limit - ahead) / 2) : 0;  // [k0 / 2, jp) prefetch
    for (int64_t j = k0 / 2; j < J; ++j) {
      if (j < jp) prefetch(j + ahead / 2);
      __m256 e[CV], o[CV];
      for (int c = 0; c < CV; ++c) {
        const __m256i u = pairs(j, c);
        e[c] = widen_even(u);
        o[c] = widen_odd(u);
      }
      for (int m = 0; m < R; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * K + 2 * j);
        const __m256 xo = _mm256_broadcast_ss(x + m * K + 2 * j + 1);
        for (int c = 0; c < CV; ++c) {
          acc[m][c] = _mm256_fmadd_ps(xe, e[c], acc[m][c]);
          acc[m][c] = _mm256_fmadd_ps(xo, o[c], acc[m][c]);
        }
      }
    }
    if (k1 & 1)
      for (int c = 0; c < CV; ++c) {
        const __m256 e = widen_even(pairs(J, c));
        for (int m = 0; m < R; ++m)
          acc[m][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + 2 * J), e, acc[m][c]);
      }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(t + m * kNB + 8 * (v0 + c), acc[m][c]);
}

// The most rows of a 12-accumulator pass (2 column vectors), and so of the row blocks
// panel_rows_avx2 cuts M into: 6 rows read 2 weight vectors and 6 broadcasts per 12 FMAs,
// where an 8-row pass (8 accumulators, one FMA per load) leaves the FMA units idle (SmolLM2's
// float32 decode steps took 0.73-0.85x the time at 8, 16 and 32 rows on Zen 3).
constexpr int kRowsAvx2 = 6;

// Bytes of a panel's rows (32 float32 rows, 64 bfloat16 ones) that every row block of
// panel_rows_avx2 takes before the next: with the partial sums of 32 rows (4 KB), their 32
// activations each (4 KB) and the next chunk on its way, the working set stays well inside L1;
// 8 and 16 KB ran the same or slower (Zen 3, 32 KB L1).
constexpr int64_t kChunkAvx2 = 4096;

// Rows whose partial sums wait in one panel_rows_avx2 buffer (8 KB of them; models.rows_matmul
// calls with at most MAX_ROWS = 64).
constexpr int64_t kGroupRowsAvx2 = 64;

// All M rows times one panel -> y[:, 0:cols] (row stride ldy), chunk by chunk (kChunkAvx2):
// every block of at most kRowsAvx2 rows takes its passes over a chunk (1 or 2 rows: all 32
// columns in one pass; 3 - kRowsAvx2 rows: 16 columns at a time) before the next chunk, so the
// blocks after the first read it from L1, and the second block fetches the next chunk towards
// L1 as it goes (the next panel's first one where `next` says that panel follows in memory).
// Blocks over the whole panel one after another read it from L2 after the first and from memory
// in the first, at that block's pace: on SmolLM2's products, weights streamed from memory on
// 2 Zen 3 threads, chunks took 8 rows 1.15-1.4x, 16 rows 1.25x, 32 and 64 rows 1.1x faster.
// Each lane's sums are the same FMAs in the same order as before: the same results bit for bit.
template <typename W>
void panel_rows_avx2(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy,
                     int64_t cols, bool next) {
  constexpr int64_t KB = (kChunkAvx2 / (kNB * sizeof(W))) & ~int64_t(1);  // even: whole pairs
  const int64_t K2 = sizeof(W) == 2 ? K + (K & 1) : K, limit = next ? 2 * K2 : K2;
  alignas(32) float t[kGroupRowsAvx2][kNB];
  for (int64_t b0 = 0; b0 < M; b0 += kGroupRowsAvx2) {
    const int64_t rows = std::min(kGroupRowsAvx2, M - b0);
    std::memset(t, 0, rows * sizeof(t[0]));
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = K - k0 < KB ? K : k0 + KB;
      for (int64_t m0 = 0; m0 < rows;) {
        const int64_t mb = rows - m0 > kRowsAvx2 ? kRowsAvx2 : rows - m0;
        const int64_t ahead = m0 == kRowsAvx2 ? KB : 0;  // the second block
        pallas_attn::with_rows(mb, [&](auto MB) {
          constexpr int CV = MB <= 2 ? 4 : 2;  // mb <= kRowsAvx2: at most 12 accumulators
          for (int v0 = 0; v0 < kNB / 8 && 8 * v0 < cols; v0 += CV)
            panel_pass<MB, CV>(x + (b0 + m0) * K, K, w, k0, k1, &t[m0][0], v0, ahead, limit);
        });
        m0 += mb;
      }
    }
    for (int64_t m = 0; m < rows; ++m) std::memcpy(y + (b0 + m) * ldy, t[m], cols * sizeof(float));
  }
}
#define PALLAS_ATTN_PANEL_AVX2 1
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(PALLAS_ATTN_PANEL_AVX2)
// Float32 panels two at a time (AVX-512 builds; AVX2's passes above already keep 4 - 12 chains).
// R <= 3 rows times two panels w, v in 256-bit vectors: 8 R accumulator chains and two streams in
// flight, where panel<MB> keeps 2 MB and one. Few rows are bound by how fast the panels stream in:
// on the AMX development VM (2 threads, huge pages) one row read 37 GB/s this way against 25-31
// one panel at a time in 512-bit vectors (the streaming probe: 31), and 2 - 8 rows of a
// [576, 1536] product 22-26 GB/s against 11-16 as panel<MB>; up to 64 rows it stayed 2 - 3x
// faster (compute-bound past ~16 rows: 512-bit blocks of 8 rows still lost to it).
#define PALLAS_ATTN_PANEL_PAIRS 1

// Row k of the float32 pair w, v (kNB floats each, two cache lines) towards L1.
inline void prefetch_pair_row(const float* w, const float* v, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(w + k * kNB), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w + k * kNB + 16), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(v + k * kNB), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(v + k * kNB + 16), _MM_HINT_T0);
}

// Weight rows [k0, k1) of the pair w, v for R rows of x (row stride K), added to the partial
// sums t[R][2 kNB] (one FMA per k per lane, in k order; stored and reloaded exactly). With
// `ahead` > 0 each k also prefetches the pair's rows k + ahead (the next chunk) where they are
// below K: a group after the chunk's first reads the pair from L1, so without it the memory
// stream stops until the next chunk's first group misses again.
template <int R>
void pair_pass(const float* x, int64_t K, const float* w, const float* v, int64_t k0, int64_t k1,
               float* t, int64_t ahead) {
  __m256 acc[R][8];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 8; ++c) acc[m][c] = _mm256_loadu_ps(t + m * 2 * kNB + 8 * c);
  const int64_t kp = ahead > 0 ? std::min(k1, K - ahead) : k0;  // [k0, kp) prefetch
  for (int64_t k = k0; k < k1; ++k) {
    if (k < kp) prefetch_pair_row(w, v, k + ahead);
    __m256 xv[R];
    for (int m = 0; m < R; ++m) xv[m] = _mm256_broadcast_ss(x + m * K + k);
    for (int c = 0; c < 8; ++c) {
      const __m256 wv = _mm256_loadu_ps(c < 4 ? w + k * kNB + 8 * c : v + k * kNB + 8 * (c - 4));
      for (int m = 0; m < R; ++m) acc[m][c] = _mm256_fmadd_ps(xv[m], wv, acc[m][c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(t + m * 2 * kNB + 8 * c, acc[m][c]);
}

// The same for 4 <= R <= 6 rows in 512-bit vectors (4 R accumulators): past 3 rows the pair is
// read from L1 and the FMAs bound the pass, and half as many of them win (M = 8 of a [576, 1536]
// product 177 -> 156 us, 16 rows 234 -> 195, 32 rows 355 -> 267, against 256-bit groups of 3).
template <int R>
void pair_pass512(const float* x, int64_t K, const float* w, const float* v, int64_t k0,
                  int64_t k1, float* t, int64_t ahead) {
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_loadu_ps(t + m * 2 * kNB + 16 * c);
  const int64_t kp = ahead > 0 ? std::min(k1, K - ahead) : k0;
  for (int64_t k = k0; k < k1; ++k) {
    if (k < kp) prefetch_pair_row(w, v, k + ahead);
    for (int c = 0; c < 4; ++c) {
      const __m512 wv = _mm512_loadu_ps(c < 2 ? w + k * kNB + 16 * c : v + k * kNB + 16 * (c - 2));
      for (int m = 0; m < R; ++m)
        acc[m][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[m][c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(t + m * 2 * kNB + 16 * c, acc[m][c]);
}

// Rows per pass over the m rows left: up to 3 in one 256-bit pass, 4 - 6 in one 512-bit pass,
// more 6 at a time with 7 = 4 + 3, 8 = 4 + 4, 9 = 5 + 4 (16 = 6 + 6 + 4).
inline int pair_rows(int64_t m) {
  if (m < 4) return int(m);
  return m >= 10 || m == 6 ? 6 : m == 7 || m == 8 ? 4 : m == 9 ? 5 : int(m);
}

constexpr int64_t kPairRows = 64;  // rows whose partial sums wait in one pair_panels buffer

// All M rows times a pair of panels -> y[:, 0:cols_w] and y[:, kNB:kNB + cols_v] (row stride
// ldy), for the float32 and bfloat16 pair products: the rows go in groups (pair_rows) over
// `chunk` of the pair's K rows (8 KB) at a time, so every group after the first reads them from
// L1 (one group takes the whole pair in one pass); pass(r, first row, k0, k1, t) adds rows
// [k0, k1) of r rows to their partial sums t, which wait here between chunks (stored and
// reloaded exactly: each column's sums are panel<MB>'s bit for bit).
template <typename Pass>
void pair_groups(int64_t M, int64_t K, int64_t chunk, float* y, int64_t ldy, int64_t cols_w,
                 int64_t cols_v, Pass pass) {
  float t[kPairRows][2 * kNB];
  for (int64_t b0 = 0; b0 < M; b0 += kPairRows) {
    const int64_t rows = std::min(kPairRows, M - b0);
    const int64_t KB = pair_rows(rows) == rows ? K : chunk;  // one group: one pass
    std::memset(t, 0, rows * sizeof(t[0]));
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t k1 = std::min(K, k0 + KB);
      for (int64_t m0 = 0; m0 < rows;) {
        const int r = pair_rows(rows - m0);
        // Groups after the first fetch the next chunk while they compute from L1.
        pass(r, b0 + m0, k0, k1, t[m0], m0 > 0 ? KB : 0);
        m0 += r;
      }
    }
    for (int64_t m = 0; m < rows; ++m) {
      std::memcpy(y + (b0 + m) * ldy, t[m], cols_w * sizeof(float));
      std::memcpy(y + (b0 + m) * ldy + kNB, t[m] + kNB, cols_v * sizeof(float));
    }
  }
}

// The float32 pair product: pair_pass / pair_pass512 per group, over 8 KB of the pair at a time.
void pair_panels(const float* x, int64_t M, int64_t K, const float* w, const float* v, float* y,
                 int64_t ldy, int64_t cols_w, int64_t cols_v) {
  constexpr int64_t chunk = 8192 / (2 * kNB * sizeof(float));
  pair_groups(M, K, chunk, y, ldy, cols_w, cols_v,
              [&](int r, int64_t m, int64_t k0, int64_t k1, float* t, int64_t ahead) {
                const float* xm = x + m * K;
                if (r == 1) pair_pass<1>(xm, K, w, v, k0, k1, t, ahead);
                if (r == 2) pair_pass<2>(xm, K, w, v, k0, k1, t, ahead);
                if (r == 3) pair_pass<3>(xm, K, w, v, k0, k1, t, ahead);
                if (r == 4) pair_pass512<4>(xm, K, w, v, k0, k1, t, ahead);
                if (r == 5) pair_pass512<5>(xm, K, w, v, k0, k1, t, ahead);
                if (r == 6) pair_pass512<6>(xm, K, w, v, k0, k1, t, ahead);
              });
}
#endif

// Panels [p0, p1) for all M rows.
template <typename W>
void panels(const float* x, int64_t M, int64_t K, const W* wp, float* y, int64_t N, int64_t p0,
            int64_t p1) {
  const int64_t K2 = sizeof(W) == 2 ? K + (K & 1) : K;  // bfloat16 rows come in pairs
#if defined(PALLAS_ATTN_PANEL_PAIRS)
  if constexpr (sizeof(W) == 4)
    for (; p0 + 1 < p1; p0 += 2) {
      const int64_t n0 = p0 * kNB, cols = N - n0 - kNB < kNB ? N - n0 - kNB : kNB;
      const float* w = wp + p0 * K * kNB;
      pair_panels(x, M, K, w, w + K * kNB, y + n0, N, kNB, cols);
    }
#endif
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
    const W* w = wp + p * K2 * kNB;
#if defined(PALLAS_ATTN_PANEL_AVX2)
    panel_rows_avx2(x, M, K, w, y + n0, N, cols, p + 1 < p1);
#else
    for (int64_t m0 = 0; m0 < M; m0 += kMB) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N + n0;
      pallas_attn::with_rows(M - m0 < kMB ? M - m0 : kMB, [&](auto MB) {
        if constexpr (sizeof(W) == 2)
          panel_bf16_exact<MB>(xm, K, w, ym, N, cols);
        else
          panel<MB>(xm, K, w, ym, N, cols);
      });
    }
#endif
  }
}

// One thread below these weight bytes: waking another costs more than it saves (a product of a
// cache-resident 64 KB matrix is a few microseconds). A single row is no exception: inside a
// decode step (code-target, M = 1) matrices of 256 KB - 1 MB on one thread made the whole forward
// 1.5x slower (0.61 vs 0.41 ms) than sharing them, although alone, back to back, they ran at the
// same speed either way.
constexpr int64_t kParallelBytes = 1 << 18;

// Whether a product over `bytes` of weights for M rows is worth sharing: its work grows with M
// (8 rows of the 187 KB Q4_0 output projection of a 135M model took 45 us on one thread).
inline bool worth_sharing(int64_t bytes, int64_t M) { return bytes * M >= kParallelBytes; }

// parallel_for over panels [0, P) cut in whole pairs, for the pair products: a range ending
// mid-pair leaves its odd panel to the one-panel kernels, which read it at about half the rate
// (a [1536, 576] product, cut in ranges of 3 panels, ran a third of them that way: 8 rows took
// 191 us against 139 in pairs; its 192-column neighbours ran every panel alone).
template <typename F>
void parallel_pairs(ffi::ThreadPool& pool, int64_t P, bool share, const F& fn) {
  pallas_attn::parallel_for(pool, (P + 1) / 2, share, [&](int64_t q0, int64_t q1) {
    fn(2 * q0, std::min(P, 2 * q1));
  });
}

template <typename W>
void run(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const W* wp, int64_t P,
         float* y, int64_t N) {
  const int64_t bytes = P * K * kNB * int64_t(sizeof(W));
#if defined(PALLAS_ATTN_PANEL_PAIRS)
  if constexpr (sizeof(W) == 4) {
    parallel_pairs(pool, P, worth_sharing(bytes, M), [&](int64_t p0, int64_t p1) {
      panels(x, M, K, wp, y, N, p0, p1);
    });
    return;
  }
#endif
  pallas_attn::parallel_for(pool, P, worth_sharing(bytes, M), [&](int64_t p0, int64_t p1) {
    panels(x, M, K, wp, y, N, p0, p1);
  });
}

// ---- bfloat16 dot products (vdpbf16ps) ---------------------------------------------------------

inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The activations of one call as bfloat16 pairs: hi [M, K2 / 2] and lo [M, K2 / 2] 32-bit lanes
// (low half k = 2j, high half 2j + 1; the pad k = K is zero; rows past M up to a multiple of 16
// zero, for the tiles); exact when every lo is zero.
struct BF16Acts {
  std::vector<uint32_t> hi, lo;
  bool exact = true;
};

// float_to_bf16 on the bits, without branches, so that split_activations' loop vectorizes (as
// a scalar loop it took a tenth of a batched bfloat16 decode step on the tile unit).
inline uint16_t bf16_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

void split_activations(const float* x, int64_t M, int64_t K, BF16Acts& a) {
  const int64_t J = (K + 1) / 2, padded = (M + 15) / 16 * 16;  // tile_panels reads 16 rows
  a.hi.resize(padded * J);
  a.lo.resize(padded * J);
  std::fill(a.hi.begin() + M * J, a.hi.end(), 0u);
  std::fill(a.lo.begin() + M * J, a.lo.end(), 0u);
  thread_local std::vector<uint16_t> h, l;  // one row, k in order (pair j = halves 2j, 2j + 1)
  h.assign(2 * J, 0);
  l.assign(2 * J, 0);
  uint32_t any_lo = 0;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t k = 0; k < K; ++k) {
      uint32_t u;
      std::memcpy(&u, xm + k, 4);
      const uint16_t hb = bf16_bits(u);
      const uint32_t hu = uint32_t(hb) << 16;
      float hf;
      std::memcpy(&hf, &hu, 4);
      const float d = xm[k] - hf;
      uint32_t du;
      std::memcpy(&du, &d, 4);
      const uint16_t lb = bf16_bits(du);
      h[k] = hb;
      l[k] = lb;
      any_lo |= lb & 0x7fffu;  // +-0 adds nothing
    }
    std::memcpy(a.hi.data() + m * J, h.data(), 4 * J);
    std::memcpy(a.lo.data() + m * J, l.data(), 4 * J);
  }
  a.exact = any_lo == 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBF16DotBuilt = true;

// Rows [0, MB) of the split activations (row stride J pairs) times one bfloat16 pair panel ->
// y[:, 0:cols]: hi (and, unless kExact, lo) pair dot products per lane, float32 accumulators.
template <int MB, bool kExact>
void bf16_dot_panel(const uint32_t* hi, const uint32_t* lo, int64_t J, const uint16_t* w,
                    float* y, int64_t ldy, int64_t cols) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j * 2 * kNB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + j * 2 * kNB + 2 * kLanes);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xh = (__m512bh)_mm512_set1_epi32(int32_t(hi[m * J + j]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xh);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xh);
      if (!kExact) {
        const __m512bh xl = (__m512bh)_mm512_set1_epi32(int32_t(lo[m * J + j]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xl);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xl);
      }
    }
  }
  vf v[MB][2];
  std::memcpy(v, acc, sizeof(v));
  store_rows<MB>(v, y, ldy, cols);
}

// R <= 3 rows times two pair panels w, v over pair rows [j0, j1), added to the partial sums
// t[R][2 kNB]: bf16_dot_panel<R>'s sums for each (the same vdpbf16ps per lane, pair and part, in
// order), in 256-bit vectors: 8 R chains and two streams in flight (as the float32 pair_pass).
template <int R, bool kExact>
void bf16_pair_pass(const uint32_t* hi, const uint32_t* lo, int64_t J, const uint16_t* w,
                    const uint16_t* v, int64_t j0, int64_t j1, float* t) {
  __m256 acc[R][8];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 8; ++c) acc[m][c] = _mm256_loadu_ps(t + m * 2 * kNB + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m256bh xh[R], xl[R];
    for (int m = 0; m < R; ++m) {
      xh[m] = (__m256bh)_mm256_set1_epi32(int32_t(hi[m * J + j]));
      if (!kExact) xl[m] = (__m256bh)_mm256_set1_epi32(int32_t(lo[m * J + j]));
    }
    for (int c = 0; c < 8; ++c) {
      const uint16_t* src = c < 4 ? w + j * 2 * kNB + 16 * c : v + j * 2 * kNB + 16 * (c - 4);
      const __m256bh wv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      for (int m = 0; m < R; ++m) {
        acc[m][c] = _mm256_dpbf16_ps(acc[m][c], wv, xh[m]);
        if (!kExact) acc[m][c] = _mm256_dpbf16_ps(acc[m][c], wv, xl[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(t + m * 2 * kNB + 8 * c, acc[m][c]);
}

// The same for 4 <= R <= 6 rows in 512-bit vectors (as pair_pass512).
template <int R, bool kExact>
void bf16_pair_pass512(const uint32_t* hi, const uint32_t* lo, int64_t J, const uint16_t* w,
                       const uint16_t* v, int64_t j0, int64_t j1, float* t) {
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_loadu_ps(t + m * 2 * kNB + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    for (int c = 0; c < 4; ++c) {
      const uint16_t* src = c < 2 ? w + j * 2 * kNB + 32 * c : v + j * 2 * kNB + 32 * (c - 2);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(src);
      for (int m = 0; m < R; ++m) {
        acc[m][c] =
            _mm512_dpbf16_ps(acc[m][c], wv, (__m512bh)_mm512_set1_epi32(int32_t(hi[m * J + j])));
        if (!kExact)
          acc[m][c] =
              _mm512_dpbf16_ps(acc[m][c], wv, (__m512bh)_mm512_set1_epi32(int32_t(lo[m * J + j])));
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(t + m * 2 * kNB + 16 * c, acc[m][c]);
}

// All M rows times the bfloat16 pair panels w, v (pair_groups over the split activations).
template <bool kExact>
void bf16_pair_panels(const uint32_t* hi, const uint32_t* lo, int64_t M, int64_t J,
                      const uint16_t* w, const uint16_t* v, float* y, int64_t ldy, int64_t cols_w,
                      int64_t cols_v) {
  constexpr int64_t chunk = 8192 / (4 * kNB * sizeof(uint16_t));  // pair rows of 2 panels
  pair_groups(M, J, chunk, y, ldy, cols_w, cols_v,
              [&](int r, int64_t m, int64_t j0, int64_t j1, float* t, int64_t /*ahead*/) {
                const uint32_t *h = hi + m * J, *l = lo + m * J;
                if (r == 1) bf16_pair_pass<1, kExact>(h, l, J, w, v, j0, j1, t);
                if (r == 2) bf16_pair_pass<2, kExact>(h, l, J, w, v, j0, j1, t);
                if (r == 3) bf16_pair_pass<3, kExact>(h, l, J, w, v, j0, j1, t);
                if (r == 4) bf16_pair_pass512<4, kExact>(h, l, J, w, v, j0, j1, t);
                if (r == 5) bf16_pair_pass512<5, kExact>(h, l, J, w, v, j0, j1, t);
                if (r == 6) bf16_pair_pass512<6, kExact>(h, l, J, w, v, j0, j1, t);
              });
}
#else
constexpr bool kBF16DotBuilt = false;
#endif

// ---- bfloat16 tile products (AMX) ---------------------------------------------------------------
// Where the CPU has AMX-BF16 (Sapphire Rapids and later) and the kernel grants this process its
// tile state, kWeightBF16 products run on the tile unit instead of vdpbf16ps: TDPBF16PS multiplies
// a [16 rows, 16 pairs] tile of the split activations by a [16 pairs, 16 columns] tile of a pair
// panel, which is the panel's layout read at a stride of one pair row (128 bytes), so the panels
// are packed as before. One instruction does 16 x 16 x 32 products, so rows beyond the first cost
// next to nothing and a product stays bound by reading its weights up to 16 rows and beyond:
// where vdpbf16ps is compute-bound from about 8 rows on (the batched steps of the engine), this
// is not. Every row count takes the same sequence of tile instructions per row (rows padded to
// 16 with zeros), so a row's sums do not depend on the rows beside it; they differ from
// vdpbf16ps's in the last bits (the tile unit's own order of accumulation).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
constexpr bool kAmxBuilt = true;
constexpr int kTileRows = 16;   // rows of an activation tile (the row group)
constexpr int kTilePairs = 16;  // pairs per tile step: 64 bytes of a tile row

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 - 3 sums (two panels x two 16-column halves), 4 activations, 5 and 6 weights, 16 rows
// each; for a step over the last `pairs` < 16 pairs, 4 takes pairs columns and 5, 6 pairs rows.
inline void load_tiles(int pairs) {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.colsb[t] = t == 4 ? 4 * pairs : 64;
    c.rows[t] = t == 5 || t == 6 ? pairs : kTileRows;
  }
  _tile_loadconfig(&c);
}

// Whether the tile unit can run here: the CPU says AMX-BF16 and the kernel grants this process
// the tile data state (Linux asks for it once per process: arch_prctl ARCH_REQ_XCOMP_PERM), and
// PALLAS_ATTN_AMX is not "0".
bool amx() {
  static const bool ok = [] {
    const char* env = std::getenv("PALLAS_ATTN_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// One pass of a step: pairs [j0, j0 + 16) (or the configured last few) of the activation rows x
// (row stride J) times the pair panels w (into tiles 0, 1) and, when v, v (tiles 2, 3).
inline void tile_pass(const uint32_t* x, int64_t J, const uint16_t* w, const uint16_t* v,
                      int64_t j0) {
  constexpr int64_t kRow = 2 * kNB * sizeof(uint16_t);  // one pair row of a panel: 128 bytes
  _tile_loadd(4, x + j0, J * 4);
  _tile_loadd(5, w + j0 * 2 * kNB, kRow);
  _tile_loadd(6, w + j0 * 2 * kNB + kNB, kRow);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  if (v != nullptr) {
    _tile_loadd(5, v + j0 * 2 * kNB, kRow);
    _tile_loadd(6, v + j0 * 2 * kNB + kNB, kRow);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
}

// Sums of one step: the split activations' hi pass and, unless kExact, their lo pass.
template <bool kExact>
inline void tile_step(const uint32_t* hi, const uint32_t* lo, int64_t J, const uint16_t* w,
                      const uint16_t* v, int64_t j0) {
  tile_pass(hi, J, w, v, j0);
  if (!kExact) tile_pass(lo, J, w, v, j0);
}

// All M rows (the activations padded to a multiple of 16 rows) times the panels w and, when v,
// v -> y[:, 0:cols_w] and y[:, kNB:kNB + cols_v]. The tile configuration is the caller's (full
// steps); a last step of fewer than 16 pairs reconfigures around it and restores it.
template <bool kExact>
void tile_panels(const uint32_t* hi, const uint32_t* lo, int64_t M, int64_t J, const uint16_t* w,
                 const uint16_t* v, float* y, int64_t ldy, int64_t cols_w, int64_t cols_v) {
  alignas(64) float t[kTileRows][2 * kNB];
  const int64_t full = J / kTilePairs * kTilePairs, tail = J - full;
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const uint32_t *h = hi + m0 * J, *l = lo + m0 * J;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j0 = 0; j0 < full; j0 += kTilePairs) tile_step<kExact>(h, l, J, w, v, j0);
    _tile_stored(0, &t[0][0], sizeof(t[0]));
    _tile_stored(1, &t[0][kLanes], sizeof(t[0]));
    _tile_stored(2, &t[0][kNB], sizeof(t[0]));
    _tile_stored(3, &t[0][kNB + kLanes], sizeof(t[0]));
    if (tail > 0) {  // loading a configuration zeroes the tiles: the sums wait in t
      load_tiles(int(tail));
      _tile_loadd(0, &t[0][0], sizeof(t[0]));
      _tile_loadd(1, &t[0][kLanes], sizeof(t[0]));
      _tile_loadd(2, &t[0][kNB], sizeof(t[0]));
      _tile_loadd(3, &t[0][kNB + kLanes], sizeof(t[0]));
      tile_step<kExact>(h, l, J, w, v, full);
      _tile_stored(0, &t[0][0], sizeof(t[0]));
      _tile_stored(1, &t[0][kLanes], sizeof(t[0]));
      _tile_stored(2, &t[0][kNB], sizeof(t[0]));
      _tile_stored(3, &t[0][kNB + kLanes], sizeof(t[0]));
      load_tiles(kTilePairs);
    }
    const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
    for (int64_t m = 0; m < rows; ++m) {
      std::memcpy(y + (m0 + m) * ldy, t[m], cols_w * sizeof(float));
      if (v != nullptr) std::memcpy(y + (m0 + m) * ldy + kNB, t[m] + kNB, cols_v * sizeof(float));
    }
  }
}

// Panels [p0, p1) (in pairs, an odd last one alone) on this thread's tile unit.
void tile_range(const BF16Acts& a, int64_t M, int64_t J, const uint16_t* wp, int64_t p0,
                int64_t p1, float* y, int64_t N) {
  const int64_t panel_elems = 2 * J * kNB;
  load_tiles(kTilePairs);
  for (int64_t p = p0; p < p1; p += 2) {
    const int64_t n0 = p * kNB;
    const uint16_t* w = wp + p * panel_elems;
    const uint16_t* v = p + 1 < p1 ? w + panel_elems : nullptr;
    const int64_t cols_w = std::min<int64_t>(kNB, N - n0);
    const int64_t cols_v = v != nullptr ? std::min<int64_t>(kNB, N - n0 - kNB) : 0;
    if (a.exact)
      tile_panels<true>(a.hi.data(), a.lo.data(), M, J, w, v, y + n0, N, cols_w, cols_v);
    else
      tile_panels<false>(a.hi.data(), a.lo.data(), M, J, w, v, y + n0, N, cols_w, cols_v);
  }
  _tile_release();  // the thread's tile state back to its initial (cheap to switch) one
}
#else
constexpr bool kAmxBuilt = false;
bool amx() { return false; }
#endif

// Whether kWeightBF16 runs the dot products: built for them (-march=native on a CPU with
// avx512_bf16) and the CPU running this has them (a library built elsewhere).
bool bf16_dot() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = kBF16DotBuilt && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void run_bf16(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const uint16_t* wp,
              int64_t P, float* y, int64_t N, bool exact_kind) {
  if (exact_kind || !(bf16_dot() || amx())) return run(pool, x, M, K, wp, P, y, N);
  thread_local BF16Acts acts;  // the calling thread's; pool tasks only read it during the call
  split_activations(x, M, K, acts);
  const BF16Acts& a = acts;
  const int64_t J = (K + 1) / 2, panel_elems = 2 * J * kNB;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
  if (amx()) {
    parallel_pairs(pool, P, worth_sharing(P * panel_elems * 2, M), [&](int64_t p0, int64_t p1) {
      tile_range(a, M, J, wp, p0, p1, y, N);
    });
    return;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  parallel_pairs(pool, P, worth_sharing(P * panel_elems * 2, M), [&](int64_t p0, int64_t p1) {
    for (; p0 + 1 < p1; p0 += 2) {
      const int64_t n0 = p0 * kNB, cols = N - n0 - kNB < kNB ? N - n0 - kNB : kNB;
      const uint16_t *w = wp + p0 * panel_elems, *v = w + panel_elems;
      if (a.exact)
        bf16_pair_panels<true>(a.hi.data(), a.lo.data(), M, J, w, v, y + n0, N, kNB, cols);
      else
        bf16_pair_panels<false>(a.hi.data(), a.lo.data(), M, J, w, v, y + n0, N, kNB, cols);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
      for (int64_t m0 = 0; m0 < M; m0 += kMB) {
        pallas_attn::with_rows(M - m0, [&](auto MB) {
          const uint32_t *hi = a.hi.data() + m0 * J, *lo = a.lo.data() + m0 * J;
          float* ym = y + m0 * N + n0;
          if (a.exact)
            bf16_dot_panel<MB, true>(hi, lo, J, wp + p * panel_elems, ym, N, cols);
          else
            bf16_dot_panel<MB, false>(hi, lo, J, wp + p * panel_elems, ym, N, cols);
        });
      }
    }
  });
#endif
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wp,
                      ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  const bool bf16 = wp.element_type() == ffi::DataType::BF16;
  const int64_t K2 = xd.size() == 2 && bf16 ? xd[1] + (xd[1] & 1) : xd.size() == 2 ? xd[1] : -1;
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNB || wd[1] != K2 ||
      yd[0] != xd[0] || (yd[1] + kNB - 1) / kNB != wd[0])
    return ffi::Error::InvalidArgument(
        "rows_matmul: want x [M, K], wp [ceil(N / 32), K (bfloat16: even), 32], y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  const void* w = wp.untyped_data();
  if (wp.element_type() == ffi::DataType::F32 && kind == pallas_attn::kWeightF32) {
    run(pool, x.typed_data(), M, K, static_cast<const float*>(w), P, y->typed_data(), N);
  } else if (bf16 && (kind == pallas_attn::kWeightBF16 || kind == pallas_attn::kWeightBF16Exact)) {
    run_bf16(pool, x.typed_data(), M, K, static_cast<const uint16_t*>(w), P, y->typed_data(), N,
             kind == pallas_attn::kWeightBF16Exact);
  } else {
    return ffi::Error::InvalidArgument("rows_matmul: weights float32 or bfloat16 of their kind");
  }
  return ffi::Error::Success();
}

// ---- Block-quantized weights -------------------------------------------------------------------

constexpr int kBlock = 32;  // weights per quantization block along K (GGUF's QK8_0 / QK4_0 / QK4_1)
enum Format : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };  // models/quant.py FORMATS order
// Added to the FFI's fmt attribute: quantize the activations to 8-bit blocks (run_q8).
constexpr int32_t kQ8Activations = 16;

// Bytes of one (panel, block): 32 float16 scales, [32 float16 minimums,] then the quants in
// groups of 4 consecutive k per column, [groups g][32 columns][4 i] (one 32-bit lane of a vector
// per column, what the 4-way integer dot products take): Q8_0 8 groups, byte = q(k = 4g + i) +
// 128 (offset binary: the unsigned operand of vpdpbusd); Q4 4 groups, byte = q(k = 4g + i) in the
// low nibble and q(k = 16 + 4g + i) in the high one.
constexpr int64_t kGroupBytes = 4 * kNB;
constexpr int64_t block_bytes(int32_t fmt) {
  return fmt == kQ8_0 ? 2 * kNB + kBlock * kNB : fmt == kQ4_0 ? 2 * kNB + 16 * kNB
                                                             : 4 * kNB + 16 * kNB;
}
constexpr int64_t quants_offset(int32_t fmt) { return fmt == kQ4_1 ? 4 * kNB : 2 * kNB; }

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, exact
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else {
    const float f = float(m) * (1.0f / 16777216.0f);  // subnormal: m * 2^-24, exact in float32
    std::memcpy(&u, &f, sizeof(u));
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Conversions to float32 vectors: AVX-512's single instructions where the build has them (the
// portable forms compile to scalar loops, which made the quantized kernels compute-bound).
inline vf load_half(const uint8_t* p) {  // kLanes float16 values (unaligned) -> float32
#if defined(__AVX512F__)
  static_assert(kLanes == 16, "one zmm register");
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  uint16_t h[kLanes];
  std::memcpy(h, p, sizeof(h));
  float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = half_to_float(h[i]);
  return load(f);
#endif
}

inline vi load_vi(const uint8_t* p) {  // 4 bytes per lane: one column's group of 4 k
  vi v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Byte I of every lane of a group as the integer part of its weight, in float32.
template <int32_t FMT, int I, bool kHigh>
inline vf quant(vi v) {
  if (FMT == kQ8_0) return __builtin_convertvector(((v >> (8 * I)) & 255) - 128, vf);
  return __builtin_convertvector((v >> (8 * I + (kHigh ? 4 : 0))) & 15, vf);
}

// Rows [0, MB) of x times one quantized panel -> y[:, 0:cols], float32 activations. Each weight
// becomes d * q (Q8_0), d * q - 8 d (Q4_0: d * (q - 8), exact since both terms are) or d * q + m
// (Q4_1, one rounding as gguf.quants' (d * q) + m, d * q being exact), then the float kernel's
// FMA in the order k = 0, 1, ...: the same sums as panel() over the dequantized weights.
template <int MB, int32_t FMT>
void qpanel(const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = block_bytes(FMT);
  vf acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vf{};
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = w + b * bytes;
    const vf d0 = load_half(blk), d1 = load_half(blk + 2 * kLanes);
    vf c0, c1;  // the constant term: 0, -8 d or m
    if (FMT == kQ8_0) {
      c0 = c1 = vf{};
    } else if (FMT == kQ4_0) {
      c0 = d0 * -8.0f;
      c1 = d1 * -8.0f;
    } else {
      c0 = load_half(blk + 2 * kNB);
      c1 = load_half(blk + 2 * kNB + 2 * kLanes);
    }
    const uint8_t* q = blk + quants_offset(FMT);
    const float* xb = x + b * kBlock;
    auto step = [&](int64_t k, vf q0, vf q1) {
      vf w0 = FMT == kQ8_0 ? d0 * q0 : q0 * d0 + c0, w1 = FMT == kQ8_0 ? d1 * q1 : q1 * d1 + c1;
      in_registers(w0, w1);
      for (int m = 0; m < MB; ++m) {
        const float xv = xb[m * K + k];
        acc[m][0] += xv * w0;
        acc[m][1] += xv * w1;
      }
    };
    // k = 4g + i (Q8_0), then for Q4 the low nibbles (k < 16) before the high ones: k's order.
    auto groups = [&](auto high) {
      constexpr bool kHigh = decltype(high)::value;
      const int64_t base = kHigh ? 16 : 0;
      for (int64_t g = 0; g < (FMT == kQ8_0 ? 8 : 4); ++g) {
        const vi v0 = load_vi(q + g * kGroupBytes), v1 = load_vi(q + g * kGroupBytes + 4 * kLanes);
        step(base + 4 * g + 0, quant<FMT, 0, kHigh>(v0), quant<FMT, 0, kHigh>(v1));
        step(base + 4 * g + 1, quant<FMT, 1, kHigh>(v0), quant<FMT, 1, kHigh>(v1));
        step(base + 4 * g + 2, quant<FMT, 2, kHigh>(v0), quant<FMT, 2, kHigh>(v1));
        step(base + 4 * g + 3, quant<FMT, 3, kHigh>(v0), quant<FMT, 3, kHigh>(v1));
      }
    };
    groups(std::false_type{});
    if (FMT != kQ8_0) groups(std::true_type{});
  }
  for (int m = 0; m < MB; ++m) {
    float out[kNB];
    std::memcpy(out, &acc[m][0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[m][1], sizeof(vf));
    std::memcpy(y + m * ldy, out, cols * sizeof(float));
  }
}

template <int32_t FMT>
void run_q(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const uint8_t* wq,
           int64_t P, float* y, int64_t N) {
  const int64_t panel_bytes = (K / kBlock) * block_bytes(FMT);
  pallas_attn::parallel_for(pool, P, worth_sharing(P * panel_bytes, M), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
      for (int64_t m0 = 0; m0 < M; m0 += kMB)
        pallas_attn::with_rows(M - m0, [&](auto MB) {
          qpanel<MB, FMT>(x + m0 * K, K, wq + p * panel_bytes, y + m0 * N + n0, N, cols);
        });
    }
  });
}

// ---- 8-bit activations: integer dot products -----------------------------------------------
//
// run_q8 quantizes x once per call, per row and block of 32, to int8: d = max |x| / 127,
// q = round-to-nearest-even(x * (1 / d)) in [-127, 127] (all zero for a zero block), and keeps
// the block's float32 d and its integer sum s = sum q. A weight block's dot product with it is
// then an int32 sum of 32 products, exact, and
//   Q8_0: y += d_x d_w sum(q_w q_x)
//   Q4_0: y += d_x d_w (sum(q_w q_x) - 8 s)
//   Q4_1: y += d_x d_w sum(q_w q_x) + m (d_x s)
// in float32 (one convert, one multiply-add per block and row, not per weight). The error is the
// activations' rounding: |x - d_x q_x| <= d_x / 2 per element (models/rows_matmul.py states the
// bound on a product).
//
// The 4-way products take one unsigned and one signed byte operand: the weights are the unsigned
// side (Q4 nibbles are, Q8_0 is stored offset by 128), the activations the signed one, and the
// offset comes off through s: sum((q_w + 128) q_x) - 128 s.
//   AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products summed into each int32 lane, no saturation).
//   AVX2 (no VNNI): vpmaddubsw + vpmaddwd. Its pairwise 16-bit sums saturate past 32767, which
//     255 x 127 x 2 would, so Q8_0 there takes |q_w| and the sign of q_w moved onto q_x
//     (vpsignb; |q_w| <= 128, 128 x 127 x 2 fits), and needs no offset.
//   Otherwise a scalar loop over the lanes.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kQ8Offset = true;  // the Q8_0 product includes the +128 offset of the weights
inline vi dot4(vi acc, vi w, vi x) {
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
}
inline vi dot4_q8(vi acc, vi w, vi x) { return dot4(acc, w, x); }
#elif defined(__AVX2__)
constexpr bool kQ8Offset = false;
inline __m256i half(const vi& v, int h) {
  __m256i r;
  std::memcpy(&r, reinterpret_cast<const char*>(&v) + 32 * h, 32);
  return r;
}
inline vi join(__m256i lo, __m256i hi) {
  vi v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline __m256i dot4_256(__m256i acc, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline vi dot4(vi acc, vi w, vi x) {
  return join(dot4_256(half(acc, 0), half(w, 0), half(x, 0)),
              dot4_256(half(acc, 1), half(w, 1), half(x, 1)));
}
inline vi dot4_q8(vi acc, vi w, vi x) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  __m256i r[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i q = _mm256_xor_si256(half(w, h), flip);  // signed q_w
    r[h] = dot4_256(half(acc, h), _mm256_sign_epi8(q, q), _mm256_sign_epi8(half(x, h), q));
  }
  return join(r[0], r[1]);
}
#else
constexpr bool kQ8Offset = true;
inline vi dot4(vi acc, vi w, vi x) {
  uint8_t wb[4 * kLanes];
  int8_t xb[4 * kLanes];
  std::memcpy(wb, &w, sizeof(wb));
  std::memcpy(xb, &x, sizeof(xb));
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) acc[l] += int32_t(wb[4 * l + i]) * int32_t(xb[4 * l + i]);
  return acc;
}
inline vi dot4_q8(vi acc, vi w, vi x) { return dot4(acc, w, x); }
#endif

// The activations of one call in 8-bit blocks: q [M, K], and per (row, block) d, d * s and s.
struct QActs {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
};

void quantize_activations(const float* x, int64_t M, int64_t K, QActs& a) {
  const int64_t nb = K / kBlock;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.ds.resize(M * nb);
  a.s.resize(M * nb);
  for (int64_t r = 0; r < M * nb; ++r) {  // r = m * nb + b: the block at x + r * kBlock
    const float* xb = x + r * kBlock;
    int8_t* q = a.q.data() + r * kBlock;
    int32_t s = 0;
#if defined(__AVX2__)
    // The scalar loop below, 8 lanes at a time (it took 3x as long as this, on the calling
    // thread, before every product): the same max (a NaN lane is skipped, as std::max skips it),
    // the same d, and vcvtps2dq rounds to nearest even as nearbyint does.
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);
    }
    float t[8];
    _mm256_storeu_ps(t, mx);
    float amax = 0.0f;
    for (int k = 0; k < 8; ++k) amax = std::max(amax, t[k]);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
    int32_t st[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st),
                        _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                         _mm256_add_epi32(qi[2], qi[3])));
    for (int k = 0; k < 8; ++k) s += st[k];
#else
    float amax = 0.0f;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < kBlock; ++k) {
      q[k] = int8_t(std::nearbyint(xb[k] * id));
      s += q[k];
    }
#endif
    a.d[r] = d;
    a.s[r] = s;
    a.ds[r] = d * float(s);
  }
}

inline vi broadcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return vi{} + v;
}

// Rows [0, MB) of the quantized activations times one quantized panel -> y[:, 0:cols].
template <int MB, int32_t FMT>
void q8panel(const QActs& a, int64_t m0, int64_t K, const uint8_t* w, float* y, int64_t ldy,
             int64_t cols) {
  constexpr int64_t bytes = block_bytes(FMT);
  const int64_t nb = K / kBlock;
  // The integer sum starts at the offset's correction: -8 s (Q4_0), -128 s (Q8_0 with offset).
  constexpr int32_t kOff = FMT == kQ4_0 ? 8 : FMT == kQ8_0 && kQ8Offset ? 128 : 0;
  vf acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const uint8_t* q = blk + quants_offset(FMT);
    const int8_t* xb = a.q.data() + m0 * K + b * kBlock;
    vi ia[MB][2];
    for (int m = 0; m < MB; ++m) ia[m][0] = ia[m][1] = vi{} - kOff * a.s[(m0 + m) * nb + b];
    if (FMT == kQ8_0) {
      for (int64_t g = 0; g < 8; ++g) {
        const vi w0 = load_vi(q + g * kGroupBytes), w1 = load_vi(q + g * kGroupBytes + 4 * kLanes);
        for (int m = 0; m < MB; ++m) {
          const vi xv = broadcast4(xb + m * K + 4 * g);
          ia[m][0] = dot4_q8(ia[m][0], w0, xv);
          ia[m][1] = dot4_q8(ia[m][1], w1, xv);
        }
      }
    } else {
      for (int64_t g = 0; g < 4; ++g) {
        const vi v0 = load_vi(q + g * kGroupBytes), v1 = load_vi(q + g * kGroupBytes + 4 * kLanes);
        const vi lo0 = v0 & 0x0f0f0f0f, lo1 = v1 & 0x0f0f0f0f;
        const vi hi0 = (v0 >> 4) & 0x0f0f0f0f, hi1 = (v1 >> 4) & 0x0f0f0f0f;
        for (int m = 0; m < MB; ++m) {
          const vi xl = broadcast4(xb + m * K + 4 * g), xh = broadcast4(xb + m * K + 16 + 4 * g);
          ia[m][0] = dot4(dot4(ia[m][0], lo0, xl), hi0, xh);
          ia[m][1] = dot4(dot4(ia[m][1], lo1, xl), hi1, xh);
        }
      }
    }
    const vf d0 = load_half(blk), d1 = load_half(blk + 2 * kLanes);
    vf m0v{}, m1v{};
    if (FMT == kQ4_1) {
      m0v = load_half(blk + 2 * kNB);
      m1v = load_half(blk + 2 * kNB + 2 * kLanes);
    }
    for (int m = 0; m < MB; ++m) {
      const float dx = a.d[(m0 + m) * nb + b];
      acc[m][0] += __builtin_convertvector(ia[m][0], vf) * (d0 * dx);
      acc[m][1] += __builtin_convertvector(ia[m][1], vf) * (d1 * dx);
      if (FMT == kQ4_1) {
        const float ds = a.ds[(m0 + m) * nb + b];
        acc[m][0] += m0v * ds;
        acc[m][1] += m1v * ds;
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[kNB];
    std::memcpy(out, &acc[m][0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[m][1], sizeof(vf));
    std::memcpy(y + m * ldy, out, cols * sizeof(float));
  }
}

// Rows per register block of q8panel: 4 rows hold 8 float and 8 integer accumulators; 8 rows
// would need all 32 vector registers before the weights.
constexpr int kMB8 = 4;

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// One block's float step for one row r and column vector c of its 8 outputs, from the integer
// sums t: acc + (t [- 8 s]) (d_w d_x) [+ m (d_x s)], in this order (both AVX2 kernels).
template <int32_t FMT>
inline __m256 block_step(const uint8_t* blk, int64_t c, __m256i t, const QActs& a, int64_t r,
                         __m256 acc) {
  const __m256 d =
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * c)));
  if (FMT == kQ4_0) t = _mm256_sub_epi32(t, _mm256_set1_epi32(8 * a.s[r]));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(a.d[r])), acc);
  if (FMT == kQ4_1) {
    const __m256 mn = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * kNB + 16 * c)));
    acc = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.ds[r]), acc);
  }
  return acc;
}

// q8panel for AVX2 builds, in 256-bit registers (the generic 16-lane form above spills on
// AVX2's 16 registers). One row (decode at B = 1): all 4 column vectors of a panel in one pass,
// with their float accumulators in registers, so the panel is read front to back once; more rows
// take q8panel_avx2_rows below.
// Q4: vpmaddubsw of 4 nibbles x 4 activation bytes gives 16-bit pair sums of at most
// 2 x 15 x 127, so a block's 8 groups (low and high nibbles of 4) add up in 16 bits
// (<= 30480) before one vpmaddwd widens them; Q8_0: |q_w| x (q_x with q_w's sign), widened
// per group (2 x 128 x 127 fits once). The integer sums are exact and the float arithmetic per
// block is q8panel's (the same operations in the same order): the same results bit for bit.
template <int32_t FMT>
void q8panel_avx2_row(const QActs& a, int64_t m0, int64_t K, const uint8_t* w, float* y,
                      int64_t ldy, int64_t cols) {
  constexpr int MB = 1, CV = 4;
  constexpr int64_t kAhead = 4;  // blocks
  constexpr int64_t bytes = block_bytes(FMT);
  const int64_t nb = K / kBlock;
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int64_t c0 = 0; c0 < kNB / 8 && 8 * c0 < cols; c0 += CV) {  // columns 8 c0 .. 8 c0 + 8 CV - 1
    __m256 acc[MB][CV];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < CV; ++v) acc[m][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bytes;
      const uint8_t* q = blk + quants_offset(FMT) + 32 * c0;  // group g at q + g * kGroupBytes
      // One row is bound by reading the panel: Q4 blocks (576 or 640 bytes) prefetched 4
      // ahead read 11-23% faster from memory on one Zen 3 thread; Q8_0's gained nothing.
      if (FMT != kQ8_0 && b + kAhead < nb)
        for (int64_t l = 0; l < bytes; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * bytes + l), _MM_HINT_T0);
      const int8_t* xb = a.q.data() + m0 * K + b * kBlock;
      __m256i is[MB][CV];
      if (FMT == kQ8_0) {
        for (int g = 0; g < 8; ++g)
          for (int v = 0; v < CV; ++v) {
            const __m256i wv =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes + 32 * v));
            const __m256i s = _mm256_xor_si256(wv, flip);  // signed q_w
            const __m256i u = _mm256_sign_epi8(s, s);
            for (int m = 0; m < MB; ++m) {
              const __m256i x = _mm256_sign_epi8(bcast4(xb + m * K + 4 * g), s);
              const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
              is[m][v] = g == 0 ? p : _mm256_add_epi32(is[m][v], p);
            }
          }
      } else {
        for (int g = 0; g < 4; ++g)
          for (int v = 0; v < CV; ++v) {
            const __m256i wv =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes + 32 * v));
            const __m256i lo = _mm256_and_si256(wv, nib);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
            for (int m = 0; m < MB; ++m) {
              const __m256i p =
                  _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb + m * K + 4 * g)),
                                   _mm256_maddubs_epi16(hi, bcast4(xb + m * K + 16 + 4 * g)));
              is[m][v] = g == 0 ? p : _mm256_add_epi16(is[m][v], p);
            }
          }
        for (int m = 0; m < MB; ++m)
          for (int v = 0; v < CV; ++v) is[m][v] = _mm256_madd_epi16(is[m][v], ones);
      }
      for (int v = 0; v < CV; ++v)
        for (int m = 0; m < MB; ++m)
          acc[m][v] = block_step<FMT>(blk, c0 + v, is[m][v], a, (m0 + m) * nb + b, acc[m][v]);
    }
    for (int v = 0; v < CV; ++v) {
      const int64_t c = c0 + v;
      if (8 * c >= cols) break;  // padding columns: computed (zero weights), not stored
      const int64_t n = cols - 8 * c < 8 ? cols - 8 * c : 8;
      for (int m = 0; m < MB; ++m) {
        float out[8];
        _mm256_storeu_ps(out, acc[m][v]);
        std::memcpy(y + m * ldy + 8 * c, out, n * sizeof(float));
      }
    }
  }
}

// The integer sums of RB rows of one block times one 8-column vector of its quants (q: group 0
// of that vector), exact: q8panel_avx2_row's arithmetic for one (block, vector).
template <int RB, int32_t FMT>
inline void block_sums(const int8_t* xb, int64_t K, const uint8_t* q, __m256i (&is)[RB]) {
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int m = 0; m < RB; ++m) is[m] = _mm256_setzero_si256();
  if (FMT == kQ8_0) {
    for (int g = 0; g < 8; ++g) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes));
      const __m256i s = _mm256_xor_si256(wv, flip);  // signed q_w
      const __m256i u = _mm256_sign_epi8(s, s);
      for (int m = 0; m < RB; ++m) {
        const __m256i x = _mm256_sign_epi8(bcast4(xb + m * K + 4 * g), s);
        is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
      }
    }
  } else {
    for (int g = 0; g < 4; ++g) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes));
      const __m256i lo = _mm256_and_si256(wv, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
      for (int m = 0; m < RB; ++m)
        is[m] = _mm256_add_epi16(
            is[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb + m * K + 4 * g)),
                                    _mm256_maddubs_epi16(hi, bcast4(xb + m * K + 16 + 4 * g))));
    }
    for (int m = 0; m < RB; ++m) is[m] = _mm256_madd_epi16(is[m], ones);
  }
}

// Rows [m0, m0 + MR) (MR <= 8: run_q8 takes more than one row 8 at a time, so a remainder of
// one lands here too) times one panel, block by block: each block's quants are read from
// memory once and used for every row and column vector while in L1, with the weight
// work of a group (offset, sign or nibbles) shared by all MR rows; the float accumulators of the
// MR x 32 outputs stay in an L1 tile. Against passes of 4 rows over one column vector (2 x 4
// passes over the panel, the later ones from L2 or memory): Q8_0 1.35x and Q4_0 1.6x faster at
// 8 rows on weights streamed from memory, one thread of a Zen 3 core. The same integer sums and
// float steps per block and row as q8panel_avx2_row, in the same order: the same results bit
// for bit.
template <int MR, int32_t FMT>
void q8panel_avx2_rows(const QActs& a, int64_t m0, int64_t K, const uint8_t* w, float* y,
                       int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = block_bytes(FMT);
  const int64_t nb = K / kBlock, vecs = (cols + 7) / 8;  // padding vectors: not computed
  alignas(32) float acc[MR][kNB] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const int8_t* xb = a.q.data() + m0 * K + b * kBlock;
    for (int64_t c = 0; c < vecs; ++c) {
      __m256i is[MR];
      block_sums<MR, FMT>(xb, K, blk + quants_offset(FMT) + 32 * c, is);
      for (int m = 0; m < MR; ++m) {
        float* o = acc[m] + 8 * c;
        _mm256_store_ps(o, block_step<FMT>(blk, c, is[m], a, (m0 + m) * nb + b, _mm256_load_ps(o)));
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(y + m * ldy, acc[m], cols * sizeof(float));
}
#define PALLAS_ATTN_Q8_AVX2 1
#endif

template <int32_t FMT>
void run_q8(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const uint8_t* wq,
            int64_t P, float* y, int64_t N) {
  thread_local QActs acts;  // the calling thread's; pool tasks only read it during the call
  quantize_activations(x, M, K, acts);
  const QActs& a = acts;
  const int64_t panel_bytes = (K / kBlock) * block_bytes(FMT);
  pallas_attn::parallel_for(pool, P, worth_sharing(P * panel_bytes, M), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
      const uint8_t* w = wq + p * panel_bytes;
#if defined(PALLAS_ATTN_Q8_AVX2)
      if (M == 1) {
        q8panel_avx2_row<FMT>(a, 0, K, w, y + n0, N, cols);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        pallas_attn::with_rows(M - m0 < 8 ? M - m0 : 8, [&](auto MR) {
          q8panel_avx2_rows<MR, FMT>(a, m0, K, w, y + m0 * N + n0, N, cols);
        });
      }
      continue;
#endif
      for (int64_t m0 = 0; m0 < M; m0 += kMB8) {
        auto body = [&](auto MB) {
          q8panel<MB, FMT>(a, m0, K, w, y + m0 * N + n0, N, cols);
        };
        switch (M - m0) {
          case 1: body(std::integral_constant<int, 1>{}); break;
          case 2: body(std::integral_constant<int, 2>{}); break;
          case 3: body(std::integral_constant<int, 3>{}); break;
          default: body(std::integral_constant<int, kMB8>{});
        }
      }
    }
  });
}

// The quantized product for fmt = format [+ kQ8Activations]; false for an unknown fmt.
bool run_quantized(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const uint8_t* wq,
                   int64_t P, float* y, int64_t N, int32_t fmt) {
  switch (fmt) {
    case kQ8_0: run_q<kQ8_0>(pool, x, M, K, wq, P, y, N); return true;
    case kQ4_0: run_q<kQ4_0>(pool, x, M, K, wq, P, y, N); return true;
    case kQ4_1: run_q<kQ4_1>(pool, x, M, K, wq, P, y, N); return true;
    case kQ8_0 + kQ8Activations: run_q8<kQ8_0>(pool, x, M, K, wq, P, y, N); return true;
    case kQ4_0 + kQ8Activations: run_q8<kQ4_0>(pool, x, M, K, wq, P, y, N); return true;
    case kQ4_1 + kQ8Activations: run_q8<kQ4_1>(pool, x, M, K, wq, P, y, N); return true;
    default: return false;
  }
}

ffi::Error RowsMatmulQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                       ffi::ResultBuffer<ffi::F32> y, int32_t fmt) {
  const auto xd = x.dimensions(), wd = wq.dimensions(), yd = y->dimensions();
  const int32_t base = fmt & ~kQ8Activations;
  if (base < kQ8_0 || base > kQ4_1 || (fmt & ~(kQ8Activations | 3)) != 0)
    return ffi::Error::InvalidArgument("rows_matmul_q: bad format");
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] % kBlock != 0 ||
      wd[1] != xd[1] / kBlock || wd[2] != block_bytes(base) || yd[0] != xd[0] ||
      (yd[1] + kNB - 1) / kNB != wd[0])
    return ffi::Error::InvalidArgument(
        "rows_matmul_q: want x [M, K], wq [ceil(N / 32), K / 32, block bytes] uint8, y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  if (!run_quantized(pool, x.typed_data(), M, K, wq.typed_data(), P, y->typed_data(), N, fmt))
    return ffi::Error::InvalidArgument("rows_matmul_q: bad format");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnRowsMatmulQ, RowsMatmulQ,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt"));

// The instruction sets this library was compiled for, bit i for pallas_attn.native.BUILT_FEATURES[i]
// (-march=native, or $PALLAS_ATTN_MARCH): the Python side asks which kernels can run.
extern "C" __attribute__((visibility("default"))) int PallasAttnBuiltFeatures() {
  int bits = 0;
#if defined(__AVX2__)
  bits |= 1 << 0;
#endif
#if defined(__FMA__)
  bits |= 1 << 1;
#endif
#if defined(__F16C__)
  bits |= 1 << 2;
#endif
#if defined(__AVX512F__)
  bits |= 1 << 3;
#endif
#if defined(__AVX512BW__)
  bits |= 1 << 4;
#endif
#if defined(__AVX512VNNI__)
  bits |= 1 << 5;
#endif
#if defined(__AVX512BF16__)
  bits |= 1 << 6;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  bits |= 1 << 7;
#endif
  return bits;
}

// ---- Entry points for other kernels (rows_matmul.h; decode_layer.cc owns this block) ----------

namespace pallas_attn {

bool rows_matmul_packed(xla::ffi::ThreadPool& pool, int32_t kind, const float* x, int64_t M,
                        int64_t K, const void* panels, float* y, int64_t N) {
  const int64_t P = (N + kNB - 1) / kNB;
  const auto* wq = static_cast<const uint8_t*>(panels);
  switch (kind) {
    case kWeightF32: run(pool, x, M, K, static_cast<const float*>(panels), P, y, N); return true;
    case kWeightBF16:
    case kWeightBF16Exact:
      run_bf16(pool, x, M, K, static_cast<const uint16_t*>(panels), P, y, N,
               kind == kWeightBF16Exact);
      return true;
    default: return run_quantized(pool, x, M, K, wq, P, y, N, kind);  // fmt [+ kQ8Activations]
  }
}

}  // namespace pallas_attn
