// Row blocks converted between bfloat16 and float32, for the float32 panels of base_gemm.h:
// dst[r, c] = src[r, c] for r < rows, c < cols, rows `ld` elements apart. bf16 -> float is
// exact; float -> bf16 rounds to nearest even (NaN stays NaN). One kernel per instruction set
// plus the reference loop (what the portable path runs; tests compare them).
#pragma once

#include <cstdint>

#include "platform/cpu_isa.h"

namespace kt {

void bf16_rows_to_float(const uint16_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows,
                        int64_t cols, CpuIsa isa);

void float_rows_to_bf16(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int64_t rows,
                        int64_t cols, CpuIsa isa);

}  // namespace kt
