// CPU kernel of kt.moe_backward (math in ../shared/DESIGN.md §1).
//
// Per expert, with dy the rows of grad_output routed to it, w their routing weights and
// g, u the pre-activations saved by forward:
//   dh'  = dy·Wd + s·(dy·Bd)·Ad          (gradient of h without the routing weight)
//   dw   = ⟨dh', h⟩                       (= ⟨dy, o⟩, without recomputing o)
//   dh   = w·dh'
//   dg   = dh ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))),  du = dh ⊙ silu(g)
//   dx   = dg·Wg + du·Wu + LoRA terms     (summed over the token's slots afterwards)
//   dWg = dgᵀ·x, dWu = duᵀ·x, dWd = (w·dy)ᵀ·h;  LoRA: dB = s·d_outᵀ·(in·Aᵀ), dA = s·(d_out·B)ᵀ·in
// Each expert is one unit of work (its weight gradients are sums over its rows), so no two
// threads write the same gradient. Unrequested gradients are neither computed nor allocated.
#include <torch/library.h>

#include "ops/moe_common.h"

namespace kt {
namespace {

// Positions in output_mask and in the returned tuple.
enum Grad : int {
  kHidden, kWeights, kGate, kUp, kDown, kGateA, kGateB, kUpA, kUpB, kDownA, kDownB, kNumGrads
};

// Backward of one LoRA-adapted projection out = in·W[e]ᵀ + s·(in·A[e]ᵀ)·B[e]ᵀ of expert e,
// given its upstream gradient d_out [n, out] and its input in [n, in] (only read for the
// weight gradients). Adds d_out·W[e] + s·(d_out·B[e])·A[e] to d_in (creating it when
// undefined) if need_in, and writes dW[e] = d_outᵀ·in, dB[e] = s·d_outᵀ·(in·A[e]ᵀ),
// dA[e] = s·(d_out·B[e])ᵀ·in where requested, straight into the gradient tensors.
void projection_backward(const at::Tensor& d_out, const at::Tensor& in, const at::Tensor& w,
                         const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b, double s,
                         int64_t e, bool need_in, at::Tensor& d_in, bool need_w, bool need_a, bool need_b,
                         at::Tensor& grad_w, at::Tensor& grad_a, at::Tensor& grad_b) {
  at::Tensor d_out_b;  // d_out·B[e], [n, r]: shared by d_in and dA
  if (a.has_value() && (need_in || need_a)) d_out_b = at::mm(d_out, (*b)[e]);
  if (need_in) {
    if (d_in.defined()) {
      d_in.addmm_(d_out, w[e]);
    } else {
      d_in = at::mm(d_out, w[e]);
    }
    if (a.has_value()) d_in.addmm_(d_out_b, (*a)[e], /*beta=*/1.0, /*alpha=*/s);
  }
  if (need_w) grad_w[e].addmm_(d_out.t(), in, /*beta=*/0.0, /*alpha=*/1.0);
  if (need_b) grad_b[e].addmm_(d_out.t(), at::mm(in, (*a)[e].t()), 0.0, s);
  if (need_a) grad_a[e].addmm_(d_out_b.t(), in, 0.0, s);
}

at::Tensor empty_grad(const at::Tensor& like) { return at::empty({0}, like.options()); }

std::vector<at::Tensor> moe_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, const at::Tensor& activations, const at::Tensor& gate_proj,
    const at::Tensor& up_proj, const at::Tensor& down_proj, const std::optional<at::Tensor>& gate_lora_a,
    const std::optional<at::Tensor>& gate_lora_b, const std::optional<at::Tensor>& up_lora_a,
    const std::optional<at::Tensor>& up_lora_b, const std::optional<at::Tensor>& down_lora_a,
    const std::optional<at::Tensor>& down_lora_b, double lora_scale, const c10::List<bool>& output_mask_list) {
  const LoraTensors lora{gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b};
  const MoeSizes sizes = check_moe_inputs(hidden_states, topk_ids, topk_weights, gate_proj, up_proj,
                                          down_proj, lora, lora_scale);
  check_moe_backward_inputs(sizes, grad_output, hidden_states, activations, lora, output_mask_list);
  const std::array<bool, 11> output_mask = output_mask_array(output_mask_list);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const MoeInputs in = flatten_moe_inputs(hidden_states, topk_ids, topk_weights, gate_proj, up_proj,
                                          down_proj, lora, lora_scale);
  const at::Tensor dy_all = grad_output.detach().reshape(in.x.sizes()).contiguous();
  const at::Tensor act = activations.detach().contiguous();
  const auto acc = accumulate_type(in.x.scalar_type());
  const auto ct = in.x.scalar_type();
  const double s = in.scale;

  auto need = [&](Grad g) { return output_mask[g]; };
  const bool need_gate_side = need(kGate) || need(kGateA) || need(kGateB);
  const bool need_up_side = need(kUp) || need(kUpA) || need(kUpB);
  const bool need_dgu = need(kHidden) || need_gate_side || need_up_side;
  const bool need_scaled_dy = need(kDown) || need(kDownA) || need(kDownB);
  const bool need_x = need_gate_side || need_up_side;

  const ExpertRouting routing = route_to_experts(in.ids, in.gate.size(0));
  const int64_t N = routing.num_pairs();
  const int64_t H = in.x.size(1);

  // Gradients of the expert weights; experts that got no rows keep zeros.
  std::array<at::Tensor, kNumGrads> grads;
  const at::Tensor* weight_of[kNumGrads] = {nullptr, nullptr, &in.gate, &in.up, &in.down,
                                           lora.has_gate() ? &*in.lora.gate_a : nullptr,
                                           lora.has_gate() ? &*in.lora.gate_b : nullptr,
                                           lora.has_up() ? &*in.lora.up_a : nullptr,
                                           lora.has_up() ? &*in.lora.up_b : nullptr,
                                           lora.has_down() ? &*in.lora.down_a : nullptr,
                                           lora.has_down() ? &*in.lora.down_b : nullptr};
  for (int g = kGate; g < kNumGrads; ++g) {
    grads[g] = need(Grad(g)) ? at::zeros_like(*weight_of[g]) : empty_grad(in.x);
  }
  at::Tensor dx_rows = need(kHidden) ? at::empty({N, H}, in.x.options().dtype(acc)) : at::Tensor();
  at::Tensor dw_rows = need(kWeights) ? at::empty({N}, in.x.options().dtype(acc)) : at::Tensor();

  for_each_block(expert_blocks(routing, /*max_rows=*/0), [&](const ExpertBlock& blk) {
    // Rows [n, padded) are zeros (see padded_rows): they add nothing to any gradient.
    const int64_t e = blk.expert, n = blk.end - blk.begin, padded = padded_rows(n);
    const at::Tensor tokens = routing.sorted_tokens.narrow(0, blk.begin, n);
    const at::Tensor w = gather_rows_padded(in.weights.view({-1, 1}),
                                            routing.sorted_pairs.narrow(0, blk.begin, n), padded);  // [padded, 1]
    const at::Tensor dy = gather_rows_padded(dy_all, tokens, padded);
    const at::Tensor g = pad_rows(act[0].narrow(0, blk.begin, n), padded, acc);
    const at::Tensor u = pad_rows(act[1].narrow(0, blk.begin, n), padded, acc);
    const at::Tensor sig = at::sigmoid(g);
    const at::Tensor silu_g = g * sig;
    const at::Tensor h = silu_g * u;  // accumulation dtype

    // Down projection, fed the unweighted dy: its input gradient is dh' (dh without the
    // routing weight) and, with hw = w·h as its input, its weight gradients are exactly
    // those of (w·dy) and h: (w·dy)ᵀ·h = dyᵀ·(w·h).
    const at::Tensor hw = need_scaled_dy ? (h * w).to(ct) : at::Tensor();
    at::Tensor dh_unweighted;
    projection_backward(dy, hw, in.down, in.lora.down_a, in.lora.down_b, s, e, /*need_in=*/true, dh_unweighted,
                        need(kDown), need(kDownA), need(kDownB), grads[kDown], grads[kDownA], grads[kDownB]);
    at::Tensor dh = dh_unweighted.to(acc);
    if (need(kWeights)) dw_rows.narrow(0, blk.begin, n).copy_((dh * h).sum(1).narrow(0, 0, n));
    if (!need_dgu) return;
    dh = dh.mul(w);
    const at::Tensor du = (dh * silu_g).to(ct);
    // dg = dh·u·σ(g)(1 + g(1 − σ(g))) = dh·u·(σ + silu(g)(1 − σ))
    const at::Tensor dg = at::rsub(sig, 1.0).mul_(silu_g).add_(sig).mul_(u).mul_(dh).to(ct);
    const at::Tensor x = need_x ? gather_rows_padded(in.x, tokens, padded) : at::Tensor();
    at::Tensor dx;
    projection_backward(dg, x, in.gate, in.lora.gate_a, in.lora.gate_b, s, e, need(kHidden), dx, need(kGate),
                        need(kGateA), need(kGateB), grads[kGate], grads[kGateA], grads[kGateB]);
    projection_backward(du, x, in.up, in.lora.up_a, in.lora.up_b, s, e, need(kHidden), dx, need(kUp),
                        need(kUpA), need(kUpB), grads[kUp], grads[kUpA], grads[kUpB]);
    if (need(kHidden)) dx_rows.narrow(0, blk.begin, n).copy_(dx.narrow(0, 0, n));
  });

  if (need(kHidden)) {
    at::Tensor dx = at::empty({in.x.size(0), H}, in.x.options());
    combine_rows(dx_rows, routing.row_of_pair, std::nullopt, dx);
    grads[kHidden] = dx.view(hidden_states.sizes());
  } else {
    grads[kHidden] = empty_grad(in.x);
  }
  if (need(kWeights)) {
    // Back from sorted rows to (token, slot) order, in the dtype of topk_weights.
    grads[kWeights] = dw_rows.index_select(0, routing.row_of_pair)
                          .to(topk_weights.scalar_type())
                          .view(topk_weights.sizes());
  } else {
    grads[kWeights] = empty_grad(topk_weights);
  }
  return std::vector<at::Tensor>(grads.begin(), grads.end());
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("_moe_backward_cpu", &moe_backward_cpu); }

}  // namespace kt
