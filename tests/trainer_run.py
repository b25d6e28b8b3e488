"""A Trainer run (kt_ops.hf.KTTrainer: the stock transformers.Trainer with kt's checkpoints) on
a patched tiny Qwen3-MoE (expert LoRA, optionally the routers too), for tests/test_trainer.py:
``python tests/trainer_run.py OUT [--train-router]`` in one process or under
``torch.distributed.run``; ``--nodes N`` splits the ranks into N "nodes" of consecutive ranks,
each with its own owner (one owner per node, the owners averaging their expert gradients), with
process groups built here; ``--owners per-node`` does the same from torchrun's own node layout; ``--expert-shards S`` splits
the experts over the first S ranks (rank r > 0 writes its expert shard with its replicated tensors).
Rank 0 writes OUT/result.pt: the logged losses and the trained tensors. The per-device batch
is the global batch / world size, so every world size trains on the same samples per step."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GLOBAL_BATCH, STEPS, SEQ = 4, 3, 12


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--train-router", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    p.add_argument("--attention-lora", action="store_true",
                   help="PEFT LoRA on q_proj / v_proj too (kt_ops.hf.get_peft_model)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--optim", default="sgd", help="the Trainer's optim (adamw_torch: optimizer state to resume)")
    p.add_argument("--nodes", type=int, default=1, help="one owner per node, NODES nodes of consecutive ranks")
    p.add_argument("--owners", choices=["rank0", "per-node"], default=None,
                   help="the placement by name (kt_ops.placement: per-node from torchrun's --nnodes layout), "
                        "the model built before the Trainer sets up the process group")
    p.add_argument("--expert-shards", type=int, default=1, help="the experts split over the first S ranks")
    args = p.parse_args(argv)

    import transformers

    import kt_ops
    from test_ddp_fsdp import build_model, set_trainable

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.owners and args.nodes != 1:
        p.error("--owners and --nodes are two ways of placing the owners: give one")
    placement = dict(owners=args.owners) if args.owners else node_groups(args.nodes, world)
    model = build_model(**placement, expert_shards=args.expert_shards)
    if args.attention_lora and args.train_router:
        p.error("--attention-lora and --train-router are separate cases")
    model = set_trainable(model, "lora+peft-attention" if args.attention_lora
                          else "lora+replicated" if args.train_router else "lora")
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, 96, (GLOBAL_BATCH * args.steps, SEQ), generator=gen)]
    training_args = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", optim=args.optim, weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, ddp_backend="gloo" if world > 1 else None,
        activation_checkpointing=args.checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn}
        if args.checkpointing else None)
    from kt_ops.hf.trainer import KTTrainer

    trainer = KTTrainer(model=model, args=training_args, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.numel()}
    else:  # the replicated tensors of the other rank, to check that the ranks agree
        state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.numel()}
        torch.save(state, os.path.join(args.out, f"replicated_rank{trainer.args.process_index}.pt"))
    if trainer.is_world_process_zero():
        from kt_ops import _kernels
        torch.save({"losses": losses, "state": state, "world": world, "kernel_calls": dict(_kernels.calls)},
                   os.path.join(args.out, "result.pt"))


def node_groups(nodes: int, world: int) -> dict:
    """patch_model's groups for one owner per node (the process group set up here, before the
    Trainer, which then uses it); ``{}`` for a single node."""
    if nodes == 1:
        return {}
    import torch.distributed as dist

    if world % nodes:
        raise ValueError(f"--nodes {nodes} does not divide {world} ranks")
    dist.init_process_group("gloo")
    per_node = world // nodes
    groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    owners = dist.new_group([n * per_node for n in range(nodes)])
    return dict(process_group=groups[dist.get_rank() // per_node], owner_rank=0, expert_replica_group=owners)


if __name__ == "__main__":
    main()
    import torch.distributed as dist
    if dist.is_initialized():
        # Leave together: a rank exiting while the other still holds the gloo connections
        # can abort it (SIGABRT seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
