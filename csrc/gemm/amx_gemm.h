// GEMMs of bf16 activations with quantized expert weights on Intel AMX (AMX-BF16 tiles), for
// the avx512_bf16 path on CPUs that have it (Sapphire Rapids and later Xeons).
//
// Why: with weights quantized, each GEMM of an expert dequantizes its weights into bf16 panels
// (dequantize_packed.h) and multiplies them. oneDNN's bf16 GEMM on those L2-resident panels ran
// at 640-800 GFLOP/s for 64 x rows on one core of the Intel Xeon with AMX here (TDPBF16PS's
// peak there: 3.0 TFLOP/s, measured), so the multiply took longer than the dequantization
// (~600 against ~520 us for a [64, 2048]·[2048, 1536] fp8 GEMM). Here the weights are
// dequantized by the same kernels into strips of 32 outputs, as 16-output blocks whose 1 KiB
// tiles (16 input-column pairs x 16 outputs) the AMX loads as they lie, and x is copied once
// per call into 16-row tiles; the multiply is a loop of tile loads and TDPBF16PS on 32 x rows
// at a time, the strip staying in L1/L2. x·wᵀ dequantizes one strip (32 whole weight rows) at a
// time; d·w 128 weight columns of all rows (4 strips; its kernel walks the rows, and 32-column
// segments paid each row's setup four times as often: d·w ran slower than oneDNN's that way).
// One thread, M = 64, [1536, 2048] weights from memory, per weight, oneDNN panels -> AMX
// strips: x·wᵀ 1.5-1.7 -> 0.9-1.1 ms, d·w 1.4-1.6 -> 0.9-1.1 ms (every format); kt.moe's LoRA
// step at T=1024 on Qwen3-30B-A3B (2 threads) 1.25-1.34x faster.
//
// Numerics: the products of bf16 values are exact, the sums float32, and each output rounded
// once to bf16, as oneDNN's bf16 GEMMs do (the order of the float32 sums differs).
//
// Availability: the CPU's AMX-TILE and AMX-BF16 flags, the OS's tile state (XCR0) and Linux's
// permission for it (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process). Off with
// KT_OPS_AMX=0, with a cap on oneDNN that leaves AMX out (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
// and below, as when emulating a CPU without AMX), or kt::set_amx_enabled(false) (tests compare
// both routes on one machine); only ever taken on the avx512_bf16 path, so KT_OPS_CPU_ISA=avx512
// / avx2 / portable leave it out as a CPU without AMX would.
#pragma once

#include <ATen/ATen.h>

#include "kernels/expert_weights.h"

namespace kt {

// True when this CPU and OS run AMX-BF16 and it is enabled.
bool amx_bf16_available();
bool amx_bf16_supported();  // the CPU and OS, whatever the switch says
void set_amx_enabled(bool enabled);

// True when the AMX GEMMs below take x·wᵀ on w (bf16 activations, quantized w, the shapes the
// tiles cover: w.rows a multiple of 32, w.cols of 32) on the active path.
bool amx_takes_mm_nt(const at::Tensor& x, const WeightMatrix& w);
// The same for d·[w0; w1; ...] (each weight's rows a multiple of 32, their columns of 128).
bool amx_takes_mm_nn(const at::Tensor& d, std::initializer_list<const WeightMatrix*> stacked);

// x·wᵀ: x [M, K] bf16, w [N, K] quantized -> [M, N] bf16.
at::Tensor amx_mm_nt(const at::Tensor& x, const WeightMatrix& w);

// addend + d·[w0; w1; ...]: d [M, Σ rows] bf16, the weights' rows stacked as d's columns,
// equal column counts K -> [M, K] bf16; the addend (any float dtype, [M, K]) added in float32
// before the one rounding.
at::Tensor amx_mm_nn(const at::Tensor& d, std::initializer_list<const WeightMatrix*> stacked,
                     const std::optional<at::Tensor>& addend);

}  // namespace kt
