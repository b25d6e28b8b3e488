// out = x·wᵀ with a thin output: x [M, K], w [R, K] (R = the LoRA rank, a handful), out
// [M, R]. This is x·Aᵀ (LoRA's first GEMM) and d_out·B. oneDNN spends ~60 µs on such a
// call ([64, 2048]·[2048, 8] in bf16); here each output is a dot product of two contiguous
// rows, which AVX512-BF16's vdpbf16ps computes on bf16 pairs as they lie in memory.
// The same kernel is forward's GEMV for decode-sized blocks (M a few rows, w a whole expert
// weight, R in the thousands): it walks w once, 8 rows at a time, for all rows of x.
//
// x, w: float32 or bfloat16, rows contiguous (stride(1) == 1), any row stride; out: float32 or
// bfloat16 [M, R], rows contiguous. Accumulates in float32. float64 goes through ATen.
// Single-threaded: callers run it inside their own parallel blocks.
#pragma once

#include <ATen/ATen.h>

#include "platform/cpu_isa.h"

namespace kt {

void thin_gemm_nt(at::Tensor& out, const at::Tensor& x, const at::Tensor& w);
void thin_gemm_nt(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, CpuIsa isa);

// Allocating form: returns x·wᵀ [M, R] in x's dtype.
at::Tensor thin_gemm_nt(const at::Tensor& x, const at::Tensor& w);

}  // namespace kt
