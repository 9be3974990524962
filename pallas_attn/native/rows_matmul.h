// Entry points into rows_matmul.cc for other native kernels (decode_layer.cc): the few-row
// product over the panels that models/rows_matmul.py packs, without an FFI call per product.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace pallas_attn {

// How a weight matrix is stored and multiplied: float32 panels [P, K, 32] are kWeightF32,
// bfloat16 pair panels [P, K2, 32] (rows_matmul.cc) kWeightBF16 (vdpbf16ps dot products where the
// CPU has them) or kWeightBF16Exact (float32 products); any other kind is the `fmt` attribute of
// pallas_attn_rows_matmul_q (models/rows_matmul.py's FORMATS index, plus its 8-bit-activations
// flag). models/rows_matmul.py kernel_format() gives these numbers.
enum WeightKind : int32_t { kWeightF32 = 3, kWeightBF16 = 4, kWeightBF16Exact = 5 };

// y [M, N] = x [M, K] @ W, float32 x and y, W the panels of `kind` (ceil(N / 32) of them; K a
// multiple of 32 for the quantized kinds). The same arithmetic and threading as the FFI
// handlers: panels shared between the calling thread and `pool`. False for an unknown kind.
bool rows_matmul_packed(xla::ffi::ThreadPool& pool, int32_t kind, const float* x, int64_t M,
                        int64_t K, const void* panels, float* y, int64_t N);

}  // namespace pallas_attn
