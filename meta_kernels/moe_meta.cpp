// Meta kernels (shapes only) of kt.moe_forward and kt.moe_backward.
//
// They serve FakeTensor tracing under torch.compile / torch.export / opcheck and models
// built on device="meta". Sizes are SymInts throughout, so symbolic batch and sequence
// lengths trace without specialising. Validation is shared with the CPU kernels
// (csrc/ops/moe_checks.h): a bad call fails the same way when traced and when run.
#include <torch/library.h>

#include "ops/moe_args.h"
#include "ops/moe_checks.h"
#include "kernels/swiglu.h"

namespace kt {
namespace {

void moe_forward_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  MoeCall call(op, *stack);
  const MoeArgs args = read_moe_args(call);
  const MoeSizes sizes = check_moe_inputs(args);
  checked_gating(args);
  const auto& options = args.hidden_states.options();
  call.finish(at::empty_symint(args.hidden_states.sym_sizes(), options),
              at::empty_symint(activation_shape(sizes, call.arg("save_activations").toBool()), options));
}

// An unrequested gradient is an empty [0] tensor in the dtype of hidden_states for every
// weight (as the CPU kernel returns it; a quantized weight never has a gradient).
at::Tensor grad_like(bool needed, const at::Tensor& like, const at::Tensor& hidden_states) {
  return needed ? at::empty_symint(like.sym_sizes(), like.options()) : at::empty({0}, hidden_states.options());
}

at::Tensor grad_like(bool needed, const std::optional<at::Tensor>& like, const at::Tensor& hidden_states) {
  return like.has_value() ? grad_like(needed, *like, hidden_states) : at::empty({0}, hidden_states.options());
}

void moe_backward_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  MoeCall call(op, *stack);
  const MoeArgs args = read_moe_args(call);
  const at::Tensor& hidden_states = args.hidden_states;
  const c10::List<bool> output_mask_list = call.arg("output_mask").toBoolList();
  checked_gating(args);
  const MoeSizes sizes = check_moe_inputs(args);
  check_moe_backward_inputs(sizes, call.tensor("grad_output"), hidden_states, call.tensor("activations"), args.lora,
                            args.biases, output_mask_list);
  const auto m = output_mask_array(output_mask_list);
  const LoraTensors& lora = args.lora;
  std::vector<at::Tensor> grads{
      grad_like(m[0], hidden_states, hidden_states),
      m[1] ? at::empty_symint(args.topk_weights.sym_sizes(), args.topk_weights.options())
           : at::empty({0}, args.topk_weights.options()),
      grad_like(m[2], args.gate_proj, hidden_states),
      grad_like(m[3], args.up_proj, hidden_states),
      grad_like(m[4], args.down_proj, hidden_states),
      grad_like(m[5], lora.gate_a, hidden_states),
      grad_like(m[6], lora.gate_b, hidden_states),
      grad_like(m[7], lora.up_a, hidden_states),
      grad_like(m[8], lora.up_b, hidden_states),
      grad_like(m[9], lora.down_a, hidden_states),
      grad_like(m[10], lora.down_b, hidden_states)};
  if (output_mask_list.size() == kNumGradsWithBiases) {
    for (const auto& [needed, bias] : {std::pair{m[11], &args.biases.gate}, {m[12], &args.biases.up},
                                       {m[13], &args.biases.down}}) {
      grads.push_back(grad_like(needed, *bias, hidden_states));
    }
  }
  call.finish(std::move(grads));
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, Meta, m) {
  m.impl("moe_forward", torch::CppFunction::makeFromBoxedFunction<&moe_forward_meta>());
  m.impl("moe_backward", torch::CppFunction::makeFromBoxedFunction<&moe_backward_meta>());
}

}  // namespace kt
