// Dequantization of expert weight rows (formats: expert_weights.h) into float32, the working
// form of the quantized GEMMs: base_gemm.h's panels (a few dozen rows at a time, cache
// resident) and quant_gemv.h's decode rows. The reference loop (what the portable path runs)
// and an AVX2/F16C kernel (the avx2 and AVX-512 paths) give bit-identical results; tests
// compare them over every byte value of each format.
#pragma once

#include <cstdint>

#include "ops/cpu_isa.h"
#include "ops/expert_weights.h"

namespace kt {

// dst[r, c] = w[row0 + r, c] in float32 for r < rows, c < w.cols; dst rows `ld` floats apart.
// w quantized (not kDense).
void dequantize_rows(const WeightMatrix& w, int64_t row0, int64_t rows, float* dst, int64_t ld, CpuIsa isa);

// The value of one float8 e4m3fn byte (NaN for 0x7f / 0xff), exactly.
float fp8_e4m3_to_float(uint8_t v);

}  // namespace kt
