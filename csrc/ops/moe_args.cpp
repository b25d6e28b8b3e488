#include "ops/moe_args.h"

#include <mutex>

namespace kt {
namespace {

// Argument positions by name, built once per schema (a handful of kt ops).
const std::unordered_map<std::string, size_t>& positions_of(const c10::FunctionSchema& schema) {
  static std::mutex mutex;
  static std::unordered_map<const c10::FunctionSchema*, std::unordered_map<std::string, size_t>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = cache.try_emplace(&schema);
  if (inserted) {
    for (size_t i = 0; i < schema.arguments().size(); ++i) it->second.emplace(schema.arguments()[i].name(), i);
  }
  return it->second;
}

}  // namespace

MoeCall::MoeCall(const c10::OperatorHandle& op, torch::jit::Stack& stack)
    : positions_(positions_of(op.schema())), stack_(stack), num_args_(op.schema().arguments().size()) {}

const c10::IValue& MoeCall::arg(std::string_view name) const {
  const auto it = positions_.find(std::string(name));
  TORCH_INTERNAL_ASSERT(it != positions_.end(), "kt: no argument ", name, " in this op's schema");
  return stack_[stack_.size() - num_args_ + it->second];
}

std::optional<at::Tensor> MoeCall::optional_tensor(std::string_view name) const {
  return arg(name).toOptional<at::Tensor>();
}

std::optional<double> MoeCall::optional_double(std::string_view name) const {
  const c10::IValue& v = arg(name);
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

}  // namespace kt
