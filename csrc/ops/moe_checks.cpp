#include "ops/moe_checks.h"

#include "kernels/swiglu.h"

#include <cmath>
#include <string>

namespace kt {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kDouble;
}

// Checks one base weight: 3-d, [E, out, in], same dtype/device as hidden_states.
void check_weight(const char* name, const at::Tensor& w, const at::Tensor& hidden_states,
                  const c10::SymInt& experts, const c10::SymInt& out, const c10::SymInt& in,
                  const char* expected) {
  TORCH_CHECK_VALUE(w.dim() == 3, "kt.moe: ", name, " must be 3-d ", expected, ", got shape ",
                    w.sym_sizes());
  TORCH_CHECK_TYPE(w.scalar_type() == hidden_states.scalar_type(), "kt.moe: ", name,
                   " must have the dtype of hidden_states (", hidden_states.scalar_type(), "), got ",
                   w.scalar_type());
  TORCH_CHECK(w.device() == hidden_states.device(), "kt.moe: ", name,
              " must be on the device of hidden_states (", hidden_states.device(), "), got ",
              w.device());
  TORCH_CHECK_VALUE(w.sym_size(0) == experts && w.sym_size(1) == out && w.sym_size(2) == in,
                    "kt.moe: ", name, " must have shape ", expected, " = [", experts, ", ", out,
                    ", ", in, "], got ", w.sym_sizes());
}

// Checks one LoRA pair (A [E, r, in], B [E, out, r]); sets `rank` from the first pair seen.
void check_lora_pair(const char* proj, const std::optional<at::Tensor>& a,
                     const std::optional<at::Tensor>& b, const at::Tensor& hidden_states,
                     const c10::SymInt& experts, const c10::SymInt& out, const c10::SymInt& in,
                     std::optional<c10::SymInt>& rank) {
  TORCH_CHECK_VALUE(a.has_value() == b.has_value(), "kt.moe: ", proj, "_lora_a and ", proj,
                    "_lora_b must be given together, got only ", proj,
                    a.has_value() ? "_lora_a" : "_lora_b");
  if (!a.has_value()) return;
  const std::string a_name = std::string(proj) + "_lora_a";
  const std::string b_name = std::string(proj) + "_lora_b";
  TORCH_CHECK_VALUE(a->dim() == 3, "kt.moe: ", a_name, " must be 3-d [E, r, in], got shape ",
                    a->sym_sizes());
  TORCH_CHECK_VALUE(b->dim() == 3, "kt.moe: ", b_name, " must be 3-d [E, out, r], got shape ",
                    b->sym_sizes());
  if (!rank.has_value()) rank = a->sym_size(1);
  check_weight(a_name.c_str(), *a, hidden_states, experts, *rank, in, "[E, r, in]");
  check_weight(b_name.c_str(), *b, hidden_states, experts, out, *rank, "[E, out, r]");
}

