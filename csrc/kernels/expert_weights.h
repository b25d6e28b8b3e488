// The base expert weights of kt.moe as the kernels see them: dense (float32 / bfloat16 /
// float64, the dtype of the activations) or quantized, weight-only, in one of three formats.
//
//   format  weight dtype           weight [E, out, in]        scale (float32 or bfloat16)
//   fp8     float8_e4m3fn          [E, out, in]               [E, ceil(out/128), ceil(in/128)]: one per 128x128 block
//   int8    int8                   [E, out, in]               [E, out]: one per output channel (symmetric)
//   int4    uint8, 2 values/byte   [E, out, in/2]             [E, out, in/g]: one per group of g input columns
//
// A value is q * scale, computed in float32: that float32 value *is* the dequantized weight
// (what KTMoE.dequantized_experts() returns and the float64 references multiply by).
// int4: byte j of a row holds columns 2j (low nibble) and 2j+1 (high nibble), each stored as
// q + 8 (q in [-8, 7]): the byte order of compressed-tensors' pack-quantized int32 words.
// The fp8 block is 128x128 (DeepSeek-V3's weight_block_size); g is 32, 64 or 128.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace kt {

enum class WeightFormat : int { kDense = 0, kFp8 = 1, kInt8 = 2, kInt4 = 3 };

constexpr int64_t kFp8Block = 128;

const char* weight_format_name(WeightFormat f);

// The format a weight dtype stores (kDense for the float dtypes).
WeightFormat weight_format_of(at::ScalarType weight_dtype);

// One expert's weight: logically [rows, cols] (out x in).
struct WeightMatrix {
  at::Tensor data;   // dense / fp8 / int8: [rows, cols]; int4: [rows, cols/2] uint8 (contiguous rows)
  at::Tensor scale;  // float32 or bfloat16, contiguous: fp8 [ceil(rows/128), ceil(cols/128)], int8 [rows], int4 [rows, cols/g]
  WeightFormat format = WeightFormat::kDense;
  int64_t rows = 0, cols = 0;
  int64_t group = 0;  // int4: g; fp8: 128

  bool quantized() const { return format != WeightFormat::kDense; }
};

// A projection's weights for all experts: data [E, out, in(/2)] plus its scale.
struct ExpertWeights {
  at::Tensor data;
  at::Tensor scale;  // undefined when dense; float32 or bfloat16, contiguous, otherwise
  WeightFormat format = WeightFormat::kDense;
  int64_t out = 0, in = 0, group = 0;

  bool quantized() const { return format != WeightFormat::kDense; }
  WeightMatrix expert(int64_t e) const;
};

// From the (already checked, see moe_checks.h) weight and optional scale of one projection:
// detached and contiguous. Scales stay in their dtype (read as float by the kernels): int4's
// are 1/g of the weight count, so a float32 copy per call would cost more than the GEMMs.
ExpertWeights expert_weights(const at::Tensor& weight, const std::optional<at::Tensor>& scale);

}  // namespace kt
