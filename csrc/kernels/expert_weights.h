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
//
// The 4-bit float formats keep int4's bytes and nibble order with E2M1 codes (bit 3 the sign,
// magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6):
//   mxfp4   uint8, 2 values/byte   [E, out, in/2]   [E, out, in/32] float8_e8m0fnu: 2^(e - 127)
//   nvfp4   uint8, 2 values/byte   [E, out, in/2]   [E, out, in/16] float8_e4m3fn, times a float32
//                                                   global scale per expert [E]
// A value is e2m1 * (scale * global) in float32. The kernels share int4's: a nibble's value is
// looked up in nibble_values(format) (int4: q - 8; fp4: 2 * e2m1, small integers both) and
// multiplied by the scale as WeightMatrix::scale_table gives it (fp4: half the true scale, so
// the product is exactly e2m1 * scale).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace kt {

enum class WeightFormat : int { kDense = 0, kFp8 = 1, kInt8 = 2, kInt4 = 3, kMxfp4 = 4, kNvfp4 = 5 };

constexpr int64_t kFp8Block = 128;

constexpr bool is_fp4(WeightFormat f) { return f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4; }
// Two 4-bit values per byte: int4, mxfp4, nvfp4.
constexpr bool is_nibble_format(WeightFormat f) { return f == WeightFormat::kInt4 || is_fp4(f); }

// 2 * E2M1 by code: the fp4 formats' nibble_values.
constexpr int8_t kE2m1TwiceValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The 16 values of a nibble format's codes, as the kernels multiply them by the scale:
// int4 q - 8; fp4 2 * e2m1 (the scale halved to match, see WeightMatrix::scale_table).
const int8_t* nibble_values(WeightFormat f);

const char* weight_format_name(WeightFormat f);

// The format a weight dtype stores (kDense for the float dtypes); uint8 weights are int4, or
// mxfp4 / nvfp4 when their scale is float8_e8m0fnu / float8_e4m3fn.
WeightFormat weight_format_of(at::ScalarType weight_dtype, std::optional<at::ScalarType> scale_dtype = std::nullopt);

// One expert's weight: logically [rows, cols] (out x in).
struct WeightMatrix {
  at::Tensor data;   // dense / fp8 / int8: [rows, cols]; int4: [rows, cols/2] uint8 (contiguous rows)
  at::Tensor scale;  // float32 or bfloat16, contiguous: fp8 [ceil(rows/128), ceil(cols/128)], int8 [rows], int4 [rows, cols/g]
  WeightFormat format = WeightFormat::kDense;
  int64_t rows = 0, cols = 0;
  int64_t group = 0;  // int4: g; fp8: 128; mxfp4: 32; nvfp4: 16
  // fp4 only: the scale a kernel multiplies a nibble value by, for each of the 256 scale bytes
  // (the true scale, times the expert's global scale for nvfp4, times 1/2: nibble_values).
  const float* scale_table = nullptr;
  at::Tensor scale_table_owner;  // nvfp4: the expert's table
  float global_scale = 1.f;      // nvfp4: the expert's global scale

  bool quantized() const { return format != WeightFormat::kDense; }
};

// A projection's weights for all experts: data [E, out, in(/2)] plus its scale.
struct ExpertWeights {
  at::Tensor data;
  at::Tensor scale;  // undefined when dense; float32 or bfloat16 (fp4: 1 byte), contiguous, otherwise
  at::Tensor global_scale;  // nvfp4: float32 [E]
  WeightFormat format = WeightFormat::kDense;
  int64_t out = 0, in = 0, group = 0;

  bool quantized() const { return format != WeightFormat::kDense; }
  WeightMatrix expert(int64_t e) const;
};

// From the (already checked, see moe_checks.h) weight and optional scale of one projection:
// detached and contiguous. Scales stay in their dtype (read as float by the kernels): int4's
// are 1/g of the weight count, so a float32 copy per call would cost more than the GEMMs.
ExpertWeights expert_weights(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                             const std::optional<at::Tensor>& global_scale = std::nullopt);

}  // namespace kt
