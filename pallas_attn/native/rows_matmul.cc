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
// PallasAttnRowsMatmulQ is the same product over GGUF-style block-quantized weights (Q8_0, Q4_0,
// Q4_1: blocks of 32 weights along K with a float16 scale, and a float16 minimum for Q4_1; see
// models/quant.py), panels wq[P, K / 32, bytes per block] in uint8. Each weight is dequantized in
// registers to exactly the float32 value gguf.quants gives it and accumulated in the same order
// as the float kernel, so the result equals rows_matmul on the dequantized float32 weights bit
// for bit, while the stream read per weight is 8.5 (Q8_0), 4.5 (Q4_0) or 5 (Q4_1) bits.
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "rows.h"
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

inline vf load(const uint16_t* p) {  // bfloat16 is the high half of a float32
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// Keeps the panel row in registers: left alone, GCC folds its load into every row's FMA as a
// memory operand (panel<4>: 8 loads per k instead of 2, and M = 4 ran slower than M = 5).
inline void in_registers(vf& a, vf& b) {
#if defined(__x86_64__)
  asm("" : "+v"(a), "+v"(b));
#endif
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
  for (int m = 0; m < MB; ++m) {
    float out[kNB];
    std::memcpy(out, &acc[m][0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[m][1], sizeof(vf));
    std::memcpy(y + m * ldy, out, cols * sizeof(float));
  }
}

// Panels [p0, p1) for all M rows.
template <typename W>
void panels(const float* x, int64_t M, int64_t K, const W* wp, float* y, int64_t N, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
    const W* w = wp + p * K * kNB;
    for (int64_t m0 = 0; m0 < M; m0 += kMB) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N + n0;
      pallas_attn::with_rows(M - m0, [&](auto MB) { panel<MB>(xm, K, w, ym, N, cols); });
    }
  }
}

// One thread below these weight bytes: waking another costs more than it saves (a product of a
// cache-resident 64 KB matrix is a few microseconds). A single row is no exception: inside a
// decode step (code-target, M = 1) matrices of 256 KB - 1 MB on one thread made the whole forward
// 1.5x slower (0.61 vs 0.41 ms) than sharing them, although alone, back to back, they ran at the
// same speed either way.
constexpr int64_t kParallelBytes = 1 << 18;

template <typename W>
ffi::Error run(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const W* wp, int64_t P,
               float* y, int64_t N) {
  const int64_t bytes = P * K * kNB * int64_t(sizeof(W));
  const bool parallel = bytes >= kParallelBytes;
  pallas_attn::parallel_for(pool, P, parallel, [&](int64_t p0, int64_t p1) {
    panels(x, M, K, wp, y, N, p0, p1);
  });
  return ffi::Error::Success();
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wp,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNB || wd[1] != xd[1] ||
      yd[0] != xd[0] || (yd[1] + kNB - 1) / kNB != wd[0])
    return ffi::Error::InvalidArgument(
        "rows_matmul: want x [M, K], wp [ceil(N / 32), K, 32], y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  switch (wp.element_type()) {
    case ffi::DataType::F32:
      return run(pool, x.typed_data(), M, K, static_cast<const float*>(wp.untyped_data()), P,
                 y->typed_data(), N);
    case ffi::DataType::BF16:
      return run(pool, x.typed_data(), M, K, static_cast<const uint16_t*>(wp.untyped_data()), P,
                 y->typed_data(), N);
    default:
      return ffi::Error::InvalidArgument("rows_matmul: weights must be float32 or bfloat16");
  }
}

// ---- Block-quantized weights -------------------------------------------------------------------

constexpr int kBlock = 32;  // weights per quantization block along K (GGUF's QK8_0 / QK4_0 / QK4_1)
enum Format : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };  // models/quant.py FORMATS order

// Bytes of one (panel, block): 32 float16 scales, [32 float16 minimums,] then the quants: Q8_0
// [32 k][32 columns] int8; Q4 [16 j][32 columns] uint8 with weight k = j in the low nibble and
// k = j + 16 in the high one (GGUF's order within a block).
constexpr int64_t block_bytes(int32_t fmt) {
  return fmt == kQ8_0 ? 2 * kNB + kBlock * kNB : fmt == kQ4_0 ? 2 * kNB + 16 * kNB
                                                             : 4 * kNB + 16 * kNB;
}

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

inline vf load_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

template <bool kHigh>
inline vf load_nibble(const uint8_t* p) {  // 0 .. 15 as float32
#if defined(__AVX512F__)
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = kHigh ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
  return (vf)_mm512_cvtepi32_ps(v);
#else
  vub b;
  std::memcpy(&b, p, sizeof(b));
  vi v = __builtin_convertvector(b, vi);
  v = kHigh ? v >> 4 : v & 15;
  return __builtin_convertvector(v, vf);
#endif
}