// Checks one base weight: dense ([E, out, in], hidden_states' dtype, no scale) or quantized
// (see expert_weights.h for the layouts); returns its format.
WeightFormat check_base_weight(const char* name, const char* scale_name, const char* global_name, const at::Tensor& w,
                               const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& global_scale,
                               const at::Tensor& hidden_states, const c10::SymInt& experts, const c10::SymInt& out,
                               const c10::SymInt& in, const char* expected) {
  const WeightFormat format = weight_format_of(
      w.scalar_type(), scale.has_value() ? std::optional<at::ScalarType>(scale->scalar_type()) : std::nullopt);
  if (format != WeightFormat::kNvfp4) {
    TORCH_CHECK_VALUE(!global_scale.has_value(), "kt.moe: ", global_name, " was given but ", name, " is ",
                      weight_format_name(format), ": global scales go with nvfp4 weights (uint8 data with a ",
                      "float8_e4m3fn scale)");
  } else {
    TORCH_CHECK_VALUE(global_scale.has_value(), "kt.moe: ", name, " is nvfp4 (uint8 with a float8_e4m3fn ", scale_name,
                      ") so ", global_name, " must be given (float32 [E])");
    TORCH_CHECK_TYPE(global_scale->scalar_type() == at::kFloat, "kt.moe: ", global_name, " must be float32, got ",
                     global_scale->scalar_type());
    TORCH_CHECK_VALUE(global_scale->dim() == 1 && global_scale->sym_size(0) == experts, "kt.moe: ", global_name,
                      " must have shape [E] = [", experts, "], got ", global_scale->sym_sizes());
    TORCH_CHECK(global_scale->device() == hidden_states.device(), "kt.moe: ", global_name,
                " must be on the device of hidden_states (", hidden_states.device(), "), got ", global_scale->device());
  }
  if (format == WeightFormat::kDense) {
    TORCH_CHECK_TYPE(w.scalar_type() == hidden_states.scalar_type(), "kt.moe: ", name,
                     " must have the dtype of hidden_states (", hidden_states.scalar_type(),
                     ") or be quantized (float8_e4m3fn: fp8, int8: int8, uint8: int4 with two values per byte), got ",
                     w.scalar_type());
    TORCH_CHECK_VALUE(!scale.has_value(), "kt.moe: ", scale_name, " was given but ", name, " is ", w.scalar_type(),
                      ": scales go with quantized weights (float8_e4m3fn, int8 or uint8)");
    check_weight(name, w, hidden_states, experts, out, in, expected);
    return format;
  }
  const char* fmt = weight_format_name(format);
  TORCH_CHECK_VALUE(scale.has_value(), "kt.moe: ", name, " is quantized (", fmt, ", ", w.scalar_type(), ") so ",
                    scale_name, " must be given");
  TORCH_CHECK_VALUE(w.dim() == 3, "kt.moe: ", name, " must be 3-d, got shape ", w.sym_sizes());
  TORCH_CHECK(w.device() == hidden_states.device() && scale->device() == hidden_states.device(), "kt.moe: ", name,
              " and ", scale_name, " must be on the device of hidden_states (", hidden_states.device(), "), got ",
              w.device(), " and ", scale->device());
  TORCH_CHECK_TYPE(is_fp4(format) || scale->scalar_type() == at::kFloat || scale->scalar_type() == at::kBFloat16,
                   "kt.moe: ", scale_name, " must be float32 or bfloat16 (or, for uint8 weights, float8_e8m0fnu: ",
                   "mxfp4, float8_e4m3fn: nvfp4), got ", scale->scalar_type());
  const c10::SymInt stored_in = is_nibble_format(format) ? in / 2 : in;
  if (is_nibble_format(format)) {
    TORCH_CHECK_VALUE(in % 2 == 0, "kt.moe: ", name, " is ", fmt, " (two values per byte) so its input size must be even, got ", in);
  }
  TORCH_CHECK_VALUE(w.sym_size(0) == experts && w.sym_size(1) == out && w.sym_size(2) == stored_in, "kt.moe: ", name,
                    " (", fmt, ") must have shape [", experts, ", ", out, ", ", stored_in, "]",
                    format == WeightFormat::kInt4 ? " (two int4 values per byte)"
                    : is_fp4(format)              ? " (two E2M1 values per byte)"
                                                  : "",
                    ", got ", w.sym_sizes());
  const auto& ss = scale->sym_sizes();
  switch (format) {
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4: {
      const int64_t group = format == WeightFormat::kMxfp4 ? 32 : 16;
      TORCH_CHECK_VALUE(in % 32 == 0, "kt.moe: ", name, " is ", fmt, ": its input size must be a multiple of 32, got ", in);
      TORCH_CHECK_VALUE(scale->dim() == 3 && ss[0] == experts && ss[1] == out && ss[2] * group == in, "kt.moe: ",
                        scale_name, " (", fmt, ") must have shape [E, out, in / ", group, "] = [", experts, ", ", out,
                        ", ", in / group, "], got ", ss);
      break;
    }
    case WeightFormat::kFp8: {
      const c10::SymInt ob = (out + (kFp8Block - 1)) / kFp8Block, ib = (in + (kFp8Block - 1)) / kFp8Block;
      TORCH_CHECK_VALUE(scale->dim() == 3 && ss[0] == experts && ss[1] == ob && ss[2] == ib, "kt.moe: ", scale_name,
                        " must have shape [E, ceil(out/128), ceil(in/128)] = [", experts, ", ", ob, ", ", ib,
                        "] (one scale per 128x128 block), got ", ss);
      break;
    }
    case WeightFormat::kInt8:
      TORCH_CHECK_VALUE((scale->dim() == 2 || (scale->dim() == 3 && ss[2] == 1)) && ss[0] == experts && ss[1] == out,
                        "kt.moe: ", scale_name, " must have shape [E, out] = [", experts, ", ", out,
                        "] (one scale per output channel), got ", ss);
      break;
    default: {
      TORCH_CHECK_VALUE(scale->dim() == 3 && ss[0] == experts && ss[1] == out && ss[2] != 0, "kt.moe: ", scale_name,
                        " must have shape [E, out, in / group_size] = [", experts, ", ", out,
                        ", in / group_size] (group_size 32, 64 or 128), got ", ss);
      const c10::SymInt group = in / ss[2];
      TORCH_CHECK_VALUE(group * ss[2] == in && (group == 32 || group == 64 || group == 128), "kt.moe: ", scale_name,
                        " has ", ss[2], " groups per row of ", in, " values: group_size must be 32, 64 or 128");
    }
  }
  return format;
}

