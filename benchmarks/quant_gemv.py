"""Decode GEMV on one thread: a Qwen3-30B-A3B expert gate weight in bf16 (kt's thin_gemm_nt)
against the same weight quantized (fp8, int8, int4; kt's quant_gemv_nt), each from memory (the
next expert's weight every call, a stack far larger than the L3) and from cache (one expert
over and over). What it shows: whether the quantized GEMVs are bound by the bytes they read or
by the instructions that decode them. With --nn, backward's input gradient d·w over the same
weight instead (d: --rows rows of the intermediate size): thin_gemm_nn's streaming kernel
("thin") against the panel GEMMs it replaced on the avx2 path ("panels"), per format.

    .venv/bin/python -m benchmarks.quant_gemv
    .venv/bin/python -m benchmarks.quant_gemv --nn

All kernels alternate pass by pass; best of --repeats passes. G weights/s = weights / time.
"""
import argparse

import torch

import kt_ops
from benchmarks.common import add_expert_stack_arguments, cpu_model, expert_stack, one_thread, text_table, time_pass
from kt_ops import quantization

FORMATS = (("fp8", None), ("int8", None), ("int4", 32))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_expert_stack_arguments(p, experts=32)
    p.add_argument("--rows", type=int, default=1, help="decode rows (x rows), 1-4")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--nn", action="store_true", help="d·w (backward's input gradient) instead of x·wᵀ")
    args = p.parse_args(argv)
    with one_thread():
        gen = torch.Generator().manual_seed(0)
        w = expert_stack(args, gen)
        x = torch.randn(args.rows, args.hidden, generator=gen).to(torch.bfloat16)
        isa = kt_ops.cpu_isa()
        kernels = nn_kernels(args, w, gen, isa) if args.nn else nt_kernels(x, w, isa)
        first = next(iter(kernels))
        best = {(k, where): float("inf") for k in kernels for where in ("memory", "cache")}
        for _ in range(args.repeats):
            for k, fn in kernels.items():
                for where, experts in (("memory", range(args.experts)), ("cache", [0] * args.experts)):
                    best[(k, where)] = min(best[(k, where)], time_pass(fn, experts))
        n = args.intermediate * args.hidden
        rows = []
        for k in kernels:
            row = {"kernel": k}
            for where in ("memory", "cache"):
                t = best[(k, where)]
                row[f"{where}_ms"] = f"{t * 1e3:.4g}"  # .4g: a tiny test shape never prints as 0
                row[f"{where}_gw"] = f"{n / t / 1e9:.4g}"
                row[f"{where}_x"] = f"{best[(first, where)] / t:.2f}x"
            rows.append(row)
        what = "rows of d·w" if args.nn else "decode row(s)"
        print(f"one thread, {args.rows} {what}, weight [{args.intermediate}, {args.hidden}], "
              f"{args.experts} experts, kt_ops path {isa}, CPU {cpu_model()}")
        cols = [("kernel", "kernel"), ("memory_ms", "from memory ms"), ("memory_gw", "G weights/s"),
                ("memory_x", f"x {first}"), ("cache_ms", "from cache ms"), ("cache_gw", "G weights/s"),
                ("cache_x", f"x {first}")]
        print(text_table(rows, cols, {c for c, _ in cols if c != "kernel"}, lambda key, v: v))
        return rows


def nt_kernels(x, w, isa):
    """x·wᵀ: bf16's thin GEMV, then each format's decode GEMV."""
    kernels = {"bf16": lambda e: torch.ops.kt._thin_gemm_nt(x, w[e], torch.bfloat16, isa)}
    for fmt, group in FORMATS:
        data, scale = quantization.quantize(w, fmt, group)
        kernels[fmt] = (lambda d, s: lambda e: torch.ops.kt._quant_gemv_nt(x, d[e], s[e], isa))(data, scale)
    return kernels


def nn_kernels(args, w, gen, isa):
    """d·w per format by the panel GEMMs and by thin_gemm_nn (bf16 d, as kt.moe's backward)."""
    d = torch.randn(args.rows, args.intermediate, generator=gen).to(torch.bfloat16)
    kernels = {"bf16 panels": lambda e: torch.ops.kt._panel_mm_nn(d, w[e], None),
               "bf16 thin": lambda e: torch.ops.kt._thin_gemm_nn(d, w[e], None, isa, None)}
    for fmt, group in FORMATS:
        data, scale = quantization.quantize(w, fmt, group)
        kernels[f"{fmt} panels"] = (lambda q, s: lambda e: torch.ops.kt._quant_mm_nn(d, q[e], s[e], None))(data, scale)
        kernels[f"{fmt} thin"] = (lambda q, s: lambda e: torch.ops.kt._thin_gemm_nn(d, q[e], s[e], isa, None))(data, scale)
    return kernels


if __name__ == "__main__":
    main()
