// The GEMMs of kt.moe with the expert's base weights (the gate, up and down projections, their
// input gradients and full mode's weight gradients), on whichever path is fast on this CPU.
//
//   float32, float64: ATen's GEMMs (MKL).
//   bfloat16 on the avx512_bf16 path: ATen's bf16 GEMMs (oneDNN's AVX512-BF16 / AMX kernels).
//   bfloat16 on every other path (avx512 without BF16, avx2, portable): oneDNN has no fast bf16
//     GEMM there (ATen's bf16 mm ran 20-21 GFLOP/s on 2 AVX2 Zen 3 cores against 100-160
//     GFLOP/s in fp32, docs/kernels.md), so the bf16 operands are converted to float32 one panel at a time (a panel: a
//     few dozen weight rows, about 512 KiB, cache resident), multiplied by ATen's float32 GEMM
//     with float32 accumulation and rounded to bf16 once at the end: the numerics of oneDNN's
//     bf16 GEMMs, at the float32 FMA rate, with no float32 copy of a whole weight ever made.
//
// The choice follows the active path (cpu_isa.h), so KT_OPS_CPU_ISA=avx2 takes on any CPU
// exactly the route a CPU without AVX-512 takes. Single-threaded when called inside a parallel
// region (the expert blocks' threads), like the ATen GEMMs they wrap.
#pragma once

#include <ATen/ATen.h>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"

namespace kt {

// native_bf16_gemms() (cpu_isa.h): whether bf16 GEMMs on the active path are oneDNN's own.

// How the base GEMMs of `dtype` run on the active path: "mkl" (float32/float64),
// "onednn_bf16" or "bf16_to_fp32_panels". Reported by the benchmarks.
const char* base_gemm_path(at::ScalarType dtype);

// How the panel GEMMs on quantized weights run for activations of `dtype` on the active path:
// "bf16_strips_amx" (bf16 on avx512_bf16 with AMX: amx_gemm.h, for weights whose shapes it
// covers, the others as below), "bf16_panels_onednn" (bf16 on avx512_bf16), "fp32_panels_mkl"
// or "fp64_panels_mkl".
const char* quantized_gemm_path(at::ScalarType dtype);

// x·wᵀ: x [M, K], w [N, K] (rows contiguous) -> [M, N] in x's dtype.
at::Tensor base_mm_nt(const at::Tensor& x, const at::Tensor& w);

// d·w: d [M, N], w [N, K] (rows contiguous) -> [M, K] in d's dtype.
at::Tensor base_mm_nn(const at::Tensor& d, const at::Tensor& w);

// out += d·w, out [M, K] (rows contiguous).
void base_addmm_nn_(at::Tensor& out, const at::Tensor& d, const at::Tensor& w);

// out = aᵀ·b: a [M, N], b [M, K], out [N, K] contiguous (a weight gradient, written not added).
void base_mm_tn_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// The same on an expert's weight in any format (expert_weights.h): dense weights as above,
// quantized ones dequantized panel by panel into float32 (float64 for float64 inputs), the
// float GEMM accumulating in float32 and rounding once, as for bf16 on the panel path; with
// bf16 activations on the avx512_bf16 path into bf16 panels for oneDNN's bf16 GEMMs instead
// (each weight q·s rounded to bf16, as a bf16 expert holds it; float32 accumulation, one
// rounding of each output), laid out as oneDNN's packed weights where that layout is known
// (packed_layout.h).
at::Tensor base_mm_nt(const at::Tensor& x, const WeightMatrix& w);
at::Tensor base_mm_nn(const at::Tensor& d, const WeightMatrix& w);
void base_addmm_nn_(at::Tensor& out, const at::Tensor& d, const WeightMatrix& w);

// d·[a; b] (d [M, a.rows + b.rows], a and b quantized with equal columns) in one GEMM per
// packed panel, as bf16 experts compute dx = [dg | du]·[Wg; Wu] on their packed copies; where
// packed panels are not taken (not bf16 on avx512_bf16, layout unknown), an undefined tensor:
// the caller adds the two products itself. One GEMM of reduction a.rows + b.rows instead of two
// and an addend ran 12% faster ([64, 1536]·[1536, 2048] in 512-column panels, Zen 4).
at::Tensor stacked_mm_nn(const at::Tensor& d, const WeightMatrix& a, const WeightMatrix& b);
// x·wᵀ for decode-sized x (a few rows): thin_gemm_nt on dense weights, quant_gemv_nt on
// quantized ones (their bytes streamed once), the panels for float64.
at::Tensor thin_gemm_nt(const at::Tensor& x, const WeightMatrix& w);

// Whether base_mm_nn / base_addmm_nn_ on w take thin_gemm_nn (thin_gemm_nn.h) for d on the
// active path: decode-sized d on quantized or bf16 weights on the avx2 path.
bool takes_thin_gemm_nn(const at::Tensor& d, const WeightMatrix& w);

// The same GEMMs forcing the bf16-to-float32 panel path whatever the CPU (tests compare it with
// ATen); on quantized weights the panels of the path (bf16 ones for bf16 on avx512_bf16). Any
// floating dtype; the result is rounded to the inputs' dtype.
at::Tensor panel_mm_nt(const at::Tensor& x, const at::Tensor& w);
at::Tensor panel_mm_nn(const at::Tensor& d, const at::Tensor& w, const std::optional<at::Tensor>& addend);
void panel_mm_tn_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
at::Tensor panel_mm_nt(const at::Tensor& x, const WeightMatrix& w);
at::Tensor panel_mm_nn(const at::Tensor& d, const WeightMatrix& w, const std::optional<at::Tensor>& addend);

}  // namespace kt
