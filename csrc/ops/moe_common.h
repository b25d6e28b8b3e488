// Small pieces shared by the forward and backward CPU kernels of kt.moe.
#pragma once

#include <ATen/ATen.h>

#include "kernels/expert_weights.h"
#include "ops/moe_checks.h"
#include "ops/routing.h"

#include <vector>

namespace kt {

// Accumulation dtype: float64 for float64 inputs, float32 otherwise (bf16 computes in fp32).
inline at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The inputs of one call, flattened to 2-d, contiguous, detached from autograd.
struct MoeInputs {
  at::Tensor x;        // [T, H]
  at::Tensor ids;      // [T, K]
  at::Tensor weights;  // [T, K] in the accumulation dtype
  ExpertWeights gate, up, down;  // dense or quantized (expert_weights.h)
  LoraTensors lora;
  double scale;
  ExpertBiases biases;  // contiguous where given
};

MoeInputs flatten_moe_inputs(const MoeArgs& args);

// The per-block results of an expert pass (forward's expert outputs, backward's input
// gradients), addressed by sorted row, without copying them into one [N, H] buffer: each
// block keeps the tensor its GEMM produced. Blocks of one pass cover distinct sorted rows, so
// threads may keep their blocks concurrently.
class BlockRows {
 public:
  BlockRows(int64_t num_rows, at::ScalarType dtype);

  // Sorted rows [begin, begin + n) are the first n rows of `rows` ([>= n, C], rows
  // contiguous, this pass's dtype); `rows` is kept alive.
  void keep(int64_t begin, int64_t n, const at::Tensor& rows);

  at::ScalarType dtype() const { return dtype_; }
  const void* row(int64_t i) const { return row_[i]; }

 private:
  at::ScalarType dtype_;
  std::vector<at::Tensor> kept_;  // indexed by each block's first sorted row
  std::vector<const void*> row_;
};

// out[t] = sum_j scale[t, j] * rows.row(row_of_pair[t*K + j])   (scale == nullopt: plain sum;
// a pair whose row is -1, an empty slot, adds nothing)
// rows: C = H values each, in out's dtype; scale: [T, K] in the accumulation dtype; out:
// [T, H] contiguous. Accumulated in the accumulation dtype, in slot order j = 0..K-1, so that
// the result does not depend on the thread count.
void combine_rows(const BlockRows& rows, const at::Tensor& row_of_pair,
                  const std::optional<at::Tensor>& scale, at::Tensor& out);

// Row count a block is padded to (with zero rows) before its GEMMs. oneDNN builds (JITs)
// a kernel for every new GEMM shape, and the rows per expert change every step: without
// padding, backward spent most of its time building kernels. Buckets: powers of two up to
// 16, then multiples of 16. Only bf16 on native bf16 GEMMs (base_gemm.h) runs oneDNN; MKL's
// float GEMMs build nothing per shape, so every other case gets n (no wasted rows).
int64_t padded_rows(int64_t n, at::ScalarType dtype);

// src.index_select(0, index) followed by zero rows up to `padded` rows.
at::Tensor gather_rows_padded(const at::Tensor& src, const at::Tensor& index, int64_t padded);

// x[E, ...] -> x[e]; nullopt stays nullopt.
inline std::optional<at::Tensor> expert_slice(const std::optional<at::Tensor>& t, int64_t e) {
  return t.has_value() ? std::optional<at::Tensor>(t->select(0, e)) : std::nullopt;
}

// out += s·(in·Aᵀ)·Bᵀ for one expert (A [r, in], B given transposed as b_t [r, out]); nothing
// without LoRA. The rank-r GEMMs are our thin kernels (thin_gemm_nt, small_gemm); out may be a
// column slice (rows contiguous).
void add_lora(at::Tensor& out, const at::Tensor& in, const std::optional<at::Tensor>& a,
              const std::optional<at::Tensor>& b_t, double scale);

// [E, out, r] -> [E, r, out] contiguous (the layout small_gemm reads B in); nullopt stays.
std::optional<at::Tensor> transposed_lora_b(const std::optional<at::Tensor>& b);

}  // namespace kt
