"""Few-row projections on one thread: kt's row dot products (thin_gemm_nt) against the GEMM
kt.moe uses for larger blocks on this path (torch.mm = oneDNN on avx512_bf16; elsewhere the
bf16-to-fp32 panel GEMM of csrc/gemm/base_gemm.h) on Qwen3-30B-A3B expert gate weights, at 1..16 rows; and the weight gradient
dW = dᵀ·x of such a projection as small_gemm's outer-product sum against torch.mm. These are
the measurements behind forward's GEMV cut (kGemvMaxRows in csrc/ops/moe_forward.cpp) and
backward's outer-product cut (kOuterProductMaxRows in csrc/ops/moe_backward.cpp).

    .venv/bin/python -m benchmarks.gemv_rows

Each call uses the next expert's weight (the stack is far larger than the L3), so the weights
stream from memory as in a decode step; the two kernels alternate expert by expert, best of
--repeats passes over the stack. GB/s = weight bytes read / time.
"""
import argparse

import torch

import kt_ops
from benchmarks.common import add_expert_stack_arguments, expert_stack, one_thread, time_pass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_expert_stack_arguments(p, experts=128)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    with one_thread():
        gen = torch.Generator().manual_seed(0)
        w = expert_stack(args, gen)
        weight_bytes = w[0].numel() * w.element_size()
        isa = kt_ops.cpu_isa()
        route = torch.ops.kt._base_gemm_path(torch.bfloat16)
        native = route == "onednn_bf16"
        base_mm = (lambda a, b: torch.mm(a, b.t())) if native else torch.ops.kt._panel_mm_nt  # a·bᵀ
        base_mm_tn = (lambda a, b: torch.mm(a.t(), b)) if native else torch.ops.kt._panel_mm_tn  # aᵀ·b
        print(f"one thread, bf16, weight [{args.intermediate}, {args.hidden}] per expert, "
              f"{args.experts} experts, cpu path {isa}, mm = kt.moe's base GEMM ({route})")
        print(f"{'rows':>4} | {'thin ms':>8} {'GB/s':>6} | {'mm ms':>8} {'GB/s':>6} | mm / thin | "
              f"dW: {'small ms':>8} {'mm ms':>8} | mm / small")
        rows = []
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, args.hidden, generator=gen).to(torch.bfloat16)
            d_t = torch.randn(args.intermediate, m, generator=gen).to(torch.bfloat16)  # dᵀ, contiguous
            kernels = {
                "thin": lambda e: torch.ops.kt._thin_gemm_nt(x, w[e], torch.bfloat16, isa),
                "mm": lambda e: base_mm(x, w[e]),
                "dw_small": lambda e: torch.ops.kt._small_gemm(None, d_t, x, 1.0, torch.bfloat16, isa),
                "dw_mm": lambda e: base_mm_tn(d_t.t(), x),
            }
            best = {k: float("inf") for k in kernels}
            for _ in range(args.repeats):
                for k, fn in kernels.items():
                    best[k] = min(best[k], time_pass(fn, range(args.experts)))
            rows.append((m, best["thin"], best["mm"], best["dw_small"], best["dw_mm"]))
            print(f"{m:>4} | {best['thin'] * 1e3:8.3f} {weight_bytes / best['thin'] / 1e9:6.1f} | "
                  f"{best['mm'] * 1e3:8.3f} {weight_bytes / best['mm'] / 1e9:6.1f} | "
                  f"{best['mm'] / best['thin']:8.2f}x | {best['dw_small'] * 1e3:12.3f} {best['dw_mm'] * 1e3:8.3f} | "
                  f"{best['dw_mm'] / best['dw_small']:.2f}x", flush=True)
        return rows


if __name__ == "__main__":
    main()
