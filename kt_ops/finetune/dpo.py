"""DPO of a kt-patched MoE model with TRL's ``DPOTrainer``, as it ships (``--trainer dpo``).

    python -m kt_ops.finetune --output-dir out/sft                    # the main job: SFT of the demo model
    python -m kt_ops.finetune --trainer dpo --adapter out/sft --output-dir out/dpo
    torchrun --nproc-per-node 2 -m kt_ops.finetune --trainer dpo     # 2 ranks (gloo); experts on rank 0

The model is the main job's (the built-in demo model from ``--seed``, or ``--model``) with its
experts on kt and LoRA on the experts (kt's) and on the attention projections (PEFT's, through
:func:`kt_ops.hf.get_peft_model`), started from ``--adapter`` when given (e.g. the main job's
output) and else from PEFT's initialisation. ``DPOTrainer`` gets it with ``ref_model=None``:
TRL adds a frozen ``"ref"`` copy of the adapter and computes the reference under
``set_adapter("ref")``, which kt's expert LoRA follows. Activations are checkpointed under
kt's policy (``kt_ops.checkpoint_context_fn``); the model runs eagerly.

The data are the preference pairs shipped with kt_ops (``kt_ops/finetune/data/preferences.jsonl``:
300 pairs from the shipped corpus; ``--data`` a JSON-lines file of ``prompt`` / ``chosen`` /
``rejected``), tokenized by the byte tokenizer of the demo model. Outputs (rank 0, in
``--output-dir``): the adapter (both LoRAs, PEFT's format, ``adapter_model.safetensors``) and
``summary.json`` (per-step loss, rewards, margins, accuracies; the same on the last 44 pairs,
held out of training, before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import kt_ops
from kt_ops.finetune.cli import DTYPES, build_base_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kt_ops.finetune --trainer dpo",
                                description="DPO of a kt-patched MoE model with TRL's DPOTrainer on the shipped "
                                            "preference pairs (or --data).")
    p.add_argument("--model", default=None, help="a Hugging Face MoE checkpoint folder (default: the demo model)")
    p.add_argument("--model-config", default=None, help=argparse.SUPPRESS)  # the demo model's, as the main job's
    p.add_argument("--adapter", default=None, help="start from this adapter (e.g. the main job's --output-dir)")
    p.add_argument("--data", default=None, help="JSON lines with prompt / chosen / rejected (default: shipped pairs)")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps (default: %(default)s: 2 epochs)")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per step, over all ranks (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (default: %(default)s)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=64, help="tokens per prompt + completion (default: %(default)s)")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the demo model's seed, as the main job's (default: 0)")
    p.add_argument("--output-dir", default="./kt_dpo_out", help="where the adapter and summary go")
    return p.parse_args(argv)


def build_model(args):
    """The patched model wrapped with PEFT: kt's expert LoRA and PEFT's attention LoRA."""
    import peft

    base = build_base_model(argparse.Namespace(model=args.model, model_config=args.model_config, dtype=args.dtype,
                                               seed=args.seed))
    torch.manual_seed(args.seed + 1)  # the LoRA draws, as the main job's
    model = kt_ops.patch_model(base, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    # Only the LoRA trains: PEFT's wrapping (in load_adapter or below) freezes everything else.
    if args.adapter:
        model = kt_ops.load_adapter(model, args.adapter)
    if not kt_ops.hf.adapters.is_peft_model(model):
        model = kt_ops.hf.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                                                lora_dropout=0.0, target_modules=ATTENTION))
    return model


HELD_OUT = 44  # of the shipped 300 pairs: evaluated before and after, never trained on


def read_pairs(path):
    """(training pairs, held-out pairs) as datasets: the last HELD_OUT pairs are held out."""
    from datasets import Dataset

    from kt_ops.finetune.data.preferences import read_preferences

    if path is None:
        pairs = read_preferences()
    else:
        with open(path, encoding="utf-8") as f:
            pairs = [json.loads(line) for line in f if line.strip()]
    if len(pairs) <= HELD_OUT:
        raise SystemExit(f"--data has {len(pairs)} pairs; it needs more than the {HELD_OUT} held out for evaluation")
    return Dataset.from_list(pairs[:-HELD_OUT]), Dataset.from_list(pairs[-HELD_OUT:])


def run(argv=None) -> dict:
    import trl

    from kt_ops.finetune.hf_tokenizer import byte_tokenizer

    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    model = build_model(args)
    if world > 1:
        kt_ops.distributed.set_owner_threads(model)
    config = trl.DPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size // world, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=args.beta, max_length=args.max_length,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=args.dtype == "bfloat16",
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, ddp_backend="gloo" if world > 1 else None,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    train, held_out = read_pairs(args.data)
    trainer = trl.DPOTrainer(model=model, ref_model=None, args=config, train_dataset=train, eval_dataset=held_out,
                             processing_class=byte_tokenizer())
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = trainer.evaluate()
    logs = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(args.output_dir)  # both LoRAs, in PEFT's format (the experts' owner writes them)
    held = {when: {k: m[f"eval_{k}"] for k in METRICS if f"eval_{k}" in m} for when, m in (("before", before),
                                                                                           ("after", after))}
    summary = {"steps": len(logs), "seconds": seconds, "world_size": world, "logs": logs, "held_out": held,
               "settings": {k: v for k, v in vars(args).items()}}
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        first, last = logs[0], logs[-1]
        print(f"kt_ops DPO: {len(logs)} steps in {seconds:.1f} s on {world} rank(s); training loss "
              f"{first['loss']:.4f} -> {last['loss']:.4f}; held-out pairs ({HELD_OUT}): loss "
              f"{held['before']['loss']:.4f} -> {held['after']['loss']:.4f}, reward margin "
              f"{held['before']['rewards/margins']:.4f} -> {held['after']['rewards/margins']:.4f}, accuracy "
              f"{held['before']['rewards/accuracies']:.2f} -> {held['after']['rewards/accuracies']:.2f}; "
              f"adapter in {args.output_dir}")
    return summary


def main(argv=None) -> int:
    run(argv)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
