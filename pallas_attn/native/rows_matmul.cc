// y[M, N] = x[M, K] @ W[K, N] for few rows M (decode steps, speculative verification) on CPU.
//
// W is packed once as panels wp[P, K, 32] (P = ceil(N / 32); panel p holds columns 32p .. 32p + 31,
// zero-padded), so each panel is one contiguous stream, read once per block of up to 8 rows while
// 2 x 8 vector accumulators stay in registers. XLA:CPU's own product streams [K, N] weights at
// about half this rate for 2 <= M <= 16 (measurements in models/rows_matmul.py). float32 x and y,
// float32 or bfloat16 weights, float32 accumulation. Panels are shared out between the calling
// thread and XLA's intra-op thread pool. An XLA FFI handler: pallas_attn/native.py builds it,
// models/rows_matmul.py is the Python side.
#include <cstdint>
#include <cstring>

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasAttnRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
