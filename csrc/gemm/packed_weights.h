// Expert weights pre-packed in oneDNN's blocked layout, cached across calls: for forward
// [Wg; Wu] (one GEMM computes [g | u] = x·[Wg; Wu]ᵀ) and Wd; for backward their transposes
// (one GEMM computes dx = [dg | du]·[Wg; Wu], and dh' = dy·Wd).
//
// at::mm re-packs its weight operand into the layout of oneDNN's kernels on every call; with
// packed weights the forward GEMMs of a Qwen3-30B-A3B expert ([64, 2048]·[2048, 768], bf16)
// ran 1.2-1.4x faster here. Packing costs a pass over the weights (about 1 s for a
// Qwen3-30B-A3B layer on 2 cores) and two more copies of them in memory, so it pays only
// while the weights stay the same: LoRA training, inference.
//
// Policy: a set of (gate, up, down) weights is packed once forward has seen it unchanged on
// kPackAfterCalls calls (the tensor's version counter, bumped by every in-place update such
// as an optimizer step, and its storage identify "unchanged"; backward only looks up).
// Full fine-tuning changes the weights every step (at most two forward calls per version,
// with recomputation), so they are never packed there; the packed copy is dropped as soon as
// the weights change or are freed. A set is only packed while all packed copies fit in a
// budget (default a quarter of physical memory; KT_OPS_PACK_WEIGHTS_BUDGET_MB). bfloat16
// only, and only on the avx512_bf16 path (native_bf16_gemms() in cpu_isa.h: where oneDNN's
// packed kernels are the fast path; without AVX-512 oneDNN refuses the bf16 reorder, and
// KT_OPS_CPU_ISA=avx2 must choose as such a CPU does); off with KT_OPS_PACK_WEIGHTS=0 or
// kt_ops.set_weight_packing(False).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace kt {

struct PackedExperts {
  std::vector<at::Tensor> gate_up;  // per expert: [Wg[e]; Wu[e]] ([2I, H]) packed
  std::vector<at::Tensor> down;     // per expert: Wd[e] ([H, I]) packed
  std::vector<at::Tensor> gate_up_t;  // per expert: [Wg[e]; Wu[e]]ᵀ ([H, 2I]) packed
  std::vector<at::Tensor> down_t;     // per expert: Wd[e]ᵀ ([I, H]) packed
  int64_t bytes = 0;
};

constexpr int kPackAfterCalls = 3;

// The packed weights of (gate, up, down) when the policy above says so, else nullptr.
// gate/up/down are the op's arguments (their storage and version identify them); the
// *_contiguous tensors hold the same values, contiguous, and are what gets packed.
// forward_call: counts towards kPackAfterCalls (and may pack); backward passes false, and so
// does a forward call that would not use the packed copies (all its blocks decode-sized).
std::shared_ptr<const PackedExperts> packed_experts(const at::Tensor& gate, const at::Tensor& up,
                                                    const at::Tensor& down, const at::Tensor& gate_contiguous,
                                                    const at::Tensor& up_contiguous,
                                                    const at::Tensor& down_contiguous, bool forward_call);

// W [out, in] (bf16, contiguous) packed by oneDNN for packed_linear.
at::Tensor pack_linear_weight(const at::Tensor& w);

// out = x·Wᵀ with W packed (x [n, in], rows contiguous).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_w);
// addend + x·Wᵀ, rounded once (oneDNN adds in float32 before rounding); addend [n, out] contiguous.
at::Tensor packed_linear_add(const at::Tensor& x, const at::Tensor& packed_w, const at::Tensor& addend);

void set_weight_packing(bool enabled);  // false also drops every packed copy
// Drops every packed copy now (they are re-packed after kPackAfterCalls forward calls). The
// copies of freed weights are dropped by the next kt.moe call or packed_weights_info().
void release_packed_weights();
bool weight_packing_enabled();
// {number of packed weight sets, their bytes}
std::vector<int64_t> packed_weights_info();

}  // namespace kt
