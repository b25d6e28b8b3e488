// Dequantization of quantized expert weights straight into oneDNN's packed bf16 layout
// (packed_bf16_layout.h; the layout of a shape is probed in gemm/packed_layout.h): the panels of the quantized GEMMs on the avx512_bf16 path, which oneDNN
// then multiplies without re-packing them. Each value is q·s in float32 rounded to bf16 (the
// values dequantize_block writes as bf16); the AVX512-BF16 kernels tile 16 rows by 32 columns
// (x·wᵀ panels: a 16x16 transpose of column pairs) or 16 columns by a pair of rows (d·w
// panels: one interleave), and the reference loop (any other isa) goes through
// dequantize_block's reference one row at a time. They give identical bits; tests compare them.
#pragma once

#include <cstdint>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"
#include "kernels/packed_bf16_layout.h"

namespace kt {

// Rows [n0, n0 + layout.out) of w, all its columns (layout.in == w.cols), as the linear
// weight [layout.out, w.cols]: the operand of x·wᵀ.
void dequantize_packed_rows(const WeightMatrix& w, int64_t n0, const PackedBf16Layout& layout, uint16_t* dst,
                            CpuIsa isa);

// Columns [k0, k0 + layout.out) of w, all its rows, transposed: the linear weight
// [layout.out, layout.in], the operand of d·w, w's rows as its input columns [in0, in0 +
// w.rows) (in0 = 0, layout.in = w.rows for w alone; in0 > 0 for a second weight stacked below
// a first, d·[a; b] in one GEMM). k0 is a multiple of 128, or of 32 for a strip of 32
// columns (within one fp8 block and int4 group); in0 and w.rows are even.
void dequantize_packed_cols(const WeightMatrix& w, int64_t k0, const PackedBf16Layout& layout, uint16_t* dst,
                            CpuIsa isa, int64_t in0 = 0);

}  // namespace kt
