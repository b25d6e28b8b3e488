"""A TRL run (DPOTrainer or SFTTrainer, stock) on a tiny Qwen3-MoE, for tests/test_trl.py:
``python tests/trl_run.py OUT --side kt|plain --trainer dpo|sft --wrap model|peft_config`` in one
process or under ``torch.distributed.run``.

Both sides start from one adapter (LoRA on q_proj / v_proj and on the experts, nonzero B,
written by plain PEFT): ``plain`` is the unpatched model under PEFT, ``kt`` the patched one.
``--wrap model``: the model is already a PEFT model with that adapter (kt:
``kt_ops.load_adapter``; plain: ``PeftModel.from_pretrained``); DPOTrainer with
``ref_model=None`` then adds a ``"ref"`` copy of it. ``--wrap peft_config``: the trainer wraps
the model from a ``LoraConfig`` itself (kt: attention only, the experts' LoRA is kt's; plain:
attention and experts), and the adapter's values are loaded into the wrapped model before
training; DPO's reference is then the model with the adapter disabled.

Rank 0 writes OUT/result.json: the logged metrics per step. The per-device batch is the global
batch / world size, so every world size trains on the same pairs per step.
"""
import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GLOBAL_BATCH, STEPS, R, ALPHA, VOCAB = 4, 3, 4, 8, 259
ATTENTION = ["q_proj", "v_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")


def base_model():
    import checkpoint_samples as samples

    return samples.tiny_qwen3_moe(vocab_size=VOCAB).train()


def write_adapter(folder: str) -> None:
    """The shared starting adapter, by plain PEFT on the unpatched model (rank 0 writes it)."""
    import peft
    from moe_testing import randomize_lora

    model = peft.get_peft_model(base_model(), peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                              target_modules=ATTENTION, target_parameters=EXPERTS))
    randomize_lora(model, lambda name: "lora_B" in name, seed=5, scale=0.2)
    model.save_pretrained(folder)


def model_and_config(side: str, wrap: str, adapter: str):
    """(the model to hand the trainer, its peft_config or None)."""
    import peft

    import kt_ops

    base = base_model()
    if side == "kt":
        base = kt_ops.patch_model(base, lora_rank=R, lora_alpha=ALPHA)
    if wrap == "model":
        if side == "kt":
            return kt_ops.load_adapter(base, adapter).train(), None
        return peft.PeftModel.from_pretrained(base, adapter, is_trainable=True).train(), None
    targets = {} if side == "kt" else {"target_parameters": EXPERTS}
    return base, peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION, **targets)


def load_values(side: str, model, adapter: str) -> None:
    """The shared adapter's values into a model the trainer wrapped (``--wrap peft_config``)."""
    import kt_ops

    if side == "kt":
        kt_ops.load_adapter(model, adapter)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(os.path.join(adapter, "adapter_model.safetensors")))
    assert not result.unexpected_keys, result.unexpected_keys


def dpo_data(pairs: int):
    from datasets import Dataset

    from kt_ops.finetune.data.preferences import read_preferences

    return Dataset.from_list(read_preferences()[:pairs])


def sft_data(samples: int):
    from datasets import Dataset

    from kt_ops.finetune.data import read_corpus

    words = read_corpus().split()
    return Dataset.from_list([{"text": " ".join(words[i * 4:(i + 1) * 4])} for i in range(samples)])


def letters_reward(completions, **kwargs):
    """GRPO's rule-based reward: the fraction of a completion's characters that are ASCII letters."""
    return [sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1) for text in completions]


def expert_lora(model):
    import kt_ops

    return {f"{name}.{n}": p.detach().clone() for name, experts in kt_ops.hf.patched_experts(model)
            for n, p in experts.expert_lora("default").named_parameters()}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--side", choices=["kt", "plain"], required=True)
    p.add_argument("--trainer", choices=["dpo", "sft", "grpo"], default="dpo")
    p.add_argument("--wrap", choices=["model", "peft_config"], default="model")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)

    import torch.distributed as dist
    import trl

    import kt_ops
    from kt_ops.finetune.hf_tokenizer import byte_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    adapter = os.path.join(args.out, "start_adapter")
    if world > 1:
        dist.init_process_group("gloo")
    if int(os.environ.get("RANK", "0")) == 0:
        write_adapter(adapter)
    if world > 1:
        dist.barrier()
    torch.manual_seed(0)
    model, peft_config = model_and_config(args.side, args.wrap, adapter)
    common = dict(output_dir=os.path.join(args.out, "trainer"), per_device_train_batch_size=GLOBAL_BATCH // world,
                  max_steps=args.steps, learning_rate=0.05, lr_scheduler_type="constant", optim="sgd",
                  weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, bf16=False, seed=0, data_seed=0, dataloader_num_workers=0, ddp_backend="gloo" if world > 1 else None,
                  # TRL checkpoints activations by default: with kt's policy (the experts' collectives
                  # must not be replayed in backward)
                  activation_checkpointing=True,
                  activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    tokenizer = byte_tokenizer()
    if args.trainer == "dpo":
        config = trl.DPOConfig(**common, beta=0.1, max_length=64)
        trainer = trl.DPOTrainer(model=model, ref_model=None, args=config, train_dataset=dpo_data(GLOBAL_BATCH * args.steps),
                                 processing_class=tokenizer, peft_config=peft_config)
    elif args.trainer == "grpo":
        config = trl.GRPOConfig(**common, num_generations=4, max_completion_length=8)
        prompts = [{"prompt": pair["prompt"]} for pair in dpo_data(GLOBAL_BATCH * args.steps)]
        from datasets import Dataset
        trainer = trl.GRPOTrainer(model=model, reward_funcs=letters_reward, args=config,
                                  train_dataset=Dataset.from_list(prompts), processing_class=tokenizer,
                                  peft_config=peft_config)
    else:
        config = trl.SFTConfig(**common, max_length=48, packing=args.packing,
                               padding_free=args.packing, dataset_text_field="text")
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=sft_data(GLOBAL_BATCH * args.steps * 2),
                                 processing_class=tokenizer, peft_config=peft_config)
    if args.wrap == "peft_config":
        load_values(args.side, trainer.model, adapter)
    before = expert_lora(trainer.model) if args.side == "kt" else {}
    trainer.train()
    if trainer.is_world_process_zero():
        logs = [{k: h[k] for k in METRICS + ("reward",) if k in h} for h in trainer.state.log_history if "loss" in h]
        after = expert_lora(trainer.model) if args.side == "kt" else {}
        moved = max(((after[k] - v).abs().max().item() for k, v in before.items()), default=0.0)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"world": world, "logs": logs, "expert_lora_change": moved}, f)


if __name__ == "__main__":
    main()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
