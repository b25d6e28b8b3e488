// kt.moe: the public op. It is CompositeImplicitAutograd: it calls kt.moe_forward, asking it
// to save activations only when a gradient will be needed, and returns the output alone.
// Autograd (kt_ops/_autograd.py) is registered on moe_forward, so eager calls, AOTAutograd
// and torch.export all see moe_forward + moe_backward.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace kt {
namespace {

bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); }

at::Tensor moe_composite(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
    const std::optional<at::Tensor>& gate_lora_a, const std::optional<at::Tensor>& gate_lora_b,
    const std::optional<at::Tensor>& up_lora_a, const std::optional<at::Tensor>& up_lora_b,
    const std::optional<at::Tensor>& down_lora_a, const std::optional<at::Tensor>& down_lora_b,
    double lora_scale, const std::optional<at::Tensor>& gate_scale, const std::optional<at::Tensor>& up_scale,
    const std::optional<at::Tensor>& down_scale, std::optional<double> swiglu_limit, c10::string_view activation,
    std::optional<double> swiglu_alpha, const std::optional<at::Tensor>& gate_bias,
    const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias) {
  static auto forward = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("kt::moe_forward", "")
                            .typed<std::tuple<at::Tensor, at::Tensor>(
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, double, bool, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                std::optional<double>, c10::string_view, std::optional<double>,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&)>();
  // Inference (no grad mode, or nothing requires grad) saves nothing.
  const bool save = at::GradMode::is_enabled() &&
                    (hidden_states.requires_grad() || topk_weights.requires_grad() || gate_proj.requires_grad() ||
                     up_proj.requires_grad() || down_proj.requires_grad() || requires_grad(gate_lora_a) ||
                     requires_grad(gate_lora_b) || requires_grad(up_lora_a) || requires_grad(up_lora_b) ||
                     requires_grad(down_lora_a) || requires_grad(down_lora_b) || requires_grad(gate_bias) ||
                     requires_grad(up_bias) || requires_grad(down_bias));
  return std::get<0>(forward.call(hidden_states, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                                  gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b,
                                  lora_scale, save, gate_scale, up_scale, down_scale, swiglu_limit, activation,
                                  swiglu_alpha, gate_bias, up_bias, down_bias));
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CompositeImplicitAutograd, m) { m.impl("moe", &moe_composite); }

}  // namespace kt
