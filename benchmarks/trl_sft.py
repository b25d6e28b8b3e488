"""TRL's SFTTrainer on a kt-patched model, with and without packing, side by side.

The built-in demo model (kt_ops.finetune's Qwen3-MoE: H=256, 16 experts, top-4, 4 layers) with
its experts on kt (expert LoRA r=8) and PEFT LoRA on the attention projections (TRL's
``peft_config`` path), fp32, trained on the shipped corpus cut into its sentences (variable
lengths: what padding wastes and packing saves), ``--max-length`` tokens at most each:

* ``padded``: ``packing=False``: a batch of ``--batch-size`` sentences padded to its longest;
* ``packed``: ``packing=True, padding_free=True`` (TRL's best-fit packing; no padding, the
  per-sequence attention built from the position ids).

Each configuration runs in its own process, the two alternating ``--repeats`` times; a run
trains ``--steps`` steps and times those after the first two. tokens/s counts the tokens
trained on (not padding: TRL's ``num_tokens``). Prints the median and the spread of the runs.

    .venv/bin/python -m benchmarks.trl_sft
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks.common import cpu_model

CONFIGS = {"padded": False, "packed": True}
WARMUP = 2


def _one_run(args) -> dict:
    """One training run in this process: {"tokens_per_s", "tokens", "seconds"}."""
    import time

    import peft
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    import kt_ops
    from kt_ops.finetune.cli import build_base_model
    from kt_ops.finetune.data import corpus_sentences
    from kt_ops.finetune.hf_tokenizer import byte_tokenizer

    torch.set_num_threads(args.threads)
    sentences = [s for s in corpus_sentences() if len(s) > 8]
    data = Dataset.from_list([{"text": s} for s in sentences])
    model = build_base_model(argparse.Namespace(model=None, model_config=None, dtype="float32", seed=0))
    model = kt_ops.patch_model(model, lora_rank=8, lora_alpha=16)

    marks = []

    class Clock(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                marks.append((time.perf_counter(), float(logs["num_tokens"])))

    config = trl.SFTConfig(
        output_dir=args.scratch, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
        max_length=args.max_length, packing=args.packed, padding_free=args.packed, dataset_text_field="text",
        activation_checkpointing=True, seed=0, data_seed=0, dataloader_num_workers=0,
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=byte_tokenizer(),
                             peft_config=peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                             callbacks=[Clock()])
    trainer.train()
    (t0, n0), (t1, n1) = marks[WARMUP - 1], marks[-1]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0), "tokens": n1 - n0, "seconds": t1 - t0}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one-run", choices=list(CONFIGS), help=argparse.SUPPRESS)  # the child process
    p.add_argument("--scratch", default="/tmp/kt_trl_sft_bench", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_run:
        args.packed = CONFIGS[args.one_run]
        print("RESULT " + json.dumps(_one_run(args)))
        return []
    runs = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name in CONFIGS:  # alternating
            cmd = [sys.executable, "-m", "benchmarks.trl_sft", "--one-run", name, "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
                   "--threads", str(args.threads)]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} run failed:\n{proc.stderr[-4000:]}")
            line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
            runs[name].append(json.loads(line[len("RESULT "):]))
    rows = []
    print(f"TRL SFTTrainer, kt-patched demo model (fp32, expert LoRA r=8 + attention LoRA), {args.threads} threads, "
          f"batch {args.batch_size}, max_length {args.max_length}, steps {WARMUP + 1}-{args.steps} timed, "
          f"{args.repeats} alternating runs; CPU: {cpu_model()}")
    print(f"| {'mode':<7} | tokens/s median | min - max | tokens/step |")
    print("|---|---:|---:|---:|")
    for name, results in runs.items():
        speeds = [r["tokens_per_s"] for r in results]
        per_step = statistics.median(r["tokens"] for r in results) / (args.steps - WARMUP)
        rows.append({"config": name, "median": statistics.median(speeds), "min": min(speeds), "max": max(speeds),
                     "tokens_per_step": per_step})
        print(f"| {name:<7} | {statistics.median(speeds):.0f} | {min(speeds):.0f} - {max(speeds):.0f} | {per_step:.0f} |")
    ratio = rows[1]["median"] / rows[0]["median"]
    print(f"packed / padded: {ratio:.2f}x")
    return rows


if __name__ == "__main__":
    main()
