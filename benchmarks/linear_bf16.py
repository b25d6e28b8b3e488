"""nn.Linear's three GEMMs in bf16: PyTorch's own, kt.linear's (kt_ops/linear.py), and float32 for
reference, side by side: the forward x·Wᵀ, the input gradient g·W and the weight gradient gᵀ·x, at
several row counts (decode to training batches), each the median of ``--repeats`` calls, the
implementations alternating call by call.

    .venv/bin/python -m benchmarks.linear_bf16                     # W [2048, 2048], rows 1 16 64 512
    .venv/bin/python -m benchmarks.linear_bf16 --out-features 32000 --rows 1,512 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kt_ops  # noqa: F401  (registers kt.linear)
from benchmarks.common import cpu_model

PASSES = ("forward", "input grad", "weight grad")


def _calls(x, w, g):
    """Per implementation and pass: a zero-argument call."""
    xf, wf, gf = x.float(), w.float(), g.float()
    return {
        "torch bf16": {"forward": lambda: torch.nn.functional.linear(x, w), "input grad": lambda: g @ w,
                       "weight grad": lambda: g.t() @ x},
        "kt.linear bf16": {"forward": lambda: torch.ops.kt.linear(x, w, None),
                           "input grad": lambda: torch.ops.kt.linear_input_grad(g, w),
                           "weight grad": lambda: torch.ops.kt.linear_weight_grad(g, x)},
        "torch fp32": {"forward": lambda: torch.nn.functional.linear(xf, wf), "input grad": lambda: gf @ wf,
                       "weight grad": lambda: gf.t() @ xf},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-features", type=int, default=2048)
    p.add_argument("--out-features", type=int, default=2048)
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", default="", help="comma-separated 'impl:pass' cells not to time (slow ones)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads; kt_ops path {kt_ops.cpu_isa()} "
          f"(bf16 GEMMs: {torch.ops.kt._base_gemm_path(torch.bfloat16)}); W [{args.out_features}, "
          f"{args.in_features}]; median of {args.repeats}, ms")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.out_features, args.in_features, generator=g).to(torch.bfloat16)
    rows_out = []
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, args.in_features, generator=g).to(torch.bfloat16)
        dy = torch.randn(rows, args.out_features, generator=g).to(torch.bfloat16)
        calls = _calls(x, w, dy)
        times = {(impl, pas): [] for impl in calls for pas in PASSES if f"{impl}:{pas}" not in skip}
        for impl, pas in times:
            calls[impl][pas]()  # warm-up
        for _ in range(args.repeats):
            for impl, pas in times:
                start = time.perf_counter()
                calls[impl][pas]()
                times[impl, pas].append(time.perf_counter() - start)
        for impl in calls:
            rows_out.append(dict(rows=rows, impl=impl, **{pas: statistics.median(times[impl, pas]) * 1e3
                                                          if (impl, pas) in times else None for pas in PASSES}))
    print("| rows | implementation | " + " | ".join(PASSES) + " |")
    print("|---:|---|" + "---:|" * len(PASSES))
    for r in rows_out:
        cells = " | ".join("-" if r[pas] is None else f"{r[pas]:.2f}" for pas in PASSES)
        print(f"| {r['rows']} | {r['impl']} | {cells} |")
    return rows_out


if __name__ == "__main__":
    main()
