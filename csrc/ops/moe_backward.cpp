// CPU kernel of kt.moe_backward (math in docs/design.md, "The expert math").
//
// Per expert, with dy the rows of grad_output routed to it, w their routing weights and
// g, u the pre-activations saved by forward:
//   dh'  = dy·Wd + s·(dy·Bd)·Ad          (gradient of h without the routing weight)
//   dw   = ⟨dh', h⟩                       (= ⟨dy, o⟩, without recomputing o)
//   dh   = w·dh'
//   dg   = dh ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))),  du = dh ⊙ silu(g)
//   dx   = dg·Wg + du·Wu + LoRA terms     (summed over the token's slots afterwards)
//   dWg = dgᵀ·x, dWu = duᵀ·x, dWd = (w·dy)ᵀ·h;  LoRA: dB = s·d_outᵀ·(in·Aᵀ), dA = s·(d_out·B)ᵀ·in
// With biases (g and u saved with theirs): dbg = Σ dg, dbu = Σ du, dbd = Σ w·dy over the
// expert's rows, and dw gains ⟨dy, bd⟩ (o = h·Wdᵀ + LoRA + bd).
// Each expert is one unit of work (its weight gradients are sums over its rows), so no two
// threads write the same gradient. Unrequested gradients are neither computed nor allocated.
#include <torch/library.h>

#include "gemm/base_gemm.h"
#include "platform/large_alloc.h"
#include "ops/moe_common.h"
#include "gemm/packed_weights.h"
#include "kernels/small_gemm.h"
#include "kernels/swiglu.h"
#include "kernels/thin_gemm.h"

