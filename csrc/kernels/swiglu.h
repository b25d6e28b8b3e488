// Fused elementwise passes of the SwiGLU expert: one read of each input and one write of
// each output per element, instead of a chain of ATen ops (each a pass over memory plus
// dtype conversions). All row sets are 2-d tensors whose rows are contiguous; float32,
// bfloat16 (computed in float32) or float64. Single-threaded: callers run them inside their
// own parallel blocks.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <string>

#include "platform/cpu_isa.h"

namespace kt {

// The clamp of SwiGLU variants that bound their pre-activations (transformers' swiglu_limit:
// DeepSeek-V4, GLM-5, HY-V4): g <- min(g, limit), u <- clamp(u, -limit, limit) before
// silu(g)·u, as torch.clamp computes them (NaN stays NaN; the gradient is 0 where the clamp
// cut and where the input is NaN). kNoSwigluLimit: no clamp.
constexpr double kNoSwigluLimit = std::numeric_limits<double>::infinity();

// The gate's activation act(g) in h = act(g)·u: SiLU (SwiGLU), the tanh approximation of
// GELU (GeGLU, transformers' gelu_pytorch_tanh: Gemma 4), or gpt-oss's SwiGLU (vLLM's
// "swigluoai": gpt-oss, MiniMax-M3), which scales SiLU's argument by α and shifts up by one:
// h = g·σ(α·g)·(u + 1). All are g·σ(z): z = g for SiLU, z = 2·sqrt(2/π)·(g + 0.044715·g³)
// for GELU-tanh (0.5·(1 + tanh(y)) = σ(2y)), z = α·g for swigluoai.
enum class GatedActivation { kSilu, kGeluTanh, kSwigluOai };

// What the experts compute between the gate|up projections and down (kt.moe's gating
// arguments, checked by moe_checks.h's checked_gating): the clamp, then the activation.
struct Gating {
  double limit = kNoSwigluLimit;  // kNoSwigluLimit: no clamp
  GatedActivation act = GatedActivation::kSilu;
  double alpha = 1.0;  // swigluoai's α; 1 (unused) otherwise

  bool clamps() const { return limit != kNoSwigluLimit; }
};

// "silu" | "gelu_tanh" | "swigluoai"; ValueError naming `activation` otherwise.
GatedActivation parse_gated_activation(const std::string& activation);

// h = silu(g)·u (or the gating's form).   g, u, h: [n, I].
void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, const Gating& gating = {});
void swiglu_forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& h, CpuIsa isa, const Gating& gating = {});

// Backward of o_i = w_i · down(silu(g_i)·u_i) through the SwiGLU, for rows i < n, given
// dh'_i = d(down input) without the routing weight:
//   dg = w·dh'·u·σ(g)(1 + g(1 − σ(g))),  du = w·dh'·silu(g),
//   hw = w·silu(g)·u   (the down projection's input for its weight gradients; optional),
//   dw_i = Σ dh'·silu(g)·u   (the routing weight's gradient; optional).
// With a limit, g and u are the clamped ones and dg, du are zero where the clamp cut. With
// another activation, silu and its derivative above are act(g) = g·σ(z) and
// σ(z) + act(g)(1 − σ(z))·z'; swigluoai's u is u + 1 (after the clamp).
// g, u: [n, I]; dh: [p, I] with p >= n; w: float32/float64 [p] (the accumulation dtype);
// dg, du, hw: [p, I], rows n..p-1 are written with zeros; dw: [n] accumulation dtype.
struct SwigluBackwardOut {
  at::Tensor dg, du;
  at::Tensor hw;  // undefined: not computed
  at::Tensor dw;  // undefined: not computed
};
void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, const Gating& gating = {});
void swiglu_backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh, const at::Tensor& w,
                     SwigluBackwardOut& out, CpuIsa isa, const Gating& gating = {});

}  // namespace kt
