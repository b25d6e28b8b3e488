// kt.moe's arguments as one bundle, read by name from a boxed call of any kt.moe* op.
//
// The schemas (registration.cpp) are the contract; every kernel of kt.moe, kt.moe_forward and
// kt.moe_backward (CPU, Meta, the composite) is a boxed kernel that reads the arguments it
// shares with the others through read_moe_args, by the schema's argument names, and its own
// (save_activations, grad_output, activations, output_mask) through MoeCall::arg. Adding an
// argument: the schema, a field here with its line in read_moe_args, and the kernel using it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Optional.h>

#include <string>
#include <string_view>
#include <unordered_map>

namespace kt {

// The six optional LoRA tensors, in schema order.
struct LoraTensors {
  std::optional<at::Tensor> gate_a, gate_b, up_a, up_b, down_a, down_b;

  bool has_gate() const { return gate_a.has_value(); }
  bool has_up() const { return up_a.has_value(); }
  bool has_down() const { return down_a.has_value(); }
};

// The optional scales of quantized base weights (expert_weights.h), in schema order, and
// nvfp4's global scales (float32 [E], one per expert and projection).
struct BaseScales {
  std::optional<at::Tensor> gate, up, down;
  std::optional<at::Tensor> gate_global, up_global, down_global;
};

// The optional per-expert biases (gpt-oss's experts), in schema order: gate [E, I] and up
// [E, I] added to the pre-activations, down [E, H] to each expert's output (before the
// routing weight); in the dtype of hidden_states.
struct ExpertBiases {
  std::optional<at::Tensor> gate, up, down;

  bool any() const { return gate.has_value() || up.has_value() || down.has_value(); }
};

// Every argument kt.moe, kt.moe_forward and kt.moe_backward share (moe_checks.h checks them).
struct MoeArgs {
  at::Tensor hidden_states, topk_ids, topk_weights;
  at::Tensor gate_proj, up_proj, down_proj;
  LoraTensors lora;
  double lora_scale = 1.0;
  BaseScales scales;
  // The gating (swiglu.h; moe_checks.h's checked_gating turns these into a Gating).
  std::optional<double> swiglu_limit;
  std::string activation = "silu";
  std::optional<double> swiglu_alpha;
  ExpertBiases biases;
};

// A boxed call of a kt op: its arguments on the stack, addressed by name.
class MoeCall {
 public:
  MoeCall(const c10::OperatorHandle& op, torch::jit::Stack& stack);

  const c10::IValue& arg(std::string_view name) const;
  at::Tensor tensor(std::string_view name) const { return arg(name).toTensor(); }
  std::optional<at::Tensor> optional_tensor(std::string_view name) const;
  std::optional<double> optional_double(std::string_view name) const;

  // Replaces the arguments on the stack with the kernel's outputs.
  template <class... Outputs>
  void finish(Outputs&&... outputs) {
    torch::jit::drop(stack_, num_args_);
    torch::jit::push(stack_, std::forward<Outputs>(outputs)...);
  }

 private:
  const std::unordered_map<std::string, size_t>& positions_;
  torch::jit::Stack& stack_;
  size_t num_args_;
};

// The shared arguments of `call` (any of the kt.moe* ops' schemas), by name.
inline MoeArgs read_moe_args(const MoeCall& call) {
  MoeArgs a;
  a.hidden_states = call.tensor("hidden_states");
  a.topk_ids = call.tensor("topk_ids");
  a.topk_weights = call.tensor("topk_weights");
  a.gate_proj = call.tensor("gate_proj");
  a.up_proj = call.tensor("up_proj");
  a.down_proj = call.tensor("down_proj");
  a.lora = {call.optional_tensor("gate_lora_a"), call.optional_tensor("gate_lora_b"),
            call.optional_tensor("up_lora_a"),   call.optional_tensor("up_lora_b"),
            call.optional_tensor("down_lora_a"), call.optional_tensor("down_lora_b")};
  a.lora_scale = call.arg("lora_scale").toDouble();
  a.scales = {call.optional_tensor("gate_scale"),        call.optional_tensor("up_scale"),
              call.optional_tensor("down_scale"),        call.optional_tensor("gate_global_scale"),
              call.optional_tensor("up_global_scale"), call.optional_tensor("down_global_scale")};
  a.swiglu_limit = call.optional_double("swiglu_limit");
  a.activation = call.arg("activation").toStringRef();
  a.swiglu_alpha = call.optional_double("swiglu_alpha");
  a.biases = {call.optional_tensor("gate_bias"), call.optional_tensor("up_bias"), call.optional_tensor("down_bias")};
  return a;
}

}  // namespace kt
