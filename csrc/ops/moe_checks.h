// Argument validation shared by the CPU and Meta kernels of kt.moe, so that eager calls,
// fake tensors and torch.compile all reject bad input with the same message.
// Shapes are read as SymInts: the Meta kernels run with symbolic sizes under torch.compile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <c10/util/Optional.h>

#include <array>

#include "kernels/expert_weights.h"
#include "ops/moe_args.h"
#include "kernels/swiglu.h"

namespace kt {

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
MoeSizes check_moe_inputs(const MoeArgs& args);

// Checks the extra arguments of kt.moe_backward (grad_output, activations, output_mask).
void check_moe_backward_inputs(
    const MoeSizes& sizes,
    const at::Tensor& grad_output,
    const at::Tensor& hidden_states,
    const at::Tensor& activations,
    const LoraTensors& lora,
    const ExpertBiases& biases,
    const c10::List<bool>& output_mask);

// Entries of kt.moe_backward's output_mask (and of its result): hidden_states, topk_weights,
// the 3 base weights, the 6 LoRA tensors, then, optionally (a mask of kNumGradsWithBiases),
// the 3 biases. A mask of kNumGrads entries asks for no bias gradient.
constexpr int kNumGrads = 11;
constexpr int kNumGradsWithBiases = 14;

// output_mask as a fixed array (after check_moe_backward_inputs checked its size); the bias
// entries are false for a mask of kNumGrads entries.
std::array<bool, kNumGradsWithBiases> output_mask_array(const c10::List<bool>& output_mask);

// kt.moe's gating arguments as the SwiGLU kernels take them (swiglu.h). ValueError naming the
// argument unless swiglu_limit is None or a number > 0, activation is one swiglu.h names, and
// swiglu_alpha is a finite number > 0 for activation='swigluoai' and None otherwise.
Gating checked_gating(const std::optional<double>& swiglu_limit, c10::string_view activation,
                      const std::optional<double>& swiglu_alpha);
inline Gating checked_gating(const MoeArgs& args) {
  return checked_gating(args.swiglu_limit, args.activation, args.swiglu_alpha);
}

// Shape of the saved activations: [2, T*K, I], or [2, 0, I] when nothing is saved.
std::vector<c10::SymInt> activation_shape(const MoeSizes& sizes, bool saved);

}  // namespace kt