// Checks one optional bias: [E, size], the dtype and device of hidden_states.
void check_bias(const char* name, const std::optional<at::Tensor>& bias, const at::Tensor& hidden_states,
                const c10::SymInt& experts, const c10::SymInt& size, const char* expected) {
  if (!bias.has_value()) return;
  TORCH_CHECK_VALUE(bias->dim() == 2 && bias->sym_size(0) == experts && bias->sym_size(1) == size, "kt.moe: ", name,
                    " must have shape ", expected, " = [", experts, ", ", size, "], got ", bias->sym_sizes());
  TORCH_CHECK_TYPE(bias->scalar_type() == hidden_states.scalar_type(), "kt.moe: ", name,
                   " must have the dtype of hidden_states (", hidden_states.scalar_type(), "), got ",
                   bias->scalar_type());
  TORCH_CHECK(bias->device() == hidden_states.device(), "kt.moe: ", name, " must be on the device of hidden_states (",
              hidden_states.device(), "), got ", bias->device());
}

}  // namespace

MoeSizes check_moe_inputs(const MoeArgs& args) {
  const at::Tensor &hidden_states = args.hidden_states, &topk_ids = args.topk_ids, &topk_weights = args.topk_weights;
  const at::Tensor &gate_proj = args.gate_proj, &up_proj = args.up_proj, &down_proj = args.down_proj;
  const LoraTensors& lora = args.lora;
  const double lora_scale = args.lora_scale;
  const BaseScales& scales = args.scales;
  const ExpertBiases& biases = args.biases;
  TORCH_CHECK_VALUE(hidden_states.dim() >= 1, "kt.moe: hidden_states must be [..., H] with at least 1 dim, got a ",
                    hidden_states.dim(), "-d tensor");
  TORCH_CHECK_TYPE(is_supported_float(hidden_states.scalar_type()),
                   "kt.moe: hidden_states must be float32, bfloat16 or float64, got ",
                   hidden_states.scalar_type());
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
                   "kt.moe: topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_TYPE(is_supported_float(topk_weights.scalar_type()),
                   "kt.moe: topk_weights must be float32, bfloat16 or float64, got ",
                   topk_weights.scalar_type());
  TORCH_CHECK(topk_ids.device() == hidden_states.device(),
              "kt.moe: topk_ids must be on the device of hidden_states (", hidden_states.device(),
              "), got ", topk_ids.device());
  TORCH_CHECK(topk_weights.device() == hidden_states.device(),
              "kt.moe: topk_weights must be on the device of hidden_states (", hidden_states.device(),
              "), got ", topk_weights.device());

  const int64_t lead_dims = hidden_states.dim() - 1;
  TORCH_CHECK_VALUE(topk_ids.dim() == hidden_states.dim(),
                    "kt.moe: topk_ids must be [..., K] with the leading dims of hidden_states ",
                    hidden_states.sym_sizes(), ", got shape ", topk_ids.sym_sizes());
  c10::SymInt tokens = 1;
  for (int64_t d = 0; d < lead_dims; ++d) {
    TORCH_CHECK_VALUE(topk_ids.sym_size(d) == hidden_states.sym_size(d),
                      "kt.moe: topk_ids must be [..., K] with the leading dims of hidden_states ",
                      hidden_states.sym_sizes(), ", got shape ", topk_ids.sym_sizes());
    tokens = tokens * hidden_states.sym_size(d);
  }
  TORCH_CHECK_VALUE(topk_weights.sym_sizes() == topk_ids.sym_sizes(),
                    "kt.moe: topk_weights must have the shape of topk_ids ", topk_ids.sym_sizes(),
                    ", got ", topk_weights.sym_sizes());

  MoeSizes sizes{tokens, hidden_states.sym_size(-1), topk_ids.sym_size(-1), 0, 0};
  TORCH_CHECK_VALUE(gate_proj.dim() == 3, "kt.moe: gate_proj must be 3-d [E, I, H], got shape ",
                    gate_proj.sym_sizes());
  sizes.experts = gate_proj.sym_size(0);
  sizes.intermediate = gate_proj.sym_size(1);
  const auto& E = sizes.experts;
  const auto& I = sizes.intermediate;
  const auto& H = sizes.hidden;
  sizes.formats[0] = check_base_weight("gate_proj", "gate_scale", "gate_global_scale", gate_proj, scales.gate,
                                       scales.gate_global, hidden_states, E, I, H, "[E, I, H]");
  sizes.formats[1] = check_base_weight("up_proj", "up_scale", "up_global_scale", up_proj, scales.up, scales.up_global,
                                       hidden_states, E, I, H, "[E, I, H]");
  sizes.formats[2] = check_base_weight("down_proj", "down_scale", "down_global_scale", down_proj, scales.down,
                                       scales.down_global, hidden_states, E, H, I, "[E, H, I]");

  std::optional<c10::SymInt> rank;
  check_lora_pair("gate", lora.gate_a, lora.gate_b, hidden_states, E, I, H, rank);
  check_lora_pair("up", lora.up_a, lora.up_b, hidden_states, E, I, H, rank);
  check_lora_pair("down", lora.down_a, lora.down_b, hidden_states, E, H, I, rank);
  TORCH_CHECK_VALUE(std::isfinite(lora_scale), "kt.moe: lora_scale must be finite, got ", lora_scale);
  check_bias("gate_bias", biases.gate, hidden_states, E, I, "[E, I]");
  check_bias("up_bias", biases.up, hidden_states, E, I, "[E, I]");
  check_bias("down_bias", biases.down, hidden_states, E, H, "[E, H]");
  return sizes;
}

