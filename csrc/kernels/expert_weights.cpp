#include "kernels/expert_weights.h"

namespace kt {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFp8: return "fp8";
    case WeightFormat::kInt8: return "int8";
    case WeightFormat::kInt4: return "int4";
    default: return "dense";
  }
}

WeightFormat weight_format_of(at::ScalarType weight_dtype) {
  switch (weight_dtype) {
    case at::kFloat8_e4m3fn: return WeightFormat::kFp8;
    case at::kChar: return WeightFormat::kInt8;
    case at::kByte: return WeightFormat::kInt4;
    default: return WeightFormat::kDense;
  }
}

WeightMatrix ExpertWeights::expert(int64_t e) const {
  WeightMatrix w;
  w.data = data.select(0, e);
  w.format = format;
  w.rows = out;
  w.cols = in;
  w.group = group;
  if (quantized()) w.scale = scale.select(0, e);
  return w;
}

ExpertWeights expert_weights(const at::Tensor& weight, const std::optional<at::Tensor>& scale) {
  ExpertWeights w;
  w.data = weight.detach().contiguous();
  w.format = weight_format_of(weight.scalar_type());
  w.out = weight.size(1);
  w.in = w.format == WeightFormat::kInt4 ? 2 * weight.size(2) : weight.size(2);
  if (!w.quantized()) return w;
  w.scale = scale->detach().contiguous();
  if (w.format == WeightFormat::kInt8) w.scale = w.scale.reshape({w.data.size(0), w.out});
  w.group = w.format == WeightFormat::kFp8 ? kFp8Block : w.format == WeightFormat::kInt4 ? w.in / w.scale.size(2) : 0;
  return w;
}

}  // namespace kt
