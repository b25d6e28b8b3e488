// CPU kernel of kt.moe_forward.
//
// Per expert block (rows of the tokens routed to one expert, see routing.h):
//   g = x·Wgᵀ + s·(x·Agᵀ)·Bgᵀ,  u = x·Wuᵀ + s·(x·Auᵀ)·Buᵀ,  h = silu(g)·u,
//   o = h·Wdᵀ + s·(h·Adᵀ)·Bdᵀ
// and then y[t] = Σ_j w[t, j]·o[t, j] in fixed slot order. Base GEMMs are oneDNN's, on
// pre-packed weights with gate|up fused into one GEMM when the weights stay unchanged
// (packed_weights.h, CPUs with native bf16 GEMMs), else base_gemm.h's (ATen, or bf16
// converted to float32 panels where the CPU has no fast bf16 GEMM, or quantized weights
// dequantized panel by panel);
// one thread each, blocks spread over torch's intra-op threads; the rank-r LoRA updates
// (small_gemm) and silu(g)·u (swiglu_forward) are fused kernels of our own. Blocks of a few
// rows (decode) skip the GEMMs: their projections are row dot products over the expert's
// weights (thin_gemm_nt), a pass over the weights at memory speed.
#include <torch/library.h>

#include <algorithm>

#include "gemm/base_gemm.h"
#include "platform/large_alloc.h"
#include "ops/moe_common.h"
#include "gemm/packed_weights.h"
#include "kernels/swiglu.h"
#include "kernels/thin_gemm.h"

namespace kt {
namespace {

// Rows per block in forward: big enough for efficient GEMMs, small enough to spread an
// expert that receives many tokens over several threads.
constexpr int64_t kForwardBlockRows = 256;

// Blocks of at most this many rows use row dot products on the plain weights instead of
// GEMMs. They are bound by reading the weights: one thread streamed a Qwen3-30B-A3B expert's
// gate weight at 16.0 GB/s this way against torch.mm's 9.9 GB/s at 1 row; the two were equal
// at 4 rows and the dot products 1.5x slower at 8 (benchmarks/gemv_rows.py).
constexpr int64_t kGemvMaxRows = 4;

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u, const Gating& gating) {
  at::Tensor h = at::empty(g.sizes(), g.options());
  swiglu_forward(g, u, h, gating);
  return h;
}

std::tuple<at::Tensor, at::Tensor> moe_forward_cpu(const MoeArgs& args, bool save_activations) {
  const Gating gating = checked_gating(args);
  const MoeSizes sizes = check_moe_inputs(args);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const MoeInputs in = flatten_moe_inputs(args);
  const at::Tensor &gate_proj = args.gate_proj, &up_proj = args.up_proj, &down_proj = args.down_proj;
  const int64_t H = in.x.size(1);
  const int64_t I = in.gate.out;
  const ExpertRouting routing = route_to_experts(in.ids, in.gate.data.size(0));
  const int64_t N = routing.num_routed();

  // oneDNN-packed base weights once they have stayed the same for a few calls (see
  // packed_weights.h); nullptr: plain at::mm on the weights as they are.
  // A call whose blocks are all decode-sized never uses packed copies: it does not count
  // towards packing (inference at batch 1 would otherwise triple the weights' memory).
  const std::vector<ExpertBlock> blocks = expert_blocks(routing, kForwardBlockRows);
  const bool uses_gemms = std::any_of(blocks.begin(), blocks.end(),
                                      [](const ExpertBlock& b) { return b.end - b.begin > kGemvMaxRows; });
  const auto packed = packed_experts(gate_proj, up_proj, down_proj, in.gate.data, in.up.data, in.down.data,
                                     /*forward_call=*/uses_gemms);
  const auto gate_b_t = transposed_lora_b(in.lora.gate_b);
  const auto up_b_t = transposed_lora_b(in.lora.up_b);
  const auto down_b_t = transposed_lora_b(in.lora.down_b);
  // Rows [0, N) are written below (empty_large: recycled across calls, see large_alloc.h). The
  // shape stays [2, T*K, I] with empty slots too (the fake kernel knows no ids): rows past N are
  // never read, and pages never touched are never backed by memory.
  at::Tensor activations = empty_large({2, save_activations ? in.x.size(0) * routing.top_k : 0, I}, in.x.options());
  BlockRows expert_out(N, in.x.scalar_type());  // o of every sorted row, kept per block

  for_each_block(blocks, [&](const ExpertBlock& blk) {
    const int64_t e = blk.expert, n = blk.end - blk.begin;
    const bool gemv = n <= kGemvMaxRows;
    // GEMMs get padded rows (see padded_rows); the row dot products need none.
    const at::Tensor x_e = gather_rows_padded(in.x, routing.sorted_tokens.narrow(0, blk.begin, n),
                                              gemv ? n : padded_rows(n, in.x.scalar_type()));
    at::Tensor g, u;  // [p, I] each; column halves of one [p, 2I] result on packed weights
    if (gemv) {
      g = thin_gemm_nt(x_e, in.gate.expert(e));
      u = thin_gemm_nt(x_e, in.up.expert(e));
    } else if (packed) {
      const at::Tensor gu = packed_linear(x_e, packed->gate_up[e]);
      g = gu.narrow(1, 0, I);
      u = gu.narrow(1, I, I);
    } else {
      g = base_mm_nt(x_e, in.gate.expert(e));
      u = base_mm_nt(x_e, in.up.expert(e));
    }
    add_lora(g, x_e, expert_slice(in.lora.gate_a, e), expert_slice(gate_b_t, e), in.scale);
    add_lora(u, x_e, expert_slice(in.lora.up_a, e), expert_slice(up_b_t, e), in.scale);
    // Biases on every row, padding included: padded rows only ever reach o's rows past n.
    if (in.biases.gate) g.add_((*in.biases.gate)[e]);
    if (in.biases.up) u.add_((*in.biases.up)[e]);
    if (save_activations) {
      activations[0].narrow(0, blk.begin, n).copy_(g.narrow(0, 0, n));
      activations[1].narrow(0, blk.begin, n).copy_(u.narrow(0, 0, n));
    }
    const at::Tensor h = swiglu(g, u, gating);
    at::Tensor o = gemv ? thin_gemm_nt(h, in.down.expert(e))
                        : packed ? packed_linear(h, packed->down[e]) : base_mm_nt(h, in.down.expert(e));
    add_lora(o, h, expert_slice(in.lora.down_a, e), expert_slice(down_b_t, e), in.scale);
    if (in.biases.down) o.add_((*in.biases.down)[e]);
    expert_out.keep(blk.begin, n, o);
  });

  at::Tensor out = empty_large({in.x.size(0), H}, in.x.options());  // combine_rows writes every row
  combine_rows(expert_out, routing.row_of_pair, in.weights, out);
  return {out.view(args.hidden_states.sizes()), activations};
}

void moe_forward_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  MoeCall call(op, *stack);
  auto [output, activations] = moe_forward_cpu(read_moe_args(call), call.arg("save_activations").toBool());
  call.finish(std::move(output), std::move(activations));
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("_moe_forward_cpu", torch::CppFunction::makeFromBoxedFunction<&moe_forward_boxed>());
}

}  // namespace kt
