"""Move the routed experts of Hugging Face transformers (5.x) MoE models onto kt.

Every transformers 5.x MoE family keeps its routed experts in one kind of module: a class
decorated with ``@use_experts_implementation`` (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``, ``forward(hidden_states, top_k_index, top_k_weights)``; see
:mod:`kt_ops.hf.experts`). :func:`patch_model` replaces each such module by a
:class:`~kt_ops.hf.experts.KTExperts` with the same forward, whose weights live on the owner
rank's CPU. The model's MoE block, router, shared experts and everything else are untouched,
so routing is the model's own code; the families kt_ops covers are whatever the installed
transformers builds with that contract and SwiGLU experts (``tests/test_hf_families.py``
discovers and checks them; the README lists them).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kt_ops import quantization
from kt_ops.distributed import prepare_ddp
from kt_ops.expert_init import draw_experts
from kt_ops.hf.expert_layout import ExpertsLayout
from kt_ops.hf.experts import (KTExperts, experts_support, gating_of, is_experts_module, kt_experts_class,
                               register_kt_experts)
from kt_ops.linear import bf16_gemms_are_slow, use_kt_linear
from kt_ops.layer import _BASE_NAMES, _BIAS_NAMES, _GLOBAL_SCALE_NAMES, _SCALE_NAMES, KTMoE
from kt_ops.placement import resolve as resolve_placement


def patched_experts(model: nn.Module) -> list[tuple[str, KTExperts]]:
    """``[(qualified name, KTExperts)]`` of the kt experts in ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, KTExperts)]


def patched_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, block)]`` of the MoE blocks whose ``experts`` is kt's (a
    :class:`~kt_ops.KTMoE`), in module order: the unit PEFT's adapter keys are relative to."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "experts", None), KTMoE)]


