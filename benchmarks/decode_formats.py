"""Decode forward of kt.moe per expert format: bf16 experts against the same weights in fp8,
int8, int4 (groups of 32), mxfp4 and nvfp4, at T decode tokens, with a fresh random routing every call (so
each call reads the experts it routes to from memory, as decoding does) and the formats
alternating call by call in one process, so that they all see the same machine load.

    .venv/bin/python -m benchmarks.decode_formats --tokens 1 4 16      # Qwen3-30B-A3B layer

Prints one line per token count and thread count: each format's median milliseconds per call
and its speed relative to bf16 (> 1: faster).
"""
import argparse
import statistics
import time

import torch

import kt_ops
from benchmarks.common import cpu_model
from kt_ops import quantization

FORMATS = (("bf16", None), ("fp8", None), ("int8", None), ("int4", 32), ("mxfp4", None), ("nvfp4", None))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (8 calls per format each)")
    p.add_argument("--formats", nargs="+", default=None, help="formats to time beside bf16 (default: all)")
    p.add_argument("--isas", nargs="+", default=None,
                   help="kt_ops paths to alternate with the formats in the same rounds (default: the active one)")
    args = p.parse_args(argv)
    isas = args.isas or [kt_ops.cpu_isa()]
    formats = [(f, g) for f, g in FORMATS if f == "bf16" or args.formats is None or f in args.formats]
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(E, I, H, generator=gen).to(torch.bfloat16) * 0.02,
             torch.randn(E, I, H, generator=gen).to(torch.bfloat16) * 0.02,
             torch.randn(E, H, I, generator=gen).to(torch.bfloat16) * 0.02]
    experts = {fmt: [quantization.quantize(t, fmt, group) if fmt != "bf16" else (t, None) for t in dense]
               for fmt, group in formats}
    print(f"kt.moe decode forward, E={E} H={H} I={I} K={K}, bf16 activations, path {' / '.join(isas)}, "
          f"CPU {cpu_model()}; median ms per call (x bf16 speed)")
    for T in args.tokens:
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        routings = [(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]),
                     torch.rand(T, K, generator=gen).softmax(-1)) for _ in range(64)]

        def call(fmt, i):
            (g, gs, *gg), (u, us, *ug), (d, ds, *dg) = experts[fmt]
            globals_ = dict(zip(("gate_global_scale", "up_global_scale", "down_global_scale"), gg + ug + dg))
            ids, w = routings[i % len(routings)]
            return kt_ops.moe(x, ids, w, g, u, d, None, None, None, None, None, None, 1.0, gs, us, ds, **globals_)

        for threads in args.threads:
            torch.set_num_threads(threads)
            variants = [(isa, fmt) for isa in isas for fmt, _ in formats]
            for isa, fmt in variants:  # warm-up
                with kt_ops.use_cpu_isa(isa):
                    call(fmt, 0)
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                for isa, fmt in variants:
                    with kt_ops.use_cpu_isa(isa):
                        t0 = time.perf_counter()
                        for i in range(8):
                            call(fmt, r * 8 + i)
                        times[isa, fmt].append((time.perf_counter() - t0) / 8)
            med = {v: statistics.median(t) for v, t in times.items()}
            for isa in isas:
                cells = "  ".join(f"{fmt} {med[isa, fmt] * 1e3:.2f} ms ({med[isa, 'bf16'] / med[isa, fmt]:.2f}x)"
                                  for fmt, _ in formats)
                print(f"T={T:<3} threads={threads}  {isa + '  ' if len(isas) > 1 else ''}{cells}")


if __name__ == "__main__":
    main()
