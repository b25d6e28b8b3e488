"""Sharded experts against one owner, side by side: a KTMoE layer's LoRA forward + backward on 2
gloo ranks of this machine, T tokens split evenly over the ranks.

* ``one owner, 2 threads``: expert_shards=1; rank 0 holds all experts and computes with 2
  threads, rank 1 sends its tokens and waits (1 thread);
* ``2 shards, 1 thread each``: expert_shards=2; each rank holds half of the experts and
  computes its half of every token's slots with 1 thread (the same 2 cores in all);
* ``one process, 2 threads``: the same layer on all T tokens in a single process, no
  collectives: what the one-owner layer is measured against;
* ``kt.moe alone, 2 threads``: only the layer's kt.moe call (forward + backward) on all T tokens,
  on the routing its router gives (computed once, untimed): the op alone at the owner's threads.

Also printed, per rank over the timed steps: its CPU share (CPU seconds / wall seconds, all its
threads, 1.0 = one core), the time a step spends blocked in kt collectives and the CPU share
meanwhile (``kt_ops.faults.waiting_time``), and the store queries a second its failure checks made
(``kt_ops.faults.store_queries``, a counter), and the CPU share of this parent process while it
waits for the ranks.

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
import resource
import statistics
import time

import torch
import torch.multiprocessing as mp

from benchmarks.common import cpu_model

# name: (expert shards, threads of each rank)
CONFIGS = {"one owner, 2 threads": (1, {0: 2, 1: 1}), "2 shards, 1 thread each": (2, {0: 1, 1: 1}),
           "one process, 2 threads": (1, {0: 2}), "kt.moe alone, 2 threads": (1, {0: 2})}
ALONE = "one process, 2 threads"
OP_ALONE = "kt.moe alone, 2 threads"  # the layer's kt.moe call only, on routing computed once


def _cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _rank(rank, port, shards, threads, args, dtype_name, queue, op_only=False):
    world = len(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    import kt_ops
    from kt_ops import collectives, faults

    torch.set_num_threads(threads[rank])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
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
    x = torch.randn(args.tokens // world, args.hidden, generator=gen).to(dtype).requires_grad_(True)
    sent = {"bytes": 0}
    original = collectives._all_to_all

    def counting(out, rows, out_splits, in_splits, group):  # bytes this rank sends to the others
        sent["bytes"] += sum(n for r, n in enumerate(in_splits) if r != rank) * rows[0].numel() * rows.element_size() \
            if rows.shape[0] else 0
        return original(out, rows, out_splits, in_splits, group)

    collectives._all_to_all = counting
    from kt_ops import shard_collectives
    shard_collectives._all_to_all = counting
    run_step = lambda: layer(x)  # noqa: E731
    if op_only:  # kt.moe on the routing the layer's router gives, computed once outside the timing
        with torch.no_grad():
            weights, ids = layer.gate(x)
        run_step = lambda: layer._experts(x, ids, weights)  # noqa: E731
    times, cpu, queries, waited = [], 0.0, 0, [0.0, 0.0]
    for step in range(args.steps + 1):
        sent["bytes"] = 0
        dist.barrier()
        start, cpu_start, queries_start = time.perf_counter(), _cpu_seconds(), faults.store_queries()
        waited_start = faults.waiting_time()
        run_step().float().sum().backward()
        elapsed = time.perf_counter() - start
        if step:
            times.append(elapsed)
            cpu += _cpu_seconds() - cpu_start
            queries += faults.store_queries() - queries_start
            waited = [total + now - then for total, now, then in zip(waited, faults.waiting_time(), waited_start)]
        x.grad = None
        layer.zero_grad(set_to_none=True)
    share = torch.zeros(4, world)  # per rank: CPU share, store queries a second, waiting: seconds, CPU share
    share[0, rank], share[1, rank] = cpu / sum(times), queries / sum(times)
    share[2, rank], share[3, rank] = waited[0] / args.steps, waited[1] / max(waited[0], 1e-9)
    totals = [torch.tensor([float(sent["bytes"])]), torch.tensor([statistics.median(times)]), share]
    for t in totals:
        dist.all_reduce(t)
    if rank == 0:
        queue.put(dict(seconds=totals[1].item() / world, bytes=totals[0].item() / args.tokens,
                       cpu_share=totals[2][0].tolist(), queries_per_s=totals[2][1].tolist(),
                       wait_s=totals[2][2].tolist(), wait_share=totals[2][3].tolist()))
    dist.destroy_process_group()


def run_config(shards, threads, args, dtype_name, op_only=False):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, shards, threads, args, dtype_name, queue, op_only))
             for r in range(len(threads))]
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)  # sleeps on the process's sentinel: this parent uses no CPU meanwhile
        if p.exitcode != 0:
            raise RuntimeError(f"benchmark rank exited with {p.exitcode}")
    result = queue.get()
    result["parent_share"] = (_cpu_seconds() - cpu_start) / (time.perf_counter() - start)
    return result


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
                results[name].append(run_config(shards, threads, args, dtype_name, op_only=name == OP_ALONE))
        base = statistics.median(args.tokens / r["seconds"] for r in results[ALONE])
        op_base = statistics.median(args.tokens / r["seconds"] for r in results[OP_ALONE])
        for name, runs in results.items():
            rates = [args.tokens / r["seconds"] for r in runs]
            rows.append(dict(dtype=dtype_name, config=name, tokens_per_s=statistics.median(rates), runs=rates,
                             bytes_per_token=runs[0]["bytes"], ratio=statistics.median(rates) / base,
                             op_ratio=statistics.median(rates) / op_base,
                             cpu_share=[statistics.median(r["cpu_share"][k] for r in runs)
                                        for k in range(len(runs[0]["cpu_share"]))],
                             queries_per_s=[max(r["queries_per_s"][k] for r in runs)
                                            for k in range(len(runs[0]["queries_per_s"]))],
                             parent_share=max(r["parent_share"] for r in runs),
                             wait=[(statistics.median(r["wait_s"][k] for r in runs),
                                    statistics.median(r["wait_share"][k] for r in runs))
                                   for k in range(len(runs[0]["wait_s"]))]))
    print(f"| dtype | configuration | tokens/s (median) | runs | vs {ALONE} | vs {OP_ALONE} "
          "| all-to-all bytes / token / layer "
          "| CPU share per rank (median) | waiting in kt collectives per rank: s/step, CPU share meanwhile (median) "
          "| store queries/s per rank (max) | parent's CPU share (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['config']} | {r['tokens_per_s']:.0f} | {' / '.join(f'{v:.0f}' for v in r['runs'])} "
              f"| {r['ratio']:.3f} | {r['op_ratio']:.3f} | {r['bytes_per_token']:.0f} | {' / '.join(f'{v:.2f}' for v in r['cpu_share'])} "
              f"| {' / '.join(f'{s:.2f} s, {c:.3f}' for s, c in r['wait'])} "
              f"| {' / '.join(f'{v:.1f}' for v in r['queries_per_s'])} | {r['parent_share']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