void check_moe_backward_inputs(const MoeSizes& sizes, const at::Tensor& grad_output,
                               const at::Tensor& hidden_states, const at::Tensor& activations,
                               const LoraTensors& lora, const ExpertBiases& biases,
                               const c10::List<bool>& output_mask) {
  TORCH_CHECK_VALUE(output_mask.size() == kNumGrads || output_mask.size() == kNumGradsWithBiases,
                    "kt.moe_backward: output_mask must have 11 entries (14 with the biases' gradients), got ",
                    output_mask.size());
  // Entries 11..13 are the biases: their gradients exist only where the bias does.
  const bool has_bias[3] = {biases.gate.has_value(), biases.up.has_value(), biases.down.has_value()};
  for (int i = 0; i < 3 && output_mask.size() == kNumGradsWithBiases; ++i) {
    TORCH_CHECK_VALUE(!output_mask.get(kNumGrads + i) || has_bias[i], "kt.moe_backward: output_mask[", kNumGrads + i,
                      "] asks for the gradient of a bias that was not given");
  }
  // Entries 5..10 are the LoRA tensors: their gradients exist only where the adapter does.
  const bool has_lora[6] = {lora.has_gate(), lora.has_gate(), lora.has_up(),
                            lora.has_up(),   lora.has_down(), lora.has_down()};
  for (int i = 0; i < 6; ++i) {
    TORCH_CHECK_VALUE(!output_mask.get(5 + i) || has_lora[i], "kt.moe_backward: output_mask[", 5 + i,
                      "] asks for the gradient of a LoRA tensor that was not given");
  }
  const char* base_names[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(!output_mask.get(2 + i) || sizes.formats[i] == WeightFormat::kDense, "kt.moe_backward: output_mask[",
                      2 + i, "] asks for the gradient of ", base_names[i], ", which is quantized (",
                      weight_format_name(sizes.formats[i]), "): quantized base weights are frozen (train LoRA adapters)");
  }
  TORCH_CHECK_VALUE(grad_output.sym_sizes() == hidden_states.sym_sizes(),
                    "kt.moe_backward: grad_output must have the shape of hidden_states ",
                    hidden_states.sym_sizes(), ", got ", grad_output.sym_sizes());
  TORCH_CHECK_TYPE(grad_output.scalar_type() == hidden_states.scalar_type(),
                   "kt.moe_backward: grad_output must have the dtype of hidden_states (",
                   hidden_states.scalar_type(), "), got ", grad_output.scalar_type());
  TORCH_CHECK(grad_output.device() == hidden_states.device(),
              "kt.moe_backward: grad_output must be on the device of hidden_states");
  const auto expected = activation_shape(sizes, /*saved=*/true);
  TORCH_CHECK_VALUE(activations.sym_sizes() == c10::SymIntArrayRef(expected),
                    "kt.moe_backward: activations must have shape [2, T*K, I] = ", expected,
                    " as saved by kt.moe_forward(..., save_activations=True), got ",
                    activations.sym_sizes());
  TORCH_CHECK_TYPE(activations.scalar_type() == hidden_states.scalar_type(),
                   "kt.moe_backward: activations must have the dtype of hidden_states");
}