def patch_model(model: nn.Module, *, lora_rank: int = 0, lora_alpha: Optional[float] = None,
                train_base: bool = False, owner_rank: int = 0,
                process_group: Optional[dist.ProcessGroup] = None, expert_format: Optional[str] = None,
                group_size: Optional[int] = None,
                expert_replica_group: Optional[dist.ProcessGroup] = None,
                owners: Optional[str] = None, expert_shards: int = 1,
                kt_linear: Optional[bool] = None) -> nn.Module:
    """Replace, in place, every transformers experts module of ``model`` by a
    :class:`~kt_ops.hf.experts.KTExperts` whose experts live on the owner rank's CPU.

    Any transformers 5.x MoE model whose experts follow the experts contract with gated
    experts kt.moe computes (:mod:`kt_ops.hf.experts`) is covered, whatever its routing: the
    model's block still computes ``top_k_index`` / ``top_k_weights`` and calls
    ``experts(...)``, which is now kt. Per experts module: the fused ``gate_up_proj [E, 2I, H]``
    is split into ``gate_proj = [:, :I]`` and ``up_proj = [:, I:]`` (each ``[E, I, H]``),
    ``down_proj [E, H, I]`` is kept (other layouts: transposed, interleaved, with biases, are
    converted into these: :mod:`kt_ops.hf.expert_layout`), all moved to the owner rank's CPU in
    the experts' dtype (float32, bfloat16 or float64); other ranks drop the expert weights.
    Masked slots (expert id ``num_experts`` or negative) contribute nothing.

    LoRA (``lora_rank > 0``) reproduces PEFT's expert LoRA
    (``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])``): PEFT
    puts *one* rank-r LoRA on the fused ``gate_up_proj``, i.e. ``ΔW_gate_up[e] = s·B[e]·A[e]``
    with ``A[e]: [r, H]`` shared by the gate and up halves and ``B[e]: [2I, r]``. So
    ``experts.gate_lora_a`` and ``experts.up_lora_a`` are *one tied parameter*
    (``[E, r, H]``; its gradient is the sum over both halves, exactly PEFT's), while
    ``gate_lora_b = B[:, :I]`` and ``up_lora_b = B[:, I:]`` (``[E, I, r]``) are separate;
    ``down_lora_a [E, r, I]``, ``down_lora_b [E, H, r]``; scale ``lora_alpha / lora_rank``.
    Initialisation as PEFT: A ~ U(±1/sqrt(in)), B = 0. Use :func:`kt_ops.save_adapter` /
    :func:`kt_ops.load_adapter` for PEFT's adapter format.

    Args:
        model: a transformers model (e.g. ``Qwen3MoeForCausalLM``, or a multimodal wrapper
            whose text model holds the MoE layers); modified in place.
        lora_rank: LoRA rank r of the expert adapters (0: no LoRA).
        lora_alpha: LoRA alpha (scale ``alpha / r``); default ``r`` (scale 1).
        train_base: whether the expert base weights require grad (full / hybrid training).
        owner_rank: the rank whose CPU holds the experts.
        process_group: the process group of a multi-rank job (default: the default group, or
            ``RANK``/``WORLD_SIZE`` before ``init_process_group``).
        expert_format: None (experts kept in the model's dtype) or ``"fp8"`` / ``"int8"`` /
            ``"int4"``: the owner quantizes each experts module while patching it (see
            :mod:`kt_ops.quantization`), one module at a time, and the model's float copy of
            that module is dropped before the next: the extra memory at any moment is one
            module's experts. Quantized experts are frozen (no ``train_base``).
        group_size: int4's input columns per scale (32, 64 or 128; default 32). ``expert_format``
            may also be a parsed :class:`kt_ops.quantization.ExpertFormat` (then no group_size).
        expert_replica_group: one owner per node: ``process_group`` is the node's ranks and this
            the group of all nodes' owners, which average their expert gradients (see
            :class:`~kt_ops.KTMoE`).
        owners: ``"per-node"``: one owner per node from torchrun's environment, the groups made
            for you (:mod:`kt_ops.placement`); ``"rank0"``: the default, named. Not together
            with ``owner_rank`` / ``process_group`` / ``expert_replica_group``.
        expert_shards: S > 1 splits each experts module's experts into S contiguous ranges held
            by the first S ranks (of each node with ``owners="per-node"``); each owner keeps
            only its range of the model's experts (:class:`~kt_ops.KTMoE`).
        kt_linear: route the model's other ``nn.Linear`` layers (attention, dense MLPs, the LM
            head) through ``kt.linear`` (:mod:`kt_ops.linear`: bf16 storage at float32 speed);
            None (default): where this CPU's bf16 GEMMs are PyTorch's slow fallback (no
            AVX512-BF16), which changes nothing for float32 inputs or GPU tensors.

    Returns:
        ``model`` (patched in place). Parameters outside the experts keep their
        ``requires_grad``; expert base weights require grad iff ``train_base``; LoRA tensors
        require grad.

    Raises:
        ValueError: ``model`` has no transformers experts module, is already patched, or an
            experts module has a layout, activation or dtype kt.moe does not compute (the
            message names the module, its class and why; nothing is changed then); or an
            argument is out of range.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"patch_model: lora_rank must be an int >= 0, got {lora_rank!r}")
    if lora_alpha is not None and (isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float))
                                   or not math.isfinite(lora_alpha)):
        raise ValueError(f"patch_model: lora_alpha must be a finite number or None, got {lora_alpha!r}")
    if lora_alpha is None:
        lora_alpha = float(max(lora_rank, 1))
    if kt_linear is not None and not isinstance(kt_linear, bool):
        raise ValueError(f"patch_model: kt_linear must be True, False or None (auto), got {kt_linear!r}")
    fmt = quantization.ExpertFormat.parse(expert_format, group_size, "patch_model")  # once: passed down as is
    fmt.check_trainable(train_base, "patch_model")

    targets = [(name, module) for name, module in model.named_modules() if is_experts_module(module)]
    if not targets:
        if patched_experts(model):
            raise ValueError("patch_model: model is already patched (its experts are kt_ops' KTExperts)")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"patch_model: no transformers experts module found in {type(model).__name__} "
            f"(model_type={model_type!r}). kt_ops patches the routed experts of transformers 5.x MoE models: "
            "modules of an experts class decorated with @use_experts_implementation "
            "(gate_up_proj [E, 2I, H], down_proj [E, H, I]).")
    # Checked before any module changes; whether this rank owns the experts is the same for all.
    owner = resolve_placement(owners, owner_rank, process_group, expert_replica_group, "patch_model",
                              expert_shards).is_owner
    for name, experts in targets:  # check every module before changing any
        why = experts_support(experts)
        if why is None and fmt.quantized:
            E, I, H = ExpertsLayout.of(experts).sizes(experts.gate_up_proj)
            why = fmt.size_problem(H, I)
        if why is not None:
            raise ValueError(f"patch_model: {name}: {why}")
    for name, experts in targets:
        new = _convert_experts(experts, lora_rank=lora_rank, lora_alpha=lora_alpha, train_base=train_base,
                               owner_rank=owner_rank, process_group=process_group, expert_format=fmt,
                               expert_replica_group=expert_replica_group, owners=owners, owner=owner,
                               expert_shards=expert_shards)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    register_kt_experts()
    if bf16_gemms_are_slow() if kt_linear is None else kt_linear:
        use_kt_linear(model)
    prepare_ddp(model)  # DistributedDataParallel(model) leaves the owner-only expert tensors alone
    return model


def _top_k(experts: nn.Module, num_experts: int) -> int:
    """Slots per token, from the config the experts module was built with (informational:
    the model's block decides the routing)."""
    k = getattr(getattr(experts, "config", None), "num_experts_per_tok", None)
    return int(k) if isinstance(k, int) and 1 <= k <= num_experts else 1


def _convert_experts(experts: nn.Module, *, lora_rank: int, lora_alpha: float, train_base: bool,
                     owner_rank: int, process_group: Optional[dist.ProcessGroup],
                     expert_format: quantization.ExpertFormat,
                     expert_replica_group: Optional[dist.ProcessGroup], owners: Optional[str],
                     owner: bool, expert_shards: int) -> KTExperts:
    layout = ExpertsLayout.of(experts)
    gate_up = experts.gate_up_proj
    E, I, H = layout.sizes(gate_up)

    # Build the layer without allocating or randomly initialising expert memory (the owner's
    # weights come from the model: build on the meta device; non-owners allocate none), and
    # without touching the global RNG (KTMoE.reset_parameters draws from it except on the meta
    # device), so that every rank stays in RNG step.
    with torch.random.fork_rng(devices=[]), (torch.device("meta") if owner else nullcontext()):
        kt = kt_experts_class()(H, I, E, _top_k(experts, E), lora_rank=lora_rank, lora_alpha=lora_alpha,
                       train_base=train_base, owner_rank=owner_rank, process_group=process_group,
                       dtype=gate_up.dtype, expert_format=expert_format,
                       expert_replica_group=expert_replica_group, owners=owners, expert_bias=layout.has_bias,
                       expert_shards=expert_shards, **gating_of(experts))
    kt.gate_up_interleaved = layout.interleaved  # the order of PEFT's fused gate_up LoRA rows (adapters)
    # One draw per layer on every rank (whether or not it owns the experts), like KTMoE.
    lora_seed = int(torch.randint(0, 2**62, ()).item())
    if kt.is_owner:
        on_meta = gate_up.device.type == "meta"
        cpu = gate_up.device if on_meta else torch.device("cpu")
        mine = slice(kt.expert_range.start, kt.expert_range.stop)  # all of them unless sharded
        with torch.no_grad():
            weights = {name: w.detach()[mine] for name, w in layout.weights(experts).items()}
            for name, b in layout.biases(experts).items():
                if b is not None:  # biases stay in the model's dtype, quantized experts or not
                    setattr(kt, name, nn.Parameter(b.detach()[mine].to(cpu).contiguous(), requires_grad=train_base))
            for name, w in weights.items():
                if not expert_format.quantized:
                    setattr(kt, name, nn.Parameter(w.to(cpu).contiguous(), requires_grad=train_base))
                elif on_meta:
                    pass  # KTExperts was built on the meta device with the quantized layout
                else:
                    # Parameters allocated for real (the layer was built on meta), then filled
                    # expert by expert from the model's weights wherever they live.
                    # (nvfp4's global scale too).
                    for held in (name, name.replace("proj", "scale"), name.replace("proj", "global_scale")):
                        meta = getattr(kt, held, None)
                        if meta is not None:
                            setattr(kt, held, nn.Parameter(torch.empty_like(meta, device=cpu), requires_grad=False))
                    kt.set_quantized_weight(name, w)
            if lora_rank:
                _init_lora(kt, cpu, lora_seed, on_meta)
                if on_meta:
                    kt._lora_seed = lora_seed  # for materialize_experts: the LoRA patch_model would draw
    # The grad anchor and the expert-gradient norm live with the model's other parameters, like the router.
    kt.set_replicated_parameters(gate_up.device, gate_up.dtype, trainable=bool(lora_rank or train_base))
    kt.register_gradient_hooks()  # on the real parameters, not the meta ones built above
    experts.gate_up_proj = None  # drop the model's copies now (on every rank), not at the next gc
    experts.down_proj = None
    if layout.has_bias:
        experts.gate_up_proj_bias = None
        experts.down_proj_bias = None
    kt.train(experts.training)
    return kt


def materialize_experts(kt: KTExperts, device: torch.device, scale_dtype: Optional[torch.dtype] = None) -> None:
    """Real storage for a :class:`KTExperts` that :func:`patch_model` patched from a model on the
    meta device (what :func:`kt_ops.hf.from_pretrained` builds): on the owner, the base expert
    tensors (and scales) are allocated uninitialised on the CPU for a loader to fill and the
    LoRA is initialised as patch_model initialises it on a real model (the same per-layer seed);
    on every rank the grad anchor and the expert-gradient norm move to ``device`` and the
    gradient hooks are registered on the new tensors. Tensors already real are left alone.
    ``scale_dtype`` (float32 or bfloat16): the quantized experts' scales in that dtype instead of
    the format's default (for a loader copying scales that bf16 cannot hold exactly)."""
    with torch.no_grad():
        if kt.is_owner:
            for name in _BASE_NAMES + _SCALE_NAMES + _GLOBAL_SCALE_NAMES + _BIAS_NAMES:
                p = getattr(kt, name, None)
                if p is not None and p.device.type == "meta":
                    dtype = scale_dtype if scale_dtype is not None and name in _SCALE_NAMES else p.dtype
                    setattr(kt, name, nn.Parameter(torch.empty_like(p, device="cpu", dtype=dtype),
                                                   requires_grad=p.requires_grad))
            if kt.lora_rank and kt.gate_lora_a.device.type == "meta":
                _init_lora(kt, torch.device("cpu"), kt._lora_seed, on_meta=False)
        anchor = kt.grad_anchor
        if anchor.device != torch.device(device):
            kt.set_replicated_parameters(device, anchor.dtype, trainable=anchor.requires_grad)
    kt.register_gradient_hooks()


def add_expert_adapter(model: nn.Module, adapter_name: str, peft_config) -> None:
    """A new named expert adapter in every kt experts module of ``model``, from a PEFT
    ``LoraConfig`` (its ``r`` must be the experts' rank): PEFT's initialisation (A uniform, B
    zero; one draw per layer on every rank, as patch_model's), its scale, frozen and inactive
    (PEFT's ``add_adapter`` leaves the active adapter as it is)."""
    from kt_ops.hf.expert_adapters import ExpertLoRA

    if getattr(peft_config, "init_lora_weights", True) is not True:
        raise ValueError(f"add_adapter: init_lora_weights={peft_config.init_lora_weights!r}: kt's expert LoRA "
                         "initialises as PEFT's default (init_lora_weights=True); load other values afterwards")
    for _, kt in patched_experts(model):
        if adapter_name in kt.adapters.lora:
            raise ValueError(f"add_adapter: the experts already have an adapter named {adapter_name!r}")
        r, alpha = kt.lora_rank, float(peft_config.lora_alpha)
        if not r:
            raise ValueError("add_adapter: the model was patched with lora_rank=0: its experts take no adapter")
        lora = ExpertLoRA(alpha, alpha / math.sqrt(r) if getattr(peft_config, "use_rslora", False) else alpha / r)
        seed = int(torch.randint(0, 2**62, ()).item())  # on every rank, owner or not
        if kt.is_owner:
            with torch.no_grad():
                _init_lora(kt, torch.device("cpu"), seed, on_meta=False, holder=lora)
        lora.requires_grad_(False)
        kt.adapters.lora[adapter_name] = lora
        kt.register_gradient_hooks()


def delete_expert_adapter(model: nn.Module, adapter_name: str) -> None:
    """Remove a named expert adapter from every kt experts module (no-op where it is absent)."""
    for _, kt in patched_experts(model):
        kt.adapters.delete(adapter_name)


def _init_lora(kt: KTMoE, device: torch.device, seed: int, on_meta: bool, holder: Optional[nn.Module] = None) -> None:
    """PEFT-layout LoRA of the experts, PEFT's init (A ~ U(±1/sqrt(in)), B = 0), with the
    gate and up A tied (one parameter: PEFT's single LoRA on the fused gate_up_proj). A shard's
    owner gets its experts' rows of the draw for all of them. Set on ``holder`` (a named
    adapter's :class:`~kt_ops.hf.expert_adapters.ExpertLoRA`), by default the active adapter."""
    E, I, H, r = kt.num_experts, kt.intermediate_size, kt.hidden_size, kt.lora_rank
    mine = kt.expert_range
    dtype = kt.expert_dtype
    g = torch.Generator().manual_seed(seed)
    holder = holder if holder is not None else kt

    def a(fan_in):
        if on_meta:
            return nn.Parameter(torch.empty(len(mine), r, fan_in, dtype=dtype, device=device))
        bound = fan_in ** -0.5
        values = draw_experts(torch.rand, (E, r, fan_in), g, mine, dtype=torch.float64)
        return nn.Parameter((values * (2 * bound) - bound).to(device=device, dtype=dtype))

    def b(out):
        return nn.Parameter(torch.zeros(len(mine), out, r, dtype=dtype, device=device))

    holder.gate_lora_a = a(H)
    holder.up_lora_a = holder.gate_lora_a  # tied: see patch_model's docstring (ExpertLoRA declares the tie)
    holder.gate_lora_b, holder.up_lora_b = b(I), b(I)
    holder.down_lora_a, holder.down_lora_b = a(I), b(H)
