// out = c + alpha·a·b for the thin GEMMs of LoRA (one side of size r, or a short inner
// dimension), where ATen's bf16 GEMMs spend more time in setup than in arithmetic: a rank-8
// update of an [80, 2048] bf16 block took ~150 µs through addmm_ and takes a few µs here.
//
//   a   [M, Kd]  float32 or bfloat16, any strides
//   b   [Kd, N]  float32 or bfloat16, rows contiguous (stride(1) == 1)
//   c   [M, N]   optional addend, float32 or bfloat16, rows contiguous; may alias out
//   out [M, N]   float32 or bfloat16, rows contiguous
// Accumulates in float32. Single-threaded: callers run it inside their own parallel blocks.
// float64 (and any other dtype mix) goes through ATen, so every caller may use it.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "platform/cpu_isa.h"

namespace kt {

void small_gemm(at::Tensor& out, const std::optional<at::Tensor>& c, const at::Tensor& a, const at::Tensor& b,
                double alpha);

// Same, forcing a path (tests compare every path with the reference loop).
void small_gemm(at::Tensor& out, const std::optional<at::Tensor>& c, const at::Tensor& a, const at::Tensor& b,
                double alpha, CpuIsa isa);

}  // namespace kt
