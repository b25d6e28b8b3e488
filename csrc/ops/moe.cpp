// kt.moe: the public op. It is CompositeImplicitAutograd: it calls kt.moe_forward with the
// same arguments (by name), asking it to save activations only when a gradient will be
// needed, and returns the output alone. Autograd (kt_ops/_autograd.py) is registered on
// moe_forward, so eager calls, AOTAutograd and torch.export all see moe_forward + moe_backward.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/moe_args.h"

namespace kt {
namespace {

bool requires_grad(const c10::IValue& v) { return v.isTensor() && v.toTensor().requires_grad(); }

void moe_composite(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle forward = c10::Dispatcher::singleton().findSchemaOrThrow("kt::moe_forward", "");
  MoeCall call(op, *stack);
  const auto args = torch::jit::last(*stack, op.schema().arguments().size());
  // Inference (no grad mode, or no tensor argument requires grad) saves nothing.
  const bool save = at::GradMode::is_enabled() && std::any_of(args.begin(), args.end(), requires_grad);
  torch::jit::Stack forward_stack;
  for (const c10::Argument& a : forward.schema().arguments()) {
    if (a.name() == "save_activations") {
      forward_stack.emplace_back(save);
    } else {
      forward_stack.push_back(call.arg(a.name()));  // kt.moe's argument of that name
    }
  }
  forward.callBoxed(forward_stack);
  call.finish(std::move(forward_stack[0]));  // the output; forward_stack[1] holds the activations
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CompositeImplicitAutograd, m) {
  m.impl("moe", torch::CppFunction::makeFromBoxedFunction<&moe_composite>());
}

}  // namespace kt
