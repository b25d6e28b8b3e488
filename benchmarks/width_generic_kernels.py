"""The kernels written once for both vector widths (csrc/kernels/*-inl.h over simd::F32x8 /
F32x16), per instruction-set path, one thread: the int4 decode GEMV on float32 x
(quant_gemv_int4-inl.h; a Qwen3-30B-A3B expert gate weight per call, from memory) and SwiGLU
forward / backward (swiglu-inl.h; [--rows, intermediate] bf16). Best of --repeats passes.

    .venv/bin/python -m benchmarks.width_generic_kernels

To compare two builds of the C++ library, run it alternately with and without
``KT_OPS_TEST_LIBRARY=<the other build's _C.abi3.so>`` (only the library changes).
"""
import argparse
import os
import time

import torch

import kt_ops  # noqa: F401  (the kt ops)
from benchmarks.common import add_expert_stack_arguments, cpu_model, expert_stack, one_thread, text_table, time_pass
from kt_ops import quantization
from kt_ops.cpu_isa import supported_cpu_isas


def best_of(repeats: int, run) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run`` after one untimed call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def int4_rows(args, paths, gen):
    w = expert_stack(args, gen)
    experts = range(args.experts)
    rows = []
    for group in (32, 128):
        data, scale = quantization.quantize(w, "int4", group)
        for scale_dtype in (torch.float32, torch.bfloat16):
            s = scale.to(scale_dtype)
            for m in (1, 4):
                x = torch.randn(m, args.hidden, generator=gen)  # float32 x: the width-generic kernel
                for isa in paths:
                    def call(e, isa=isa):
                        return torch.ops.kt._quant_gemv_nt(x, data[e], s[e], isa)
                    time_pass(call, experts)  # untimed
                    ms = 1e3 * min(time_pass(call, experts) for _ in range(args.repeats))
                    rows.append({"kernel": f"int4 gemv g{group} {str(scale_dtype)[6:]} scales x{m}", "path": isa,
                                 "ms": ms})
    return rows


def swiglu_rows(args, paths, gen):
    n, i = args.rows, args.intermediate
    g, u, dh = (torch.randn(n, i, generator=gen).bfloat16() for _ in range(3))
    w = torch.rand(n, generator=gen)
    rows = []
    for limit in (None, 7.0):
        for isa in paths:
            fwd = best_of(args.repeats, lambda: torch.ops.kt._swiglu_forward(g, u, isa, limit))
            bwd = best_of(args.repeats, lambda: torch.ops.kt._swiglu_backward(g, u, dh, w, True, True, isa, limit))
            rows.append({"kernel": f"swiglu forward, limit {limit}", "path": isa, "ms": 1e3 * fwd})
            rows.append({"kernel": f"swiglu backward, limit {limit}", "path": isa, "ms": 1e3 * bwd})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_expert_stack_arguments(p, experts=32)
    p.add_argument("--rows", type=int, default=2048, help="SwiGLU rows")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    paths = [isa for isa in ("avx2", "avx512", "avx512_bf16") if isa in supported_cpu_isas()]
    with one_thread():
        gen = torch.Generator().manual_seed(0)
        rows = int4_rows(args, [isa for isa in paths if isa != "avx512_bf16"], gen) + swiglu_rows(args, paths, gen)
    library = os.environ.get("KT_OPS_TEST_LIBRARY") or "kt_ops._C"
    print(f"One thread, CPU {cpu_model()}, library {library}; int4 gemv: ms per expert call on the avx2 "
          "and avx512 paths (avx512_bf16 runs the avx512 kernel on float32 x), SwiGLU: ms per call")
    print(text_table(rows, [("kernel", "kernel"), ("path", "path"), ("ms", "ms")], {"ms"},
                     lambda k, v: f"{v:.4f}" if k == "ms" else str(v)))
    return rows


if __name__ == "__main__":
    main()