// Rows [0, MB) of x times one quantized panel -> y[:, 0:cols]. Each weight becomes
// d * q (Q8_0), d * q - 8 d (Q4_0: d * (q - 8), exact since both terms are) or d * q + m (Q4_1,
// one rounding as gguf.quants' (d * q) + m, d * q being exact), then the float kernel's FMA in
// the order k = 0, 1, ...: the same sums as panel() over the dequantized weights.
template <int MB, int32_t FMT>
void qpanel(const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = block_bytes(FMT);
  constexpr int64_t qoff = FMT == kQ4_1 ? 4 * kNB : 2 * kNB;
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
    const uint8_t* q = blk + qoff;
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
    if (FMT == kQ8_0) {
      for (int64_t k = 0; k < kBlock; ++k)
        step(k, load_i8(q + k * kNB), load_i8(q + k * kNB + kLanes));
    } else {  // low nibbles are k = 0 .. 15, high ones k = 16 .. 31: two passes keep k's order
      for (int64_t j = 0; j < 16; ++j)
        step(j, load_nibble<false>(q + j * kNB), load_nibble<false>(q + j * kNB + kLanes));
      for (int64_t j = 0; j < 16; ++j)
        step(16 + j, load_nibble<true>(q + j * kNB), load_nibble<true>(q + j * kNB + kLanes));
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[kNB];
    std::memcpy(out, &acc[m][0], sizeof(vf));
    std::memcpy(out + kLanes, &acc[m][1], sizeof(vf));
    std::memcpy(y + m * ldy, out, cols * sizeof(float));
  }
}

template <int32_t FMT>
ffi::Error run_q(ffi::ThreadPool pool, const float* x, int64_t M, int64_t K, const uint8_t* wq,
                 int64_t P, float* y, int64_t N) {
  const int64_t panel_bytes = (K / kBlock) * block_bytes(FMT);
  pallas_attn::parallel_for(pool, P, P * panel_bytes >= kParallelBytes, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNB, cols = N - n0 < kNB ? N - n0 : kNB;
      for (int64_t m0 = 0; m0 < M; m0 += kMB)
        pallas_attn::with_rows(M - m0, [&](auto MB) {
          qpanel<MB, FMT>(x + m0 * K, K, wq + p * panel_bytes, y + m0 * N + n0, N, cols);
        });
    }
  });
  return ffi::Error::Success();
}

ffi::Error RowsMatmulQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                       ffi::ResultBuffer<ffi::F32> y, int32_t fmt) {
  const auto xd = x.dimensions(), wd = wq.dimensions(), yd = y->dimensions();
  if (fmt < kQ8_0 || fmt > kQ4_1) return ffi::Error::InvalidArgument("rows_matmul_q: bad format");
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] % kBlock != 0 ||
      wd[1] != xd[1] / kBlock || wd[2] != block_bytes(fmt) || yd[0] != xd[0] ||
      (yd[1] + kNB - 1) / kNB != wd[0])
    return ffi::Error::InvalidArgument(
        "rows_matmul_q: want x [M, K], wq [ceil(N / 32), K / 32, block bytes] uint8, y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  const float* xp = x.typed_data();
  const uint8_t* wp = wq.typed_data();
  float* yp = y->typed_data();
  switch (fmt) {
    case kQ8_0: return run_q<kQ8_0>(pool, xp, M, K, wp, P, yp, N);
    case kQ4_0: return run_q<kQ4_0>(pool, xp, M, K, wp, P, yp, N);
    default: return run_q<kQ4_1>(pool, xp, M, K, wp, P, yp, N);
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnRowsMatmulQ, RowsMatmulQ,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt"));

// ---- Entry points for other kernels (rows_matmul.h; decode_layer.cc owns this block) ----------

#include "rows_matmul.h"

namespace pallas_attn {

bool rows_matmul_packed(xla::ffi::ThreadPool& pool, int32_t kind, const float* x, int64_t M,
                        int64_t K, const void* panels, float* y, int64_t N) {
  const int64_t P = (N + kNB - 1) / kNB;
  const auto* wq = static_cast<const uint8_t*>(panels);
  switch (kind) {
    case kWeightF32: run(pool, x, M, K, static_cast<const float*>(panels), P, y, N); return true;
    case kWeightBF16:
      run(pool, x, M, K, static_cast<const uint16_t*>(panels), P, y, N);
      return true;
    case kWeightQ8_0: run_q<kQ8_0>(pool, x, M, K, wq, P, y, N); return true;
    case kWeightQ4_0: run_q<kQ4_0>(pool, x, M, K, wq, P, y, N); return true;
    case kWeightQ4_1: run_q<kQ4_1>(pool, x, M, K, wq, P, y, N); return true;
    default: return false;
  }
}

}  // namespace pallas_attn
