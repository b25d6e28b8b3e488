"""What recycling kt.moe's large per-call buffers (csrc/platform/large_alloc.h) saves: the same
step with the buffers of the previous step reused, and with them unmapped first
(kt_ops.release_cached_buffers()), so that the step writes fresh memory as it would without
the cache. The two alternate in one process, so both see the same machine load.

    .venv/bin/python -m benchmarks.buffer_reuse            # Qwen3-30B-A3B layer, T=1024

Full mode returns 1.2 GiB of weight gradients per step there; LoRA mode only recycles the
saved activations.
"""
import argparse
import statistics
import time

import kt_ops
from benchmarks.common import add_layer_arguments, kt_step, layer_problem


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(p)
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    prob = layer_problem(args)
    rows = []
    for mode in args.modes.split(","):
        step = kt_step(prob, mode)
        for _ in range(3):  # warm-up; kt.moe packs unchanged weights on its third call
            step()
        times = {"reused": [], "fresh": []}
        for _ in range(args.repeats):
            for variant in times:
                if variant == "fresh":
                    kt_ops.release_cached_buffers()
                t0 = time.perf_counter()
                step()
                times[variant].append(time.perf_counter() - t0)
        reused, fresh = (statistics.median(times[v]) for v in times)
        rows.append((mode, reused, fresh))
        print(f"{mode:5s} reused buffers {reused * 1e3:8.1f} ms | fresh buffers {fresh * 1e3:8.1f} ms | "
              f"fresh/reused {fresh / reused:.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
