// Argument validation shared by the CPU and Meta kernels of kt.moe, so that eager calls,
// fake tensors and torch.compile all reject bad input with the same message.
// Shapes are read as SymInts: the Meta kernels run with symbolic sizes under torch.compile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>

#include <array>

#include "ops/expert_weights.h"

namespace kt {

// The six optional LoRA tensors, in schema order.
struct LoraTensors {
  std::optional<at::Tensor> gate_a, gate_b, up_a, up_b, down_a, down_b;

  bool has_gate() const { return gate_a.has_value(); }
  bool has_up() const { return up_a.has_value(); }
  bool has_down() const { return down_a.has_value(); }
};

// The optional scales of quantized base weights (expert_weights.h), in schema order.
struct BaseScales {
  std::optional<at::Tensor> gate, up, down;
};

// Sizes of one kt.moe call, as SymInts.
struct MoeSizes {
  c10::SymInt tokens;        // T: product of the leading dims of hidden_states
  c10::SymInt hidden;        // H
  c10::SymInt top_k;         // K
  c10::SymInt experts;       // E
  c10::SymInt intermediate;  // I
  std::array<WeightFormat, 3> formats{};  // of gate_proj, up_proj, down_proj
};

// Checks every argument of kt.moe / kt.moe_forward and returns the sizes.
// Throws ValueError (shapes, values), TypeError (dtypes) or RuntimeError (devices), each
// naming the argument and what was expected.
MoeSizes check_moe_inputs(
    const at::Tensor& hidden_states,
    const at::Tensor& topk_ids,
    const at::Tensor& topk_weights,
    const at::Tensor& gate_proj,
    const at::Tensor& up_proj,
    const at::Tensor& down_proj,
    const LoraTensors& lora,
    double lora_scale,
    const BaseScales& scales);

// Checks the extra arguments of kt.moe_backward (grad_output, activations, output_mask).
void check_moe_backward_inputs(
    const MoeSizes& sizes,
    const at::Tensor& grad_output,
    const at::Tensor& hidden_states,
    const at::Tensor& activations,
    const LoraTensors& lora,
    const c10::List<bool>& output_mask);

// output_mask as a fixed array (after check_moe_backward_inputs checked its size).
std::array<bool, 11> output_mask_array(const c10::List<bool>& output_mask);

// swiglu_limit of kt.moe as the SwiGLU kernels take it (kNoSwigluLimit for None); ValueError
// unless it is None or a number > 0.
double checked_swiglu_limit(const std::optional<double>& swiglu_limit);

// Shape of the saved activations: [2, T*K, I], or [2, 0, I] when nothing is saved.
std::vector<c10::SymInt> activation_shape(const MoeSizes& sizes, bool saved);

}  // namespace kt
