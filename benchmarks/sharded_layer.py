"""Sharded experts against one owner, side by side: a KTMoE layer's LoRA forward + backward on 2
gloo ranks of this machine, T tokens split evenly over the ranks.

* ``one owner, 2 threads``: expert_shards=1; rank 0 holds all experts and computes with 2
  threads, rank 1 sends its tokens and waits (1 thread);
* ``2 shards, 1 thread each``: expert_shards=2; each rank holds half of the experts and
  computes its half of every token's slots with 1 thread (the same 2 cores in all).

Each configuration runs in its own pair of processes (the thread counts differ), the two
alternating ``--repeats`` times; a run times ``--steps`` steps after one untimed step and
reports the median. tokens/s = T / step time. Also printed: the bytes the all-to-all moves
per token per layer (forward + backward, both directions, summed over ranks, divided by T).

    .venv/bin/python -m benchmarks.sharded_layer                 # Qwen3-30B-A3B layer, T=1024
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

from benchmarks.common import cpu_model

CONFIGS = {"one owner, 2 threads": (1, {0: 2, 1: 1}), "2 shards, 1 thread each": (2, {0: 1, 1: 1})}


def _rank(rank, port, shards, threads, args, dtype_name, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch.distributed as dist

    import kt_ops
    from kt_ops import collectives

    torch.set_num_threads(threads[rank])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    torch.manual_seed(0)
    with torch.device("meta"):  # no init draw: the weights' values do not change the time
        layer = kt_ops.KTMoE(args.hidden, args.intermediate, args.experts, args.top_k, lora_rank=args.lora_rank,
                             dtype=dtype, expert_shards=shards)
    for name, p in list(layer.named_parameters(recurse=False)):
        value = torch.randn(p.shape, dtype=torch.float32).mul_(p.shape[-1] ** -0.5 if p.dim() == 3 else 0.0)
        setattr(layer, name, torch.nn.Parameter(value.to(p.dtype), requires_grad=p.requires_grad))
    layer.gate.weight = torch.nn.Parameter(torch.randn(args.experts, args.hidden, dtype=dtype) * args.hidden ** -0.5)
    layer.register_gradient_hooks()
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens // 2, args.hidden, generator=gen).to(dtype).requires_grad_(True)
    sent = {"bytes": 0}
    original = collectives._all_to_all

    def counting(out, rows, out_splits, in_splits, group):  # bytes this rank sends to the others
        sent["bytes"] += sum(n for r, n in enumerate(in_splits) if r != rank) * rows[0].numel() * rows.element_size() \
            if rows.shape[0] else 0
        return original(out, rows, out_splits, in_splits, group)

    collectives._all_to_all = counting
    from kt_ops import shard_collectives
    shard_collectives._all_to_all = counting
    times = []
    for step in range(args.steps + 1):
        sent["bytes"] = 0
        dist.barrier()
        start = time.perf_counter()
        layer(x).float().sum().backward()
        elapsed = time.perf_counter() - start
        if step:
            times.append(elapsed)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    totals = [torch.tensor([float(sent["bytes"])]), torch.tensor([statistics.median(times)])]
    for t in totals:
        dist.all_reduce(t)
    if rank == 0:
        queue.put((totals[1].item() / 2, totals[0].item() / args.tokens))
    dist.destroy_process_group()


def run_config(shards, threads, args, dtype_name):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, shards, threads, args, dtype_name, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
        if p.exitcode != 0:
            raise RuntimeError(f"benchmark rank exited with {p.exitcode}")
    return queue.get()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; layer H={args.hidden} I={args.intermediate} E={args.experts} "
          f"K={args.top_k} r={args.lora_rank}; T={args.tokens} over 2 ranks; LoRA forward+backward")
    for dtype_name in args.dtypes.split(","):
        results = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):  # alternating, so that both see the same machine load
            for name, (shards, threads) in CONFIGS.items():
                results[name].append(run_config(shards, threads, args, dtype_name))
        base = statistics.median(args.tokens / t for t, _ in results["one owner, 2 threads"])
        for name, runs in results.items():
            rates = [args.tokens / t for t, _ in runs]
            rows.append(dict(dtype=dtype_name, config=name, tokens_per_s=statistics.median(rates), runs=rates,
                             bytes_per_token=runs[0][1], ratio=statistics.median(rates) / base))
    print("| dtype | configuration | tokens/s (median) | runs | vs one owner | all-to-all bytes / token / layer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['config']} | {r['tokens_per_s']:.0f} | {' / '.join(f'{v:.0f}' for v in r['runs'])} "
              f"| {r['ratio']:.3f} | {r['bytes_per_token']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
