// out = addend + d·w for decode-sized d (a few rows): the input gradients of backward's
// decode-sized expert blocks (dh = dy·W_down, dx = dg·W_gate + du·W_up), streaming w's bytes
// once, decoded in registers, instead of converting w panel by panel into float32 for ATen's
// GEMM (which at one row spent 5-7x the time of the forward GEMV over the same weights).
//
// d: float32 or bfloat16 [M, N] (converted to float32 once); w [N, K]: bf16 (dense) or
// quantized (fp8, int8, int4; expert_weights.h); addend: optional [M, K]; out [M, K] in d's
// dtype, accumulated in float32 and rounded once (the numerics of the panel GEMMs).
// Each pass takes a few rows of w (4 for one row of d, 2 for more) and adds their d-weighted
// sum into the float32 accumulator rows; the coefficient of row i is d[m, i] times the scale of the block, group or row the
// columns belong to (fp8 weights decode to value / 2^8 through fp16 bit patterns, the 2^8 goes
// into the coefficient). A row of fp8 holding a NaN code makes the call fall back to the
// reference loop, so NaN propagates exactly as there.
//
// The reference loop (dequantize each row into float32, then add d[m, i] times it) is the
// portable path; every other path runs the AVX2 kernel. Single-threaded: callers run it
// inside their own parallel blocks.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "platform/cpu_isa.h"
#include "kernels/expert_weights.h"

namespace kt {

// The most rows of d that base_gemm.h sends here (moe_forward's decode GEMVs take as many).
constexpr int64_t kThinNnMaxRows = 4;

at::Tensor thin_gemm_nn(const at::Tensor& d, const WeightMatrix& w, const std::optional<at::Tensor>& addend,
                        CpuIsa isa);

}  // namespace kt
