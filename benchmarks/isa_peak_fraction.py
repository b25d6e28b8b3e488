"""kt.moe's base GEMMs as a fraction of each instruction-set path's arithmetic peak, measured in the
same run: per path (``avx2``, ``avx512`` without BF16, ``avx512_bf16``; every path this CPU can run,
or ``--isas``), kt.moe's GFLOP/s for fwd / lora / full at T=1024 and T=4096 on the Qwen3-30B-A3B
layer, beside that path's multiply-add peak (``torch.ops.kt._isa_peak_flops``: 12 independent
chains of the path's GEMM instruction on every thread at once: vfmadd231ps ymm for avx2, zmm for
avx512, vdpbf16ps for avx512_bf16).

GFLOP/s counts the base-weight GEMMs only (fwd 6·P·H·I, lora 12·P·H·I, full 18·P·H·I for P = T·K
token-expert pairs; ``benchmarks.suite.ceilings.ceiling_flops``), as the suite does. The peak is
measured before each path's timings; each cell is the median of ``--repeats`` steps after a
warm-up, the paths alternating step by step so that all see the same machine load. A path runs
natively on any CPU that has its instructions (``avx2`` on a Zen 4 runs the AVX2 code).

    .venv/bin/python -m benchmarks.isa_peak_fraction                    # every path here, T=1024 and 4096
    .venv/bin/python -m benchmarks.isa_peak_fraction --cases qwen3-30b-a3b-t1024 --modes fwd
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kt_ops
from benchmarks.common import cpu_model
from benchmarks.suite.cases import MODES, case_problem, problem_config, select_cases
from benchmarks.suite.ceilings import ceiling_flops
from benchmarks.suite.impls import build_impl, close_quietly
from kt_ops.cpu_isa import supported_cpu_isas

PEAK_ITERATIONS = 50_000_000  # ~0.1-0.3 s per thread on these CPUs


def isa_peak_gflops(isa: str, repeats: int = 5) -> float:
    """The path's peak on every intra-op thread at once, GFLOP/s (the best of ``repeats``, after
    an untimed call that starts the threads: the first read 138 of 200 GFLOP/s on a Zen 3)."""
    torch.ops.kt._isa_peak_flops(isa, PEAK_ITERATIONS // 10)
    return max(sum(torch.ops.kt._isa_peak_flops(isa, PEAK_ITERATIONS)) for _ in range(repeats)) / 1e9


def time_paths(impl, isas, warmup: int, repeats: int) -> dict:
    """Seconds per step of ``impl`` on each path: the median of ``repeats`` after ``warmup``,
    alternating the paths step by step."""
    times = {isa: [] for isa in isas}
    for i in range(warmup + repeats):
        for isa in isas:
            with kt_ops.use_cpu_isa(isa):
                impl.reset()
                start = time.perf_counter()
                out = impl.step()
                elapsed = time.perf_counter() - start
                del out
                impl.reset()
            if i >= warmup:
                times[isa].append(elapsed)
    return {isa: statistics.median(t) for isa, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="qwen3-30b-a3b-t1024,qwen3-30b-a3b-t4096")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--isas", default=None, help="comma-separated paths (default: every path but portable here)")
    p.add_argument("--impl", default="kt.moe", help="a suite implementation (kt.moe, kt.moe-fp32, kt.moe-int4, ...)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.lora_alpha = 2.0 * args.rank
    args.lora_scale = args.lora_alpha / args.rank
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isas.split(",") if args.isas else [i for i in supported_cpu_isas() if i != "portable"]
    modes = args.modes.split(",")
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads; {args.impl}; paths {', '.join(isas)}; "
          f"median of {args.repeats} steps after {args.warmup} warm-up, paths alternating")
    peaks = {isa: isa_peak_gflops(isa) for isa in isas}
    rows = []
    for case in select_cases(args.cases):
        cfg = problem_config(case, args)
        prob = case_problem(cfg)
        for mode in modes:
            impl = build_impl(args.impl, mode, prob, cfg)
            try:
                seconds = time_paths(impl, isas, args.warmup, args.repeats)
            finally:
                close_quietly(impl)
            flops = ceiling_flops(mode, case.T * case.K, case.H, case.I)
            for isa in isas:
                gflops = flops / seconds[isa] / 1e9
                rows.append(dict(case=case.name, T=case.T, mode=mode, isa=isa, tokens_per_s=case.T / seconds[isa],
                                 gflops=gflops, peak=peaks[isa], fraction=gflops / peaks[isa]))
        del prob
    peaks_after = {isa: isa_peak_gflops(isa) for isa in isas}  # the load may have changed meanwhile
    print("| path | T | mode | tokens/s | GFLOP/s | path's peak GFLOP/s (before / after) | of the peak |")
    print("|---|---:|---|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['isa']} | {r['T']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['gflops']:.1f} "
              f"| {r['peak']:.0f} / {peaks_after[r['isa']]:.0f} | {r['fraction']:.0%} |")
    return rows


if __name__ == "__main__":
    main()
