// out = x·wᵀ for decode-sized blocks (x a few rows) on a quantized expert weight w [R, K]:
// one pass over w's quantized bytes (half of bf16's for fp8 / int8, a quarter for int4),
// decoded in registers and used for every row of x (the reference loop dequantizes a row
// into a float32 buffer instead).
// x: float32 or bfloat16 [M, K] (converted to float32 once; bf16 x on int4 weights, and on fp8
// weights where the CPU has AVX512-VBMI, on the avx512_bf16 path stays bf16 for vdpbf16ps,
// quant_gemv_internal.h); out [M, R] in x's dtype,
// accumulated in float32. The portable path runs the reference loops, every other path the
// AVX2 kernels (AVX-512 ones on the avx512 paths); bf16 x on int4 / int8 weights on the avx2
// path takes integer dot products instead (quant_gemv_int16.cpp). Single-threaded: callers run
// it inside their own parallel blocks.
#pragma once

#include <ATen/ATen.h>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"

namespace kt {

at::Tensor quant_gemv_nt(const at::Tensor& x, const WeightMatrix& w, CpuIsa isa);

// The avx2 path's integer-dot-product kernel for bf16 x on int4 / int8 weights on its own (for
// tests; quant_gemv_nt takes it for bf16 x there): x float32 [M, K] holding bf16 values, out
// float32 [M, R] before any rounding to bf16, and whether the kernel ran (false: it refused x,
// a NaN, an inf or too small a group, and out is undefined).
std::tuple<at::Tensor, bool> quant_gemv_int16_avx2(const at::Tensor& x, const WeightMatrix& w);

// The avx512_bf16 path's VNNI kernel for bf16 x on int4 weights of whole 128-column steps on
// its own (for tests; quant_gemv_nt takes it there where the CPU has AVX512-VNNI): out float32
// [M, R] before any rounding to bf16, and whether it ran (false: it refused x, a NaN, an inf
// or too small a group).
std::tuple<at::Tensor, bool> quant_gemv_int4_vnni(const at::Tensor& x, const WeightMatrix& w);

}  // namespace kt