std::array<bool, kNumGradsWithBiases> output_mask_array(const c10::List<bool>& output_mask) {
  std::array<bool, kNumGradsWithBiases> mask{};
  for (size_t i = 0; i < output_mask.size(); ++i) mask[i] = output_mask.get(i);
  return mask;
}

std::vector<c10::SymInt> activation_shape(const MoeSizes& sizes, bool saved) {
  return {2, saved ? sizes.tokens * sizes.top_k : c10::SymInt(0), sizes.intermediate};
}

Gating checked_gating(const std::optional<double>& swiglu_limit, c10::string_view activation,
                      const std::optional<double>& swiglu_alpha) {
  Gating gating;
  if (swiglu_limit.has_value()) {
    TORCH_CHECK_VALUE(*swiglu_limit > 0, "kt.moe: swiglu_limit must be None or a number > 0 (gate and up are "
                      "clamped at it), got ", *swiglu_limit);
    gating.limit = *swiglu_limit;
  }
  gating.act = parse_gated_activation(std::string(activation));
  if (gating.act == GatedActivation::kSwigluOai) {
    TORCH_CHECK_VALUE(swiglu_alpha.has_value() && std::isfinite(*swiglu_alpha) && *swiglu_alpha > 0,
                      "kt.moe: activation='swigluoai' computes g·σ(α·g)·(u + 1) and needs swiglu_alpha = α, a "
                      "finite number > 0 (gpt-oss: 1.702), got ", swiglu_alpha.has_value() ? std::to_string(*swiglu_alpha) : "None");
    gating.alpha = *swiglu_alpha;
  } else {
    TORCH_CHECK_VALUE(!swiglu_alpha.has_value(), "kt.moe: swiglu_alpha is the α of activation='swigluoai' and must be "
                      "None with activation='", std::string(activation), "', got ", *swiglu_alpha);
  }
  return gating;
}

}  // namespace kt
