// Dequantization of expert weight blocks (formats: expert_weights.h) into the working form of
// the quantized GEMMs: base_gemm.h's panels (a few hundred KiB at a time, cache resident) and
// quant_gemv.h's reference rows. float32, or bfloat16 (each float32 value rounded to nearest
// even) for the native bf16 GEMMs of the avx512_bf16 path.
//
// One kernel per instruction set (AVX2/F16C; AVX-512, which the avx512_bf16 path runs too, its
// bf16 output through vcvtneps2bf16) beside the reference loop that the portable path runs;
// all give bit-identical results (vcvtneps2bf16 flushes float32 denormals, |q·s| < 2^-126,
// which the others keep), and tests compare them over every byte value of each format.
#pragma once

#include <cstdint>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"

namespace kt {

// dst[r, c] = w[row0 + r, col0 + c] for r < rows, c < cols; dst rows `ld` elements apart.
// w quantized (not kDense). col0 is a multiple of 128 (a whole fp8 block / int4 groups) and
// col0 + cols is a multiple of 128 or w.cols.
void dequantize_block(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t cols, float* dst,
                      int64_t ld, CpuIsa isa);
void dequantize_block(const WeightMatrix& w, int64_t row0, int64_t rows, int64_t col0, int64_t cols, uint16_t* dst,
                      int64_t ld, CpuIsa isa);

// Whole rows: dequantize_block(w, row0, rows, 0, w.cols, dst, ld, isa) in float32.
void dequantize_rows(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld, CpuIsa isa);

// The value of one float8 e4m3fn byte (NaN for 0x7f / 0xff), exactly.
float fp8_e4m3_to_float(uint8_t v);

}  // namespace kt
