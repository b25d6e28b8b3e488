// Expert weights pre-packed in oneDNN's blocked layout for the forward GEMMs, cached across
// calls, with gate and up packed together so that one GEMM computes both ([g | u] = x·[Wg; Wu]ᵀ).
//
// at::mm re-packs its weight operand into the layout of oneDNN's kernels on every call; with
// packed weights the forward GEMMs of a Qwen3-30B-A3B expert ([64, 2048]·[2048, 768], bf16)
// ran 1.2-1.4x faster here. Packing costs a pass over the weights and a second copy of them
// in memory, so it pays only while the weights stay the same: LoRA training, inference.
//
// Policy: a set of (gate, up, down) weights is packed once it has been seen unchanged on
// kPackAfterCalls calls (the tensor's version counter, bumped by every in-place update such
// as an optimizer step, and its storage identify "unchanged"). Full fine-tuning changes the
// weights every step, so they are never packed there; the packed copy is dropped as soon as
// the weights change or are freed. bfloat16 only (where oneDNN's packed kernels are the
// fast path); off with KT_OPS_PACK_WEIGHTS=0 or kt_ops.set_weight_packing(False).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace kt {

struct PackedExperts {
  std::vector<at::Tensor> gate_up;  // per expert: [Wg[e]; Wu[e]] ([2I, H]) packed
  std::vector<at::Tensor> down;     // per expert: Wd[e] ([H, I]) packed
  int64_t bytes = 0;
};

constexpr int kPackAfterCalls = 3;

// The packed weights of (gate, up, down) when the policy above says so, else nullptr.
// gate/up/down are the op's arguments (their storage and version identify them); the
// *_contiguous tensors hold the same values, contiguous, and are what gets packed.
std::shared_ptr<const PackedExperts> packed_experts(const at::Tensor& gate, const at::Tensor& up,
                                                    const at::Tensor& down, const at::Tensor& gate_contiguous,
                                                    const at::Tensor& up_contiguous,
                                                    const at::Tensor& down_contiguous);

// out = x·Wᵀ with W packed (x [n, in], rows contiguous).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_w);

void set_weight_packing(bool enabled);  // false also drops every packed copy
bool weight_packing_enabled();
// {number of packed weight sets, their bytes}
std::vector<int64_t> packed_weights_info();

}  // namespace kt
