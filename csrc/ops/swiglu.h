// Fused elementwise passes of the SwiGLU expert: one read of each input and one write of
// each output per element, instead of a chain of ATen ops (each a pass over memory plus
// dtype conversions). All row sets are 2-d tensors whose rows are contiguous; float32,
// bfloat16 (computed in float32) or float64. Single-threaded: callers run them inside their
// own parallel blocks.
#pragma once

#include <ATen/ATen.h>

#include "ops/cpu_isa.h"

namespace kt {

// h = silu(g)·u.   g, u, h: [n, I].
void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h);
void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, CpuIsa isa);

// Backward of o_i = w_i · down(silu(g_i)·u_i) through the SwiGLU, for rows i < n, given
// dh'_i = d(down input) without the routing weight:
//   dg = w·dh'·u·σ(g)(1 + g(1 − σ(g))),  du = w·dh'·silu(g),
//   hw = w·silu(g)·u   (the down projection's input for its weight gradients; optional),
//   dw_i = Σ dh'·silu(g)·u   (the routing weight's gradient; optional).
// g, u: [n, I]; dh: [p, I] with p >= n; w: float32/float64 [p] (the accumulation dtype);
// dg, du, hw: [p, I], rows n..p-1 are written with zeros; dw: [n] accumulation dtype.
struct SwigluBackwardOut {
  at::Tensor dg, du;
  at::Tensor hw;  // undefined: not computed
  at::Tensor dw;  // undefined: not computed
};
void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out);
void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, CpuIsa isa);

}  // namespace kt
