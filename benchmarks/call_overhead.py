"""What a decode call of kt.moe costs above its C++ kernel: the same int4 (or other format)
decode step called through each layer, the ways alternating in shuffled order within one
process, so that they all see the same machine load.

    .venv/bin/python -m benchmarks.call_overhead                 # Qwen3-30B-A3B layer, int4, T=1

Ways:
  kernel          torch.ops.kt._moe_forward_cpu: the C++ kernel alone
  kernel+range    the kernel inside a torch.profiler.record_function range, as kt.moe's
                  Python CPU kernel opened one on every call before (now only under a profiler)
  kt.moe          kt_ops.moe as a decode loop calls it: dispatcher, autograd formula, the
                  Python CPU kernel that reports failures to the other ranks, the kernel
  kt.moe no_grad  the same under torch.no_grad()
  kt.moe inference  the same under torch.inference_mode()

Each call routes the T tokens afresh, so the experts stream from memory as in decoding (the
Python layers then run with cold caches, which is why they cost more here than in a loop of
empty calls). Prints the median µs per call and the difference from the kernel alone.
"""
import argparse
import random
import statistics
import time

import torch

import kt_ops
from benchmarks.common import cpu_model
from kt_ops import quantization


def random_experts(fmt, shape, gen):
    """Quantized experts of random bits (much faster to make than quantizing random floats; the
    values do not change the work of a decode call)."""
    def small_bf16(*s):
        bits = torch.randint(0x3c00, 0x3d00, s, dtype=torch.int16, generator=gen)
        sign = torch.randint(0, 2, s, dtype=torch.int16, generator=gen) << 15
        return (bits | sign).view(torch.bfloat16)
    E, out, inp = shape
    if fmt == "bf16":
        return small_bf16(E, out, inp), None
    if fmt == "int4":
        return torch.randint(0, 256, (E, out, inp // 2), dtype=torch.uint8, generator=gen), small_bf16(E, out, inp // 32)
    if fmt == "int8":
        return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen), torch.rand(E, out, generator=gen) / 64
    if fmt == "fp8":
        codes = torch.randint(0, 0x7e, shape, dtype=torch.uint8, generator=gen) | (torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7)
        return codes.view(torch.float8_e4m3fn), torch.rand(E, -(-out // 128), -(-inp // 128), generator=gen) / 64
    raise ValueError(f"format: one of bf16, fp8, int8, int4 expected, got {fmt!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="int4", choices=("bf16", "fp8", "int8", "int4"))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=40, help="shuffled rounds of 10 calls per way")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    E, H, I, K, T = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    gen = torch.Generator().manual_seed(0)
    (g, gs), (u, us), (d, ds) = (random_experts(args.format, s, gen) for s in ((E, I, H), (E, I, H), (E, H, I)))
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    routings = [(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]),
                 torch.rand(T, K, generator=gen).softmax(-1)) for _ in range(64)]
    kernel = torch.ops.kt._moe_forward_cpu.default

    def kernel_call(i):
        ids, w = routings[i % 64]
        return kernel(x, ids, w, g, u, d, None, None, None, None, None, None, 1.0, False, gs, us, ds,
                      None, "silu", None, None, None, None)

    def ranged_kernel_call(i):
        with torch.profiler.record_function("kt.experts.forward"):
            return kernel_call(i)

    def moe_call(i):
        ids, w = routings[i % 64]
        return kt_ops.moe(x, ids, w, g, u, d, None, None, None, None, None, None, 1.0, gs, us, ds)

    def no_grad_call(i):
        with torch.no_grad():
            return moe_call(i)

    def inference_call(i):
        with torch.inference_mode():
            return moe_call(i)

    ways = {"kernel": kernel_call, "kernel+range": ranged_kernel_call, "kt.moe": moe_call,
            "kt.moe no_grad": no_grad_call, "kt.moe inference": inference_call}
    order = list(ways)
    for name in order:  # warm-up
        for i in range(5):
            ways[name](i)
    times = {name: [] for name in order}
    shuffle = random.Random(0)
    for r in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            for i in range(10):
                ways[name](r * 10 + i)
            times[name].append((time.perf_counter() - t0) / 10)
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"kt.moe decode call, {args.format} experts E={E} H={H} I={I} K={K}, T={T}, {args.threads} threads, "
          f"path {kt_ops.cpu_isa()}, CPU {cpu_model()}; median µs per call over {args.rounds} shuffled rounds")
    for name in ways:
        print(f"  {name:<18} {med[name]:8.0f} µs   {med[name] - med['kernel']:+6.0f} µs")
    return med


if __name__ == "__main__":
    main()
