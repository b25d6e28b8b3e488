"""LoRA fine-tuning of a Hugging Face MoE model whose experts run in kt_ops (``kt-finetune``).

    python -m kt_ops.finetune                        # built-in demo: a few minutes on 2 CPU cores
    python -m kt_ops.finetune --compare-eager        # ... and the same run with HF's experts + PEFT
    torchrun --nproc-per-node 2 -m kt_ops.finetune   # 2 ranks (gloo); experts live on rank 0
    torchrun --nnodes 2 --node-rank N ... -m kt_ops.finetune --owners per-node   # an owner per node
    torchrun --nproc-per-node 2 -m kt_ops.finetune --expert-shards 2   # experts split over 2 owners

The model's experts are moved onto kt (``kt_ops.patch_model``, or ``kt_ops.hf.from_pretrained``
straight from a ``--model`` checkpoint) with LoRA on the routed experts; everything else is
frozen. Training is ``kt_ops.hf.trainer.KTTrainer``, a ``transformers.Trainer`` with kt's
checkpoints and failure handling (``kt_ops.finetune.training``): AdamW,
constant learning rate, gradient clipping, checkpoints (``--save-steps``, ``--resume``); the
model is compiled in place with ``torch.compile(fullgraph=True)`` before the Trainer wraps it
(``--backend``, inductor by default) and checkpointed under kt_ops' policy (``kt_ops.checkpoint_context_fn``: the CPU
experts and the collectives run once per step, attention and norms are recomputed;
``--no-checkpointing``).

Without ``--model`` it trains a small Qwen3-MoE-architecture model (random init, built from
``Qwen3MoeConfig``; see ``DEFAULT_MODEL_CONFIG``) on the public-domain corpus shipped in
``kt_ops/finetune/data/corpus.txt`` with a byte-level tokenizer (``kt_ops.finetune.tokenizer``); nothing is
downloaded. Batches are windows of ``--seq-len + 1`` tokens at random offsets drawn from
``--seed`` (the model predicts the last ``--seq-len`` of each), taken in order by the Trainer:
both runs of ``--compare-eager`` and every rank see the same data in the same order.

Outputs (rank 0, in ``--output-dir``): the adapter (``kt_ops.save_adapter``, PEFT format),
``loss_curve.png`` and ``summary.json`` (losses, step times, tokens/s, settings); with
``--also-train``, the other trained parameters in ``also_trained.safetensors``.

``--compare-eager`` then trains the same model from the same initialisation on the same batches
with Hugging Face's own experts (the transformers default experts implementation, or
``--hf-experts``) and LoRA through PEFT on the unpatched model, without torch.compile (HF's
experts do not compile with fullgraph=True). The PEFT LoRA is the one ``kt_ops.save_adapter``
writes and ``kt_ops.load_adapter`` reads: ``LoraConfig(r, lora_alpha, target_parameters=
["experts.gate_up_proj", "experts.down_proj"])``, one A shared by the fused gate and up halves
(``kt_ops.patch_model`` ties ``gate_lora_a`` and ``up_lora_a`` to match), started from the
kt_ops initialisation. The printout gives the speedup (steady-state tokens/s, first step
excluded) and the per-step difference of the two loss curves.

Multi-process (``WORLD_SIZE > 1``, e.g. torchrun): the Trainer sets up the process group
(NCCL when the ranks have GPUs, gloo on CPU) and wraps the model in DDP; ``--batch-size`` is the
global batch and each rank trains on its own contiguous shard of it. The experts and their LoRA
live on rank 0 only (KTMoE gives them the DDP average of every rank's gradient and keeps them
out of DDP), or with ``--owners per-node`` on each node's local rank 0 (the owners averaging
their expert gradients, so the replicas stay equal); with ``--expert-shards S`` the experts are split
over the first S ranks (of each node); DDP averages the gradients of the other trainable parameters (``--also-train``).
A rank with nothing of its own to train still runs the backward the owner waits for (KTMoE's
grad anchor). The printed/recorded loss is the mean over ranks, which equals the
single-process loss on the same global batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

import kt_ops
from kt_ops import faults, placement, quantization
from kt_ops.cpu_isa import best_cpu_isa
from kt_ops.finetune.training import RunResult, WindowDataset, train_with_trainer
from kt_ops.finetune.tokenizer import ByteTokenizer

# The built-in demo model: Qwen3-MoE architecture, small enough for a few minutes on 2 cores.
DEFAULT_MODEL_CONFIG = dict(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=256,
    intermediate_size=512,          # dense MLP size (unused: every layer is MoE)
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    use_cache=False,
    bos_token_id=ByteTokenizer.bos_token_id,
    eos_token_id=ByteTokenizer.eos_token_id,
    pad_token_id=ByteTokenizer.pad_token_id,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("inductor", "aot_eager", "eager", "none")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kt-finetune",
        description="LoRA fine-tuning of a Hugging Face MoE model with kt_ops' CPU experts, under "
                    "torch.compile with kt_ops' activation-checkpointing policy. Without --model: a "
                    "small built-in Qwen3-MoE model on a shipped text corpus (a few minutes on 2 cores).",
        epilog="Several processes: torchrun --nproc-per-node N -m kt_ops.finetune ... (gloo; the "
               "experts live on rank 0).")
    p.add_argument("--trainer", choices=["sft", "dpo"], default="sft",
                   help="sft: this job; dpo: DPO with TRL's DPOTrainer on shipped preference pairs "
                        "(its options: python -m kt_ops.finetune --trainer dpo --help)")
    p.add_argument("--model", default=None,
                   help="local checkpoint directory (safetensors: bf16/fp32, FP8 blocks or "
                        "compressed-tensors INT4), loaded shard by shard by kt_ops.hf.from_pretrained; "
                        "default: the built-in small Qwen3-MoE model")
    p.add_argument("--model-config", default=None, metavar="KEY=VALUE[,KEY=VALUE...]",
                   help="overrides of the built-in model's Qwen3MoeConfig, e.g. "
                        "'num_hidden_layers=2,hidden_size=128' (not with --model)")
    p.add_argument("--data", default=None, help="a UTF-8 text file; default: kt_ops/finetune/data/corpus.txt")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="global batch: sequences per step, split over the ranks (default: %(default)s)")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="LoRA alpha; scale alpha/r (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="AdamW learning rate, no weight decay (default: %(default)s)")
    p.add_argument("--output-dir", default="./kt_finetune_out",
                   help="adapter, loss_curve.png, summary.json (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="model init, LoRA init and data order (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="model dtype: experts, LoRA and the rest (default: %(default)s)")
    p.add_argument("--expert-format", choices=quantization.FORMATS, default=None,
                   help="keep the frozen base experts quantized (fp8 blocks, int8, int4); an FP8 / INT4 "
                        "checkpoint's experts are then copied as stored; default: the model dtype")
    p.add_argument("--group-size", type=int, choices=quantization.GROUP_SIZES, default=None,
                   help="int4's input columns per scale (default: the checkpoint's, else 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process; default: with several ranks, an expert owner takes the CPUs "
                        "its affinity allows (numactl/taskset; split between the node's owners when unbound), "
                        "the other ranks torch's (torchrun: OMP_NUM_THREADS=1); one process: torch's")
    p.add_argument("--backend", choices=BACKENDS, default="inductor",
                   help="torch.compile backend of the kt_ops run; 'none': no torch.compile "
                        "(default: %(default)s)")
    p.add_argument("--also-train", default=None, metavar="REGEX",
                   help="also train (in full) the non-expert parameters whose names match REGEX "
                        "(re.search), e.g. 'norm' or 'mlp\\.gate\\.' (the routers); with several "
                        "ranks their gradients are all-reduced")
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    p.add_argument("--compare-eager", action="store_true",
                   help="also train with HF's own experts + PEFT (eager) from the same init on the "
                        "same data, and compare speed and loss curves (single process only)")
    p.add_argument("--hf-experts", default=None, metavar="IMPL",
                   help="experts_implementation of the --compare-eager run (eager, grouped_mm, "
                        "batched_mm); default: transformers' default")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the gradient norm (all trainable tensors, experts' LoRA included; "
                        "0: no clipping; default: %(default)s, the Trainer's)")
    p.add_argument("--save-steps", type=int, default=0,
                   help="write a Trainer checkpoint (with the expert adapter) every N steps into "
                        "--output-dir (0: none; default)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT|latest",
                   help="resume from a Trainer checkpoint folder, or 'latest': the newest complete one in "
                        "--output-dir (incomplete ones are skipped with a warning); the job must have the "
                        "checkpoint's number of ranks")
    p.add_argument("--owners", choices=placement.OWNERS, default="rank0",
                   help="where the experts live with several ranks: 'rank0' (one owner for the job) or "
                        "'per-node' (each node's local rank 0, from torchrun's --nnodes layout; the owners "
                        "average their expert gradients) (default: %(default)s)")
    p.add_argument("--expert-shards", type=int, default=1, metavar="S",
                   help="split each layer's experts over S owners: the first S ranks (of each node with "
                        "--owners per-node), each holding and computing its share of the experts "
                        "(default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "batch_size", "lora_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.also_train is not None:
        try:
            re.compile(args.also_train)
        except re.error as e:
            p.error(f"--also-train: not a regular expression: {e}")
    try:  # the library's own check and message (from_pretrained / patch_model parse them again, as given)
        quantization.ExpertFormat.parse(args.expert_format, args.group_size, "kt-finetune")
    except ValueError as e:
        p.error(str(e))
    if args.model_config is not None:
        if args.model:
            p.error("--model-config changes the built-in model; it cannot be combined with --model")
        try:
            args.model_config = _parse_overrides(args.model_config)
        except ValueError as e:
            p.error(f"--model-config: {e}")
    return args


def _parse_overrides(text: str) -> dict:
    """``"a=1,b=x"`` -> ``{"a": 1, "b": "x"}`` (values parsed as JSON when they parse)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