namespace kt {
namespace {

// Positions in output_mask and in the returned tuple (moe_checks.h: the biases' are optional).
enum Grad : int {
  kHidden, kWeights, kGate, kUp, kDown, kGateA, kGateB, kUpA, kUpB, kDownA, kDownB,
  kGateBias, kUpBias, kDownBias
};
static_assert(kGateBias == kNumGrads && kDownBias + 1 == kNumGradsWithBiases);

// Σ over the first n rows of rows [>= n, C], in the accumulation dtype, into grad [C].
void sum_rows_into(const at::Tensor& rows, int64_t n, at::Tensor grad) {
  grad.copy_(rows.narrow(0, 0, n).sum(0, /*keepdim=*/false, accumulate_type(rows.scalar_type())));
}

// Gradients of one LoRA-adapted projection out = in·W[e]ᵀ + s·(in·A[e]ᵀ)·B[e]ᵀ of expert e,
// in two halves: the input's gradient first (the SwiGLU backward needs it before the down
// projection's input is known), the weights' after.

// d_in += d_out·W[e] + s·(d_out·B[e])·A[e] (d_in created when undefined; base_done: the
// d_out·W[e] term is in d_in already). Returns
// q = d_out·B[e] [n, r] when there is LoRA and need_q (dA needs it), else undefined. B comes
// transposed (b_t [E, r, out]) so that q is a row-by-row dot product (thin_gemm_nt).
at::Tensor input_backward(const at::Tensor& d_out, const ExpertWeights& w, const std::optional<at::Tensor>& a,
                          const std::optional<at::Tensor>& b_t, double s, int64_t e, bool need_in, bool need_q,
                          at::Tensor& d_in, bool base_done = false) {
  at::Tensor q;
  if (a.has_value() && (need_in || need_q)) q = thin_gemm_nt(d_out, (*b_t)[e]);
  if (need_in) {
    if (base_done) {
      // d_out·W[e] is already in d_in (a GEMM on packed weights, see the block below)
    } else if (d_in.defined()) {
      base_addmm_nn_(d_in, d_out, w.expert(e));
    } else {
      d_in = base_mm_nn(d_out, w.expert(e));
    }
    if (a.has_value()) small_gemm(d_in, d_in, q, (*a)[e], s);
  }
  return q;
}

struct ProjectionGrads {
  bool need_w, need_a, need_b;
  at::Tensor &grad_w, &grad_a, &grad_b;
};

// Experts with at most this many rows get dW as a sum of that many outer products from
// small_gemm (one pass writing dW) instead of a oneDNN GEMM with an inner dimension of 1-4,
// which was 1.4-2.6x slower on Qwen3-30B-A3B shapes (benchmarks/gemv_rows.py).
constexpr int64_t kOuterProductMaxRows = 4;

// dW[e] = d_outᵀ·in, dB[e] = s·d_outᵀ·(in·A[e]ᵀ), dA[e] = s·qᵀ·in, written (not added) into
// the gradient tensors where requested; rows: the block's real rows (d_out and in may have
// zero padding rows after them). dB is computed transposed ([r, out], the layout small_gemm
// produces) and copied.
void weight_backward(const at::Tensor& d_out, const at::Tensor& in, int64_t rows, const at::Tensor& q,
                     const std::optional<at::Tensor>& a, double s, int64_t e, const ProjectionGrads& pg) {
  if (pg.need_w) {
    at::Tensor grad_w = pg.grad_w[e];
    if (rows <= kOuterProductMaxRows) {
      small_gemm(grad_w, std::nullopt, d_out.narrow(0, 0, rows).t(), in.narrow(0, 0, rows), 1.0);
    } else {
      base_mm_tn_out(grad_w, d_out, in);
    }
  }
  if (pg.need_b) {
    const at::Tensor in_a = thin_gemm_nt(in, (*a)[e]);  // [n, r]
    at::Tensor grad_b_t = at::empty({in_a.size(1), d_out.size(1)}, d_out.options().dtype(accumulate_type(d_out.scalar_type())));
    small_gemm(grad_b_t, std::nullopt, in_a.t(), d_out, s);
    pg.grad_b[e].copy_(grad_b_t.t());
  }
  if (pg.need_a) {
    at::Tensor grad_a = pg.grad_a[e];
    small_gemm(grad_a, std::nullopt, q.t(), in, s);
  }
}

at::Tensor empty_grad(const at::Tensor& like) { return at::empty({0}, like.options()); }

std::vector<at::Tensor> moe_backward_cpu(const MoeArgs& args, const at::Tensor& grad_output,
                                         const at::Tensor& activations, const c10::List<bool>& output_mask_list) {
  const Gating gating = checked_gating(args);
  const MoeSizes sizes = check_moe_inputs(args);
  const LoraTensors& lora = args.lora;
  check_moe_backward_inputs(sizes, grad_output, args.hidden_states, activations, lora, args.biases, output_mask_list);
  const auto output_mask = output_mask_array(output_mask_list);
  const int num_grads = static_cast<int>(output_mask_list.size());
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const MoeInputs in = flatten_moe_inputs(args);
  const at::Tensor &gate_proj = args.gate_proj, &up_proj = args.up_proj, &down_proj = args.down_proj;
  const at::Tensor dy_all = grad_output.detach().reshape(in.x.sizes()).contiguous();
  const at::Tensor act = activations.detach().contiguous();
  const auto acc = accumulate_type(in.x.scalar_type());
  const double s = in.scale;

  auto need = [&](Grad g) { return output_mask[g]; };
  const bool need_gate_side = need(kGate) || need(kGateA) || need(kGateB) || need(kGateBias);
  const bool need_up_side = need(kUp) || need(kUpA) || need(kUpB) || need(kUpBias);
  const bool need_dgu = need(kHidden) || need_gate_side || need_up_side;
  const bool need_scaled_dy = need(kDown) || need(kDownA) || need(kDownB);
  const bool need_x = need(kGate) || need(kGateA) || need(kGateB) || need(kUp) || need(kUpA) || need(kUpB);

  const ExpertRouting routing = route_to_experts(in.ids, in.gate.data.size(0));
  const int64_t N = routing.num_routed();
  const int64_t H = in.x.size(1);
  const int64_t I = in.gate.out;

  // Gradients of the expert weights (empty_large: recycled across calls, see large_alloc.h).
  // Every expert with rows overwrites its slice; the others' are zeroed after the loop.
  std::array<at::Tensor, kNumGradsWithBiases> grads;
  const at::Tensor* weight_of[kNumGradsWithBiases] = {nullptr, nullptr, &in.gate.data, &in.up.data, &in.down.data,
                                                     lora.has_gate() ? &*in.lora.gate_a : nullptr,
                                                     lora.has_gate() ? &*in.lora.gate_b : nullptr,
                                                     lora.has_up() ? &*in.lora.up_a : nullptr,
                                                     lora.has_up() ? &*in.lora.up_b : nullptr,
                                                     lora.has_down() ? &*in.lora.down_a : nullptr,
                                                     lora.has_down() ? &*in.lora.down_b : nullptr,
                                                     in.biases.gate ? &*in.biases.gate : nullptr,
                                                     in.biases.up ? &*in.biases.up : nullptr,
                                                     in.biases.down ? &*in.biases.down : nullptr};
  for (int g = kGate; g < kNumGradsWithBiases; ++g) {
    grads[g] = need(Grad(g)) ? empty_large(weight_of[g]->sizes(), weight_of[g]->options()) : empty_grad(in.x);
  }
  const auto gate_b_t = transposed_lora_b(in.lora.gate_b);
  const auto up_b_t = transposed_lora_b(in.lora.up_b);
  const auto down_b_t = transposed_lora_b(in.lora.down_b);
  // The transposed packed weights when forward packed these weights (packed_weights.h).
  const auto packed = packed_experts(gate_proj, up_proj, down_proj, in.gate.data, in.up.data, in.down.data,
                                     /*forward_call=*/false);
  BlockRows dx_rows(need(kHidden) ? N : 0, in.x.scalar_type());  // dx of every sorted row, kept per block
  at::Tensor dw_rows = need(kWeights) ? at::empty({N + 1}, in.x.options().dtype(acc)) : at::Tensor();
  if (need(kWeights)) dw_rows[N].zero_();  // the weight gradient of an empty slot

  for_each_block(expert_blocks(routing, /*max_rows=*/0), [&](const ExpertBlock& blk) {
    // Rows [n, padded) are zeros (see padded_rows): they add nothing to any gradient.
    const int64_t e = blk.expert, n = blk.end - blk.begin, padded = padded_rows(n, in.x.scalar_type());
    const at::Tensor tokens = routing.sorted_tokens.narrow(0, blk.begin, n);
    const at::Tensor w = gather_rows_padded(in.weights.view({-1, 1}), routing.sorted_pairs.narrow(0, blk.begin, n),
                                            padded).view({padded});
    const at::Tensor dy = gather_rows_padded(dy_all, tokens, padded);

    // Down projection, fed the unweighted dy: its input gradient is dh' (dh without the
    // routing weight) and, with hw = w·h as its input, its weight gradients are exactly
    // those of (w·dy) and h: (w·dy)ᵀ·h = dyᵀ·(w·h).
    at::Tensor dh_unweighted;
    if (packed) dh_unweighted = packed_linear(dy, packed->down_t[e]);
    const at::Tensor q_down = input_backward(dy, in.down, in.lora.down_a, down_b_t, s, e, /*need_in=*/true,
                                             need(kDownA), dh_unweighted, /*base_done=*/bool(packed));
    // dg and du side by side, so that on packed weights one GEMM gives dx = [dg | du]·[Wg; Wu].
    const at::Tensor dgu = at::empty({padded, 2 * I}, in.x.options());
    SwigluBackwardOut sw;
    sw.dg = dgu.narrow(1, 0, I);
    sw.du = dgu.narrow(1, I, I);
    if (need_scaled_dy) sw.hw = at::empty({padded, I}, in.x.options());
    if (need(kWeights)) sw.dw = dw_rows.narrow(0, blk.begin, n);
    swiglu_backward(act[0].narrow(0, blk.begin, n), act[1].narrow(0, blk.begin, n), dh_unweighted, w, sw, gating);
    if (in.biases.down && (need(kWeights) || need(kDownBias))) {
      const at::Tensor dy_acc = dy.narrow(0, 0, n).to(acc);
      if (need(kWeights)) sw.dw.add_(at::mv(dy_acc, (*in.biases.down)[e].to(acc)));  // ⟨dy, bd⟩
      if (need(kDownBias)) grads[kDownBias][e].copy_(at::mv(dy_acc.t(), w.narrow(0, 0, n).to(acc)));  // Σ w·dy
    }
    weight_backward(dy, sw.hw, n, q_down, in.lora.down_a, s, e,
                    {need(kDown), need(kDownA), need(kDownB), grads[kDown], grads[kDownA], grads[kDownB]});
    if (need(kGateBias)) sum_rows_into(sw.dg, n, grads[kGateBias][e]);
    if (need(kUpBias)) sum_rows_into(sw.du, n, grads[kUpBias][e]);
    if (!need_dgu) return;

    const at::Tensor x = need_x ? gather_rows_padded(in.x, tokens, padded) : at::Tensor();
    at::Tensor dx;
    if (packed && need(kHidden)) {
      dx = packed_linear(dgu, packed->gate_up_t[e]);
    } else if (need(kHidden) && in.gate.quantized() && in.up.quantized()) {
      dx = stacked_mm_nn(dgu, in.gate.expert(e), in.up.expert(e));  // undefined where not available
    }
    const bool fused_dx = dx.defined();
    const at::Tensor q_gate = input_backward(sw.dg, in.gate, in.lora.gate_a, gate_b_t, s, e, need(kHidden),
                                             need(kGateA), dx, fused_dx);
    const at::Tensor q_up = input_backward(sw.du, in.up, in.lora.up_a, up_b_t, s, e, need(kHidden),
                                           need(kUpA), dx, fused_dx);
    if (need(kHidden)) dx_rows.keep(blk.begin, n, dx);
    weight_backward(sw.dg, x, n, q_gate, in.lora.gate_a, s, e,
                    {need(kGate), need(kGateA), need(kGateB), grads[kGate], grads[kGateA], grads[kGateB]});
    weight_backward(sw.du, x, n, q_up, in.lora.up_a, s, e,
                    {need(kUp), need(kUpA), need(kUpB), grads[kUp], grads[kUpA], grads[kUpB]});
  });

  for (int64_t e = 0; e < routing.num_experts; ++e) {
    if (routing.rows(e) != 0) continue;
    for (int g = kGate; g < kNumGradsWithBiases; ++g) {
      if (need(Grad(g))) zero_large(grads[g][e]);
    }
  }

  if (need(kHidden)) {
    at::Tensor dx = empty_large({in.x.size(0), H}, in.x.options());  // combine_rows writes every row
    combine_rows(dx_rows, routing.row_of_pair, std::nullopt, dx);
    grads[kHidden] = dx.view(args.hidden_states.sizes());
  } else {
    grads[kHidden] = empty_grad(in.x);
  }
  if (need(kWeights)) {
    // Back from sorted rows to (token, slot) order, in the dtype of topk_weights.
    // An empty slot (row -1) gets 0: its expert is not this call's (dw_rows' extra last row).
    const at::Tensor rows = routing.has_empty_slots()
                                ? at::where(routing.row_of_pair.ge(0), routing.row_of_pair, N)
                                : routing.row_of_pair;
    grads[kWeights] = dw_rows.index_select(0, rows)
                          .to(args.topk_weights.scalar_type())
                          .view(args.topk_weights.sizes());
  } else {
    grads[kWeights] = empty_grad(args.topk_weights);
  }
  return std::vector<at::Tensor>(grads.begin(), grads.begin() + num_grads);
}

void moe_backward_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  MoeCall call(op, *stack);
  std::vector<at::Tensor> grads = moe_backward_cpu(read_moe_args(call), call.tensor("grad_output"),
                                                   call.tensor("activations"), call.arg("output_mask").toBoolList());
  call.finish(std::move(grads));
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("_moe_backward_cpu", torch::CppFunction::makeFromBoxedFunction<&moe_backward_boxed>());
}

}  // namespace kt
