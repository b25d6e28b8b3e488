"""Thread scaling of kt.moe: the same step at 1 and at 2 (or --threads) threads, alternating
in one process so that both see the same machine load. After each switch of the thread count
one untimed step runs first (--settle): the first step after a switch pays for it (thread pool
and oneDNN state), which is not what the scaling should measure.

    .venv/bin/python -m benchmarks.thread_scaling            # Qwen3-30B-A3B layer, T=1024

Full mode bumps the base weights' version counters every step, as an optimizer step would.
The row mm is the machine's own scaling for context: forward's base GEMMs as plain torch.mm
calls, per expert, at the same routing. The last row (peak) is the active path's multiply-add
peak loop (``torch.ops.kt._isa_peak_flops``) on 1 and on N threads: the scaling the arithmetic
itself allows, which kt.moe's should come within 5% of.
"""
import argparse
import statistics
import time

import torch

from benchmarks.common import add_layer_arguments, kt_step, layer_problem


def mm_step(prob):
    """The machine's own scaling, for context: forward's base GEMMs as plain torch.mm per expert
    ([n, H]x[H, I] twice and [n, I]x[I, H], n = the expert's rows in this routing); oneDNN
    splits each GEMM over the threads."""
    counts = torch.bincount(prob["topk_ids"].reshape(-1), minlength=prob["gate_proj"].size(0)).tolist()
    xs = {n: prob["hidden"][:n] for n in set(counts) if n}

    def step():
        for e, n in enumerate(counts):
            if n:
                h = torch.mm(xs[n], prob["gate_proj"][e].t()) * torch.mm(xs[n], prob["up_proj"][e].t())
                torch.mm(h, prob["down_proj"][e].t())
    return step


def peak_step():
    """The active path's peak loop on every intra-op thread (its time is that of one thread's
    loop, so that 1 and N threads compare as the other rows do: N threads ideally N times the work
    in the same time, reported as the time of the same work)."""
    import kt_ops
    from kt_ops.cpu_isa import best_cpu_isa

    isa = kt_ops.cpu_isa() if kt_ops.cpu_isa() != "portable" else best_cpu_isa()

    def step():
        # the same total work whatever the thread count: each thread runs its share of it
        torch.ops.kt._isa_peak_flops(isa, 40_000_000 // torch.get_num_threads())
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(p)
    p.add_argument("--threads", type=int, default=2, help="compared with 1 thread (default 2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps after each change of the thread count (default 1)")
    args = p.parse_args(argv)
    prob = layer_problem(args)
    rows = []
    threads_before = torch.get_num_threads()
    from kt_ops.cpu_isa import best_cpu_isa

    modes = ("fwd", "lora", "full", "mm") + (("peak",) if best_cpu_isa() != "portable" else ())
    for mode in modes:
        step = mm_step(prob) if mode == "mm" else peak_step() if mode == "peak" else kt_step(prob, mode)
        for _ in range(3):  # warm-up; kt.moe packs unchanged weights on its third call
            step()
        times = {1: [], args.threads: []}
        for _ in range(args.repeats):
            for n in times:
                torch.set_num_threads(n)
                for _ in range(args.settle):  # untimed: the first step after a switch pays for it
                    step()
                t0 = time.perf_counter()
                step()
                times[n].append(time.perf_counter() - t0)
        one, many = (statistics.median(times[n]) for n in times)
        rows.append((mode, one, many))
        print(f"{mode:5s} 1 thread {one * 1e3:8.1f} ms | {args.threads} threads {many * 1e3:8.1f} ms | "
              f"scaling {one / many:.2f}x", flush=True)
    torch.set_num_threads(threads_before)
    return rows


if __name__ == "__main__":
    main()