# --------------------------------------------------------------------------- data

def load_tokens(args, model_dir: Optional[str], vocab_size: int) -> tuple[Tensor, dict]:
    """The training text as one stream of token ids, and a description of the tokenizer."""
    if args.data:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
    else:
        from kt_ops.finetune.data import read_corpus
        text = read_corpus()
    tokenizer = None
    # The model's own tokenizer when it has one. (transformers 5 builds an empty tokenizer from
    # a bare config.json, hence the look for tokenizer files in a local directory.)
    has_files = not os.path.isdir(model_dir or "") or any(
        os.path.exists(os.path.join(model_dir, n)) for n in
        ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    if model_dir and has_files:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, KeyError, TypeError):
            tokenizer = None
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        info = {"type": type(tokenizer).__name__, "source": model_dir}
    else:
        byte_tok = ByteTokenizer()
        if vocab_size < byte_tok.vocab_size:
            raise ValueError(f"the byte-level tokenizer needs a vocabulary of >= {byte_tok.vocab_size} "
                             f"tokens, the model has {vocab_size}; give a --model directory with a tokenizer")
        ids = byte_tok.encode(text, add_bos=True)
        info = {"type": "kt_ops.tokenizer.ByteTokenizer", "vocab_size": byte_tok.vocab_size}
    return torch.tensor(ids, dtype=torch.long), info


