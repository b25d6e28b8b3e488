// Meta kernels (shapes only) of kt.moe_forward and kt.moe_backward.
//
// They serve FakeTensor tracing under torch.compile / torch.export / opcheck and models
// built on device="meta". Sizes are SymInts throughout, so symbolic batch and sequence
// lengths trace without specialising. Validation is shared with the CPU kernels
// (csrc/ops/moe_checks.h): a bad call fails the same way when traced and when run.
#include <torch/library.h>

#include "ops/moe_checks.h"
#include "ops/swiglu.h"

namespace kt {
namespace {

std::tuple<at::Tensor, at::Tensor> moe_forward_meta(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
    const std::optional<at::Tensor>& gate_lora_a, const std::optional<at::Tensor>& gate_lora_b,
    const std::optional<at::Tensor>& up_lora_a, const std::optional<at::Tensor>& up_lora_b,
    const std::optional<at::Tensor>& down_lora_a, const std::optional<at::Tensor>& down_lora_b,
    double lora_scale, bool save_activations, const std::optional<at::Tensor>& gate_scale,
    const std::optional<at::Tensor>& up_scale, const std::optional<at::Tensor>& down_scale,
    std::optional<double> swiglu_limit, c10::string_view activation,
    std::optional<double> swiglu_alpha, const std::optional<at::Tensor>& gate_bias,
    const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias) {
  const MoeSizes sizes = check_moe_inputs(hidden_states, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                                          {gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b},
                                          lora_scale, {gate_scale, up_scale, down_scale},
                                          {gate_bias, up_bias, down_bias});
  checked_gating(swiglu_limit, activation, swiglu_alpha);
  return {at::empty_symint(hidden_states.sym_sizes(), hidden_states.options()),
          at::empty_symint(activation_shape(sizes, save_activations), hidden_states.options())};
}

// An unrequested gradient is an empty [0] tensor in the dtype of hidden_states for every
// weight (as the CPU kernel returns it; a quantized weight never has a gradient).
at::Tensor grad_like(bool needed, const at::Tensor& like, const at::Tensor& hidden_states) {
  return needed ? at::empty_symint(like.sym_sizes(), like.options()) : at::empty({0}, hidden_states.options());
}

at::Tensor grad_like(bool needed, const std::optional<at::Tensor>& like, const at::Tensor& hidden_states) {
  return like.has_value() ? grad_like(needed, *like, hidden_states) : at::empty({0}, hidden_states.options());
}

std::vector<at::Tensor> moe_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, const at::Tensor& activations, const at::Tensor& gate_proj,
    const at::Tensor& up_proj, const at::Tensor& down_proj, const std::optional<at::Tensor>& gate_lora_a,
    const std::optional<at::Tensor>& gate_lora_b, const std::optional<at::Tensor>& up_lora_a,
    const std::optional<at::Tensor>& up_lora_b, const std::optional<at::Tensor>& down_lora_a,
    const std::optional<at::Tensor>& down_lora_b, double lora_scale, const c10::List<bool>& output_mask_list,
    const std::optional<at::Tensor>& gate_scale, const std::optional<at::Tensor>& up_scale,
    const std::optional<at::Tensor>& down_scale, std::optional<double> swiglu_limit, c10::string_view activation,
    std::optional<double> swiglu_alpha, const std::optional<at::Tensor>& gate_bias,
    const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias) {
  const LoraTensors lora{gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b};
  const ExpertBiases biases{gate_bias, up_bias, down_bias};
  checked_gating(swiglu_limit, activation, swiglu_alpha);
  const MoeSizes sizes = check_moe_inputs(hidden_states, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                                          lora, lora_scale, {gate_scale, up_scale, down_scale}, biases);
  check_moe_backward_inputs(sizes, grad_output, hidden_states, activations, lora, biases, output_mask_list);
  const auto m = output_mask_array(output_mask_list);
  std::vector<at::Tensor> grads{grad_like(m[0], hidden_states, hidden_states),
          m[1] ? at::empty_symint(topk_weights.sym_sizes(), topk_weights.options()) : at::empty({0}, topk_weights.options()),
          grad_like(m[2], gate_proj, hidden_states),
          grad_like(m[3], up_proj, hidden_states),
          grad_like(m[4], down_proj, hidden_states),
          grad_like(m[5], gate_lora_a, hidden_states),
          grad_like(m[6], gate_lora_b, hidden_states),
          grad_like(m[7], up_lora_a, hidden_states),
          grad_like(m[8], up_lora_b, hidden_states),
          grad_like(m[9], down_lora_a, hidden_states),
          grad_like(m[10], down_lora_b, hidden_states)};
  if (output_mask_list.size() == kNumGradsWithBiases) {
    for (const auto& [needed, bias] : {std::pair{m[11], &gate_bias}, {m[12], &up_bias}, {m[13], &down_bias}}) {
      grads.push_back(grad_like(needed, *bias, hidden_states));
    }
  }
  return grads;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, Meta, m) {
  m.impl("moe_forward", &moe_forward_meta);
  m.impl("moe_backward", &moe_backward_meta);
}

}  // namespace kt
