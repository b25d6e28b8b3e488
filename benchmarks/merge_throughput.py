"""Merge throughput: GB of base checkpoint merged per minute by ``kt_ops.hf.merge_adapter``, for a
bf16 and an FP8 base, and the merge's peak resident memory, each merge in a fresh process.

    python -m benchmarks.merge_throughput [--smoke] [--runs 3] [--dir DIR]

The base is a synthetic Qwen3-MoE (random weights, hidden 1024, 64 experts of intermediate 512,
6 layers: 1.13 GiB of bf16 experts) saved by transformers in shards of 300 MB; its FP8 twin is
written by the merge itself (``output_format="fp8"``, an adapter of zeros). The adapter is
rank 8 on every expert and on q/k/v/o. Runs alternate between the cases; the table gives the
median and the spread. The base is read from the page cache after the first run (a warm read:
the disk is not measured).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

from benchmarks.common import cpu_model

CONFIG = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
              num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=64,
              num_experts_per_tok=4, tie_word_embeddings=False, max_position_embeddings=128)
SMOKE = dict(CONFIG, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             vocab_size=96)
RANK = 8
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# One merge in a fresh process: seconds and the peak resident size (VmHWM) as JSON on stdout.
_MERGE = """
import json, sys, time
import kt_ops
base, adapter, out, fmt = sys.argv[1:5]
start = time.perf_counter()
summary = kt_ops.hf.merge_adapter(base, adapter, out, output_format=fmt, progress=False, overwrite=True)
seconds = time.perf_counter() - start
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak": peak, "merged": len(summary.merged)}))
"""


def write_base(path: str, config: dict, shard_size: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config), dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size=shard_size)


def write_adapter(path: str, config: dict, scale: float) -> None:
    """A PEFT-layout adapter (kt's expert LoRA and PEFT's on attention) of random factors
    (``scale`` 0: B = 0, the merge changes nothing)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    H, I, E = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q)}
    state = {}

    def pair(key, out, inp, experts=1):  # PEFT's layout: A [r·E, in], B [out, r·E]
        state[f"{key}.lora_A.weight"] = torch.randn(RANK * experts, inp, generator=g) * 0.02
        state[f"{key}.lora_B.weight"] = torch.randn(out, RANK * experts, generator=g) * scale

    for layer in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}"
        for name, (out, inp) in shapes.items():
            pair(f"{prefix}.self_attn.{name}", out, inp)
        pair(f"{prefix}.mlp.experts.base_layer", 2 * I, H, E)  # gate_up_proj
        pair(f"{prefix}.mlp.experts", H, I, E)  # down_proj
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(ATTENTION),
                   "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}, f)


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def merge_once(base: str, adapter: str, out: str, fmt: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _MERGE, base, adapter, out, fmt], check=True, capture_output=True,
                          text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one run (checks the script runs)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    args = parser.parse_args(argv)
    config, shard, runs = (SMOKE, "50KB", 1) if args.smoke else (CONFIG, "300MB", args.runs)
    root = tempfile.mkdtemp(prefix="kt_merge_bench_", dir=args.dir)
    try:
        base, adapter, zeros = (os.path.join(root, n) for n in ("bf16", "adapter", "zeros"))
        write_base(base, config, shard)
        write_adapter(adapter, config, scale=0.02)
        write_adapter(zeros, config, scale=0.0)
        fp8 = os.path.join(root, "fp8")
        merge_once(base, zeros, fp8, "fp8")
        cases = [("bf16", base, "same"), ("fp8", fp8, "same"), ("fp8", fp8, "bf16")]
        results = {c: [] for c in cases}
        for _ in range(runs):
            for case in cases:
                results[case].append(merge_once(case[1], adapter, os.path.join(root, "out"), case[2]))
        rows, records = [], []
        for (name, path, fmt), got in results.items():
            gb = checkpoint_bytes(path) / 1e9
            seconds = [r["seconds"] for r in got]
            shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
            largest = max(os.path.getsize(os.path.join(path, f)) for f in shards)
            rows.append([name, fmt, f"{gb:.2f}", str(len(shards)), f"{statistics.median(seconds):.1f}",
                         f"{gb / statistics.median(seconds) * 60:.1f}",
                         f"{(max(seconds) - min(seconds)) / statistics.median(seconds) * 100:.0f}%",
                         f"{max(r['peak'] for r in got) / 2**20:.0f}", f"{largest / 2**20:.0f}"])
            records.append({"base": name, "output": fmt, "seconds": seconds, "peak": max(r["peak"] for r in got),
                            "merged": got[0]["merged"]})
        print(f"merge_adapter throughput on {cpu_model()} ({os.cpu_count()} CPUs), median of {runs}, warm page cache")
        headers = ["base", "output", "GB", "shards", "s", "GB/min", "spread", "peak MiB", "largest shard MiB"]
        print("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
        print("\n".join("| " + " | ".join(row) + " |" for row in rows))
        return records
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