def batch_offsets(num_tokens: int, seq_len: int, batch_size: int, steps: int, seed: int) -> Tensor:
    """``[steps, batch_size]`` start offsets of windows of ``seq_len + 1`` tokens."""
    span = num_tokens - (seq_len + 1)
    if span < 0:
        raise ValueError(f"--seq-len {seq_len} needs at least {seq_len + 1} tokens of text, "
                         f"the data has {num_tokens}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, span + 1, (steps, batch_size), generator=g)


# --------------------------------------------------------------------------- models

def build_base_model(args, experts_implementation: Optional[str] = None) -> nn.Module:
    """The unpatched Hugging Face model (random init from ``--seed`` without ``--model``)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    dtype = DTYPES[args.dtype]
    kwargs = {"dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    else:
        config = Qwen3MoeConfig(**{**DEFAULT_MODEL_CONFIG, **(args.model_config or {})})
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.config.use_cache = False
    return model


def build_kt_model(args, base: Optional[nn.Module] = None) -> nn.Module:
    """The model with its experts on kt (LoRA on the experts, experts placed by ``--owners``); only the
    expert LoRA trains, plus the parameters ``--also-train`` names. The LoRA initialisation is
    drawn from ``--seed`` (the same on every rank). With ``--model`` (and no ``base``) the
    checkpoint is read shard by shard straight into the patched model
    (:func:`kt_ops.hf.from_pretrained`): the unpatched model is never materialised."""
    patch = dict(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, train_base=False, owners=args.owners,
                 expert_format=args.expert_format, group_size=args.group_size, expert_shards=args.expert_shards)
    if base is None and args.model:
        torch.manual_seed(args.seed + 1)  # the LoRA draws, as below
        model = kt_ops.hf.from_pretrained(args.model, dtype=DTYPES[args.dtype], device="cpu",
                                          progress=not args.no_progress, **patch)
        model.config.use_cache = False
    else:
        model = base if base is not None else build_base_model(args)
        torch.manual_seed(args.seed + 1)
        model = kt_ops.patch_model(model, **patch)
    experts = expert_parameters(model)
    for name, p in model.named_parameters():
        if id(p) not in experts:
            p.requires_grad_(False)
    also_train(model, args.also_train, exclude=experts)
    return model


def also_train(model: nn.Module, pattern: Optional[str], exclude: set[int] = frozenset()) -> list[str]:
    """Makes the parameters whose names match ``pattern`` (``re.search``) trainable, except
    those in ``exclude`` (ids); returns their names. ValueError if nothing matches."""
    if not pattern:
        return []
    names = [n for n, p in model.named_parameters() if id(p) not in exclude and re.search(pattern, n)]
    if not names:
        raise ValueError(f"--also-train {pattern!r} matches no parameter outside the experts")
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(True)
    return names


def enable_checkpointing(model: nn.Module, context_fn: Optional[Callable]) -> None:
    """HF activation checkpointing (non-reentrant), with ``context_fn`` if given."""
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # HF also makes the embedding output require grad (a forward hook calling requires_grad_()),
    # which only reentrant checkpointing needs and which torch.compile refuses.
    model.disable_input_require_grads()


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the KT layers' own tensors (kt_ops.expert_parameters: the owner-only experts, the
    grad anchors and expert-gradient norms)."""
    return {id(p) for p in kt_ops.expert_parameters(model)}


def attach_peft_lora(model: nn.Module, kt_adapter: dict, lora_rank: int, lora_alpha: float) -> nn.Module:
    """PEFT LoRA on the unpatched model's experts, equal to a kt_ops-patched model's LoRA.

    ``kt_adapter``: ``kt_ops.hf.adapters.adapter_state_dict(kt_model)`` (PEFT's keys). The PEFT
    config is the one ``kt_ops.save_adapter`` writes: ``target_parameters`` on every experts
    module's fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], rank r, alpha, one
    A shared by gate and up (kt_ops ties ``gate_lora_a`` and ``up_lora_a`` to match).
    Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from kt_ops.hf.adapters import TARGET_PARAMETERS

    config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=[],
                        target_parameters=list(TARGET_PARAMETERS))
    peft_model = get_peft_model(model, config)  # freezes everything but the LoRA
    result = set_peft_model_state_dict(peft_model, kt_adapter)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise RuntimeError(f"--compare-eager: PEFT did not take the kt_ops LoRA tensors {unexpected[:4]}")
    loaded = {n for n, _ in peft_model.named_parameters() if "lora_" in n}
    if len(loaded) != len(kt_adapter):
        raise RuntimeError(f"--compare-eager: PEFT made {len(loaded)} LoRA tensors, kt_ops has {len(kt_adapter)}")
    return peft_model


# --------------------------------------------------------------------------- training

def compare(kt: RunResult, eager: RunResult) -> dict:
    abs_diff = [abs(a - b) for a, b in zip(kt.losses, eager.losses)]
    rel_diff = [d / max(abs(b), 1e-12) for d, b in zip(abs_diff, eager.losses)]
    return {"speedup": kt.tokens_per_s / eager.tokens_per_s,
            "speedup_median": kt.tokens_per_s_median / eager.tokens_per_s_median,
            "max_abs_diff": max(abs_diff), "max_rel_diff": max(rel_diff),
            "final_abs_diff": abs_diff[-1],
            "abs_diff_per_step": abs_diff, "rel_diff_per_step": rel_diff}


# --------------------------------------------------------------------------- outputs

def plot_losses(path: str, kt: RunResult, eager: Optional[RunResult], title: str,
                note: Optional[str] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    steps = range(kt.first_step, kt.first_step + len(kt.losses))
    ax.plot(steps, kt.losses, label=f"kt_ops ({kt.tokens_per_s:,.0f} tokens/s)", color="tab:blue", lw=1.8)
    if eager is not None:
        ax.plot(steps, eager.losses, label=f"{eager.label} ({eager.tokens_per_s:,.0f} tokens/s)",
                color="tab:orange", lw=1.2, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy)")
    ax.set_title(title if not note else f"{title}\n{note}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def model_summary(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_experts", "num_local_experts",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")
    return {k: getattr(cfg, k) for k in keys if cfg is not None and getattr(cfg, k, None) is not None}


# --------------------------------------------------------------------------- main

@dataclasses.dataclass
class FinetuneResult:
    model: nn.Module          # the trained kt-patched model (uncompiled)
    kt: RunResult
    eager: Optional[RunResult]
    summary: dict


def run(argv=None) -> FinetuneResult:
    """Everything ``main`` does; returns the trained model and the results (for tests)."""
    args = parse_args(argv)
    # Denormal floats (e.g. Adam's squared averages of tiny LoRA gradients) make CPU arithmetic
    # 10-100x slower; flushing them to zero made the demo's steps 2.4x faster (fp32) to 20x
    # (bf16). Set before the first parallel region, so that OpenMP's threads inherit it.
    torch.set_flush_denormal(True)
    try:
        # A failure on any rank ends the job on every rank (fail_fast aborts the process groups
        # and tells the kt ops through the store); only a run that ended well on this rank
        # waits for the others, so that no rank waits here for one still training.
        with faults.fail_fast():
            result = _run(args, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
            if dist.is_initialized():  # the Trainer's (accelerate's) group: leave together
                dist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
        return result
    finally:
        torch.set_flush_denormal(False)  # torch's default, for in-process callers (tests)


def slow_bf16_note(dtype: torch.dtype, device_type: str, best_isa: str) -> Optional[str]:
    """Why ``--dtype bfloat16`` is slower on this machine, or None. kt_ops' experts and the model's
    nn.Linear layers (``kt.linear``, which patch_model routes them through on such CPUs) run bf16
    on float32 panels where the CPU has no AVX512-BF16, but the model's remaining bf16 ops (the
    attention's matmuls, ...) are PyTorch's, slow there: the default job on an AVX2 Zen 3 ran
    3,745 tokens/s in bf16 against 4,929 in float32 (660 in bf16 before kt.linear;
    docs/finetune.md)."""
    if dtype != torch.bfloat16 or device_type != "cpu" or best_isa == "avx512_bf16":
        return None
    return (f"--dtype bfloat16 with the model on a CPU without AVX512-BF16 (kt_ops path {best_isa}): the layers "
            "outside the experts and the linear layers (attention's matmuls, ...) run PyTorch's bf16 kernels, "
            "slower than float32 on this CPU (the demo: 0.76x); --dtype float32 trains faster here if it fits "
            "(it holds the weights twice as large)")


def _run(args, rank: int, world_size: int) -> FinetuneResult:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of ranks "
                         f"({world_size})")
    if args.compare_eager and world_size > 1:
        raise ValueError("--compare-eager runs in a single process only")

    model = build_kt_model(args)  # the built-in model, or --model streamed from its checkpoint
    if not args.threads and world_size > 1:
        kt_ops.distributed.set_owner_threads(model)  # torchrun gave every rank 1 thread
    note = slow_bf16_note(DTYPES[args.dtype], model.get_input_embeddings().weight.device.type,
                          best_cpu_isa())
    if note and rank == 0:
        warnings.warn(note, stacklevel=2)
    tokens, tokenizer_info = load_tokens(args, args.model, model.config.vocab_size)
    offsets = batch_offsets(len(tokens), args.seq_len, args.batch_size, args.steps, args.seed)
    init_lora = None
    if args.compare_eager:  # the kt LoRA initialisation, in PEFT's layout
        from kt_ops.hf.adapters import adapter_state_dict
        init_lora = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    if not args.no_checkpointing:
        enable_checkpointing(model, kt_ops.checkpoint_context_fn)
    dataset = WindowDataset(tokens, offsets, args.seq_len)
    kt_result = train_with_trainer(model, dataset, args, "kt_ops", output_dir=args.output_dir,
                                   compile_backend=None if args.backend == "none" else args.backend,
                                   world_size=world_size, resume=args.resume)

    eager_result, comparison, hf_impl = None, None, None
    if args.compare_eager:
        hf_base = build_base_model(args, experts_implementation=args.hf_experts)
        hf_impl = getattr(hf_base.config, "_experts_implementation", None)
        hf_model = attach_peft_lora(hf_base, init_lora, args.lora_rank, args.lora_alpha)
        experts_ids = {id(p) for n, p in hf_model.named_parameters() if ".experts." in n}
        also_train(hf_model, args.also_train, exclude=experts_ids)  # as on the kt_ops side
        if not args.no_checkpointing:
            enable_checkpointing(hf_model.get_base_model(), None)
        eager_result = train_with_trainer(hf_model, dataset, args, f"HF experts ({hf_impl}) + PEFT, eager",
                                          output_dir=os.path.join(args.output_dir, "eager"), compile_backend=None,
                                          world_size=1)
        comparison = compare(kt_result, eager_result)

    summary = {
        "settings": vars(args),
        "world_size": world_size,
        "threads_per_process": torch.get_num_threads(),
        "model": model_summary(model),
        "tokenizer": tokenizer_info,
        "data_tokens": len(tokens),
        "trainable_parameters_rank0": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "also_trained": [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in expert_parameters(model)],
        "kt_ops": kt_result.to_json(),
        "eager": None if eager_result is None else dict(eager_result.to_json(), experts_implementation=hf_impl,
                                                         compiled=False),
        "comparison": comparison,
        "versions": {"torch": torch.__version__, **_versions()},
    }
    kt_ops.save_adapter(model, args.output_dir, write=rank == 0)  # every rank: sharded experts are gathered
    if rank == 0:
        out = args.output_dir
        os.makedirs(out, exist_ok=True)
        if summary["also_trained"]:  # not part of the expert-LoRA adapter
            from safetensors.torch import save_file
            params = dict(model.named_parameters())
            save_file({n: params[n].detach().contiguous() for n in summary["also_trained"]},
                      os.path.join(out, "also_trained.safetensors"))
        if tokenizer_info["type"] == "kt_ops.tokenizer.ByteTokenizer":
            ByteTokenizer().save_pretrained(out)
        title = (f"LoRA r={args.lora_rank} on experts, {args.dtype}, backend={args.backend}, "
                 f"batch {args.batch_size}x{args.seq_len}, {world_size} process(es)")
        note = None if comparison is None else (
            f"speedup {comparison['speedup']:.2f}x; per step |loss diff| <= {comparison['max_abs_diff']:.2g} "
            f"(rel {comparison['max_rel_diff']:.2g})")
        plot_losses(os.path.join(out, "loss_curve.png"), kt_result, eager_result, title, note)
        summary["outputs"] = {"adapter_dir": out, "loss_curve": os.path.join(out, "loss_curve.png"),
                              "summary": os.path.join(out, "summary.json")}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        _print_report(summary)
    return FinetuneResult(model, kt_result, eager_result, summary)


def _versions() -> dict:
    out = {}
    for name in ("transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def _print_report(s: dict) -> None:
    kt = s["kt_ops"]
    if not kt["losses"]:
        print(f"kt_ops: nothing left to train (resumed at the last of {s['settings']['steps']} steps)")
        print(f"wrote {s['outputs']['adapter_dir']} (adapter), {s['outputs']['summary']}")
        return
    print(f"kt_ops: loss {kt['losses'][0]:.4f} -> {kt['losses'][-1]:.4f} over {len(kt['losses'])} steps, "
          f"{kt['tokens_per_s']:,.0f} tokens/s (steady state; median step: {kt['tokens_per_s_median']:,.0f}; "
          f"first step {kt['first_step_s']:.1f} s "
          f"incl. compilation), {s['world_size']} process(es) x {s['threads_per_process']} threads")
    if s["eager"] is not None:
        e, c = s["eager"], s["comparison"]
        print(f"HF experts ({e['experts_implementation']}) + PEFT, eager: loss {e['losses'][0]:.4f} -> "
              f"{e['losses'][-1]:.4f}, {e['tokens_per_s']:,.0f} tokens/s (median step: "
              f"{e['tokens_per_s_median']:,.0f}; first step {e['first_step_s']:.1f} s)")
        print(f"speedup kt_ops / eager: {c['speedup']:.2f}x (median steps: {c['speedup_median']:.2f}x); "
              f"loss curves: max abs diff {c['max_abs_diff']:.3g}, "
              f"max rel diff {c['max_rel_diff']:.3g} per step")
    print(f"wrote {s['outputs']['adapter_dir']} (adapter), {s['outputs']['loss_curve']}, {s['outputs']['summary']}")


def main(argv=None) -> int:
    # torchrun's own error record: its failure summary then names the first rank that
    # failed with this rank's exception and traceback.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run)(argv)
    return 0
