// oneDNN's packed layout of bf16 linear weights, as a value: the target the quantized GEMMs'
// panels are dequantized into (dequantize_packed.h). Which layout oneDNN uses for a shape is
// probed at the GEMM layer (gemm/packed_layout.h); the kernels only need its arithmetic.
#pragma once

#include <cstdint>

namespace kt {

// A [out, in] weight as [out / out_block][in / in_block][in_block / 2][out_block][2] bf16
// values: pairs of consecutive input columns (the operand pairs of vdpbf16ps), out_block
// output rows side by side.
struct PackedBf16Layout {
  int64_t out = 0, in = 0;
  int64_t out_block = 0, in_block = 0;

  int64_t offset(int64_t o, int64_t i) const {
    return (o / out_block) * (in * out_block) + (i / in_block) * (in_block * out_block) +
           ((i % in_block) / 2) * (out_block * 2) + (o % out_block) * 2 + (i % 2);
  }
};

}  // namespace kt
