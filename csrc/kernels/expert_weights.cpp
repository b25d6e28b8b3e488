#include "kernels/expert_weights.h"

#include <array>
#include <cmath>

#include "kernels/dequantize.h"

namespace kt {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFp8: return "fp8";
    case WeightFormat::kInt8: return "int8";
    case WeightFormat::kInt4: return "int4";
    case WeightFormat::kMxfp4: return "mxfp4";
    case WeightFormat::kNvfp4: return "nvfp4";
    default: return "dense";
  }
}

WeightFormat weight_format_of(at::ScalarType weight_dtype, std::optional<at::ScalarType> scale_dtype) {
  switch (weight_dtype) {
    case at::kFloat8_e4m3fn: return WeightFormat::kFp8;
    case at::kChar: return WeightFormat::kInt8;
    case at::kByte:
      if (scale_dtype == at::kFloat8_e8m0fnu) return WeightFormat::kMxfp4;
      if (scale_dtype == at::kFloat8_e4m3fn) return WeightFormat::kNvfp4;
      return WeightFormat::kInt4;
    default: return WeightFormat::kDense;
  }
}

namespace {

constexpr int8_t kInt4Values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

// mxfp4's table: 2^(e - 127) / 2 for each E8M0 byte e (255 is NaN).
const std::array<float, 256>& mxfp4_scale_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int e = 0; e < 256; ++e) t[e] = e == 255 ? std::nanf("") : std::ldexp(1.0f, e - 127 - 1);
    return t;
  }();
  return table;
}

// The value of every float8 e4m3fn byte, made once: an nvfp4 expert's table is these times its
// global scale, 256 multiplies per expert and call.
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

}  // namespace

const int8_t* nibble_values(WeightFormat f) { return is_fp4(f) ? kE2m1TwiceValues : kInt4Values; }

WeightMatrix ExpertWeights::expert(int64_t e) const {
  WeightMatrix w;
  w.data = data.select(0, e);
  w.format = format;
  w.rows = out;
  w.cols = in;
  w.group = group;
  if (quantized()) w.scale = scale.select(0, e);
  if (format == WeightFormat::kMxfp4) w.scale_table = mxfp4_scale_table().data();
  if (format == WeightFormat::kNvfp4) {
    // (E4M3 scale * global) / 2, computed as the reference does: the product first, in float32.
    const float global = global_scale.const_data_ptr<float>()[e];
    w.global_scale = global;
    w.scale_table_owner = at::empty({256}, at::kFloat);
    float* t = w.scale_table_owner.mutable_data_ptr<float>();
    const std::array<float, 256>& e4m3 = e4m3_values();
    for (int b = 0; b < 256; ++b) t[b] = e4m3[b] * global * 0.5f;
    w.scale_table = t;
  }
  return w;
}

ExpertWeights expert_weights(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                             const std::optional<at::Tensor>& global_scale) {
  ExpertWeights w;
  w.data = weight.detach().contiguous();
  w.format = weight_format_of(weight.scalar_type(),
                              scale.has_value() ? std::optional<at::ScalarType>(scale->scalar_type()) : std::nullopt);
  w.out = weight.size(1);
  w.in = is_nibble_format(w.format) ? 2 * weight.size(2) : weight.size(2);
  if (!w.quantized()) return w;
  w.scale = scale->detach().contiguous();
  if (w.format == WeightFormat::kInt8) w.scale = w.scale.reshape({w.data.size(0), w.out});
  w.group = w.format == WeightFormat::kFp8 ? kFp8Block : is_nibble_format(w.format) ? w.in / w.scale.size(2) : 0;
  if (w.format == WeightFormat::kNvfp4) {
    w.global_scale = global_scale.has_value() ? global_scale->detach().to(at::kFloat).contiguous()
                                              : at::ones({w.data.size(0)}, at::kFloat);
  }
  return w;
}

}  // namespace kt
