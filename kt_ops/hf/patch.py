"""Replace the MoE blocks of Hugging Face transformers (5.x) models with KTMoE-backed blocks.

Supported blocks (transformers 5.x, fused 3-D expert parameters ``gate_up_proj [E, 2I, H]``
with the gate in the first half and ``down_proj [E, H, I]``):

=============  ==========================  =====================================================
architecture   block                       routing / extras reproduced
=============  ==========================  =====================================================
Qwen3-MoE      ``Qwen3MoeSparseMoeBlock``  softmax top-k, optional renormalisation
Qwen2-MoE      ``Qwen2MoeSparseMoeBlock``  as Qwen3 + shared expert times ``sigmoid(shared_expert_gate(x))``
Mixtral        ``MixtralSparseMoeBlock``   softmax top-k renormalised (fp32 weights), router jitter in training
DeepSeek-V2    ``DeepseekV2Moe``           greedy / group-limited greedy, ``routed_scaling_factor``, shared experts
DeepSeek-V3    ``DeepseekV3MoE``           sigmoid, ``e_score_correction_bias``, grouped top-k, norm, scaling, shared experts
=============  ==========================  =====================================================

Routing is bit-identical to the unpatched model because the model's own router module is
kept (at the same attribute, ``<block>.gate``, so its parameter names, output-recording hooks
and ``router_logits`` are unchanged) and handed to :class:`~kt_ops.KTMoE` through a small
adapter (:class:`HFRouter`) that returns ``(topk_weights, topk_ids)`` in the dtype the
architecture produces. Shared experts stay where they are, as the original modules.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kt_ops.layer import KTMoE
from kt_ops.rank_discovery import discover_rank


@dataclasses.dataclass(frozen=True)
class _BlockSpec:
    architecture: str           # human-readable name
    module_prefix: str          # transformers.models.<family>.
    shared: Optional[str]       # None | "qwen2" (gated shared_expert) | "deepseek" (shared_experts)
    jitter: bool = False        # Mixtral's router_jitter_noise


_SUPPORTED: dict[str, _BlockSpec] = {
    "Qwen3MoeSparseMoeBlock": _BlockSpec("Qwen3-MoE", "transformers.models.qwen3_moe.", None),
    "Qwen2MoeSparseMoeBlock": _BlockSpec("Qwen2-MoE", "transformers.models.qwen2_moe.", "qwen2"),
    "MixtralSparseMoeBlock": _BlockSpec("Mixtral", "transformers.models.mixtral.", None, jitter=True),
    "DeepseekV2Moe": _BlockSpec("DeepSeek-V2", "transformers.models.deepseek_v2.", "deepseek"),
    "DeepseekV3MoE": _BlockSpec("DeepSeek-V3", "transformers.models.deepseek_v3.", "deepseek"),
}

SUPPORTED_ARCHITECTURES = tuple(f"{s.architecture} ({cls})" for cls, s in _SUPPORTED.items())

_SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


class HFRouter(nn.Module):
    """Adapter from a transformers router to KTMoE's router interface.

    ``forward(x [T, H]) -> (topk_weights [T, K], topk_ids [T, K] int64)``, where the wrapped
    router returns ``(router_logits, topk_weights, topk_ids)`` (all five supported
    architectures do). The weights keep the router's dtype (model dtype for Qwen, fp32 for
    Mixtral and DeepSeek).

    The router is *referenced*, not registered: it stays registered where the model had it
    (``<block>.gate``), so its parameters keep their names and appear once.
    """

    def __init__(self, router: nn.Module):
        super().__init__()
        self.__dict__["router"] = router  # not a submodule (see the class docstring)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        _, topk_weights, topk_ids = self.router(x)
        return topk_weights, topk_ids

    def extra_repr(self) -> str:
        return f"router={type(self.router).__name__} (registered as the block's `gate`)"


class KTSparseMoeBlock(nn.Module):
    """A transformers MoE block whose routed experts are a :class:`~kt_ops.KTMoE`.

    ``forward(hidden_states [B, S, H] or [T, H]) -> same shape``. Submodules keep the names
    of the original block: ``gate`` (the original router), ``experts`` (the KTMoE: expert
    weights ``gate_proj``/``up_proj [E, I, H]``, ``down_proj [E, H, I]`` and LoRA on the
    owner rank's CPU only), and the original shared experts (``shared_expert`` +
    ``shared_expert_gate`` for Qwen2-MoE, ``shared_experts`` for DeepSeek) on the model's
    device.
    """

    def __init__(self, architecture: str, gate: nn.Module, experts: KTMoE, *,
                 shared_kind: Optional[str] = None, shared: Optional[nn.Module] = None,
                 shared_gate: Optional[nn.Module] = None, jitter_noise: float = 0.0):
        super().__init__()
        self.architecture = architecture
        self.hidden_size = experts.hidden_size
        self.gate = gate
        self.experts = experts
        self.shared_kind = shared_kind
        self.jitter_noise = float(jitter_noise)
        if shared_kind == "qwen2":
            self.shared_expert = shared
            self.shared_expert_gate = shared_gate
        elif shared_kind == "deepseek":
            self.shared_experts = shared

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter (same RNG draw)
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        out = self.experts(hidden_states)  # router on this device, experts on the owner's CPU
        if self.shared_kind == "qwen2":
            flat = hidden_states.reshape(-1, self.hidden_size)
            shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            out = out + shared.reshape(out.shape)
        elif self.shared_kind == "deepseek":
            out = out + self.shared_experts(hidden_states)
        return out

    def extra_repr(self) -> str:
        return f"architecture={self.architecture}"


def _spec_of(module: nn.Module) -> Optional[_BlockSpec]:
    spec = _SUPPORTED.get(type(module).__name__)
    if spec is not None and type(module).__module__.startswith(spec.module_prefix):
        return spec
    return None


def patched_blocks(model: nn.Module) -> list[tuple[str, KTSparseMoeBlock]]:
    """``[(qualified name, block)]`` of the KTMoE-backed blocks in ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, KTSparseMoeBlock)]


def patch_model(model: nn.Module, *, lora_rank: int = 0, lora_alpha: Optional[float] = None,
                train_base: bool = False, owner_rank: int = 0,
                process_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Replace every supported MoE block of a transformers model, in place, by a
    :class:`KTSparseMoeBlock` whose routed experts are a :class:`~kt_ops.KTMoE`.

    Supported: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3 (transformers 5.x).
    Per block: the router is kept (bit-identical routing; its output dtype kept); the fused
    ``experts.gate_up_proj [E, 2I, H]`` is split into ``gate_proj = [:, :I]`` and
    ``up_proj = [:, I:]`` (each ``[E, I, H]``), ``down_proj [E, H, I]`` is kept, all moved to
    the owner rank's CPU in the experts' dtype (float32, bfloat16 or float64); other ranks
    drop the expert weights (their memory is freed once nothing else references the old
    block). Shared experts stay as the original modules on the model's device.

    LoRA (``lora_rank > 0``) reproduces PEFT's expert LoRA
    (``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])``): PEFT
    puts *one* rank-r LoRA on the fused ``gate_up_proj``, i.e. ``ΔW_gate_up[e] = s·B[e]·A[e]``
    with ``A[e]: [r, H]`` shared by the gate and up halves and ``B[e]: [2I, r]``. So the
    block's ``experts.gate_lora_a`` and ``experts.up_lora_a`` are *one tied parameter*
    (``[E, r, H]``; its gradient is the sum over both halves, exactly PEFT's), while
    ``gate_lora_b = B[:, :I]`` and ``up_lora_b = B[:, I:]`` (``[E, I, r]``) are separate;
    ``down_lora_a [E, r, I]``, ``down_lora_b [E, H, r]``; scale ``lora_alpha / lora_rank``.
    Initialisation as PEFT: A ~ U(±1/sqrt(in)), B = 0. Use :func:`kt_ops.save_adapter` /
    :func:`kt_ops.load_adapter` for PEFT's adapter format.

    Args:
        model: a transformers model (e.g. ``Qwen3MoeForCausalLM``) containing supported MoE
            blocks; modified in place.
        lora_rank: LoRA rank r of the expert adapters (0: no LoRA).
        lora_alpha: LoRA alpha (scale ``alpha / r``); default ``r`` (scale 1).
        train_base: whether the expert base weights require grad (full / hybrid training).
        owner_rank: the rank whose CPU holds the experts.
        process_group: the process group of a multi-rank job (default: the default group, or
            ``RANK``/``WORLD_SIZE`` before ``init_process_group``).

    Returns:
        ``model`` (patched in place). Parameters outside the experts keep their
        ``requires_grad``; expert base weights require grad iff ``train_base``; LoRA tensors
        require grad.

    Raises:
        ValueError: ``model`` has no supported MoE block (the message lists the supported
            architectures), is already patched, or a block has an unsupported layout,
            activation or dtype; or an argument is out of range.
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

    targets = [(name, module, _spec_of(module)) for name, module in model.named_modules()]
    targets = [(name, module, spec) for name, module, spec in targets if spec is not None]
    if not targets:
        if patched_blocks(model):
            raise ValueError("patch_model: model is already patched (its MoE blocks are KTSparseMoeBlock)")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"patch_model: no supported MoE block found in {type(model).__name__} (model_type={model_type!r}). "
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.")

    for name, block, spec in targets:  # check every block before changing any
        _check_block(name, block)
    for name, block, spec in targets:
        new_block = _convert_block(name, block, spec, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                   train_base=train_base, owner_rank=owner_rank, process_group=process_group)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new_block)
    return model


def _check_block(name: str, block: nn.Module) -> tuple[int, int, int]:
    """(E, I, H) of a supported block, or ValueError naming what kt_ops cannot run."""
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    where = f"patch_model: {name} ({type(block).__name__})"
    for attr, ok in (("is_transposed", False), ("has_bias", False), ("is_concatenated", True), ("has_gate", True)):
        if getattr(experts, attr, ok) != ok:
            raise ValueError(f"{where}: experts.{attr}={getattr(experts, attr)!r} is not supported "
                             f"(kt_ops needs {attr}={ok})")
    act = type(getattr(experts, "act_fn", None)).__name__
    if act not in _SILU_ACTIVATIONS:
        raise ValueError(f"{where}: the experts' activation is {act}; kt_ops computes SwiGLU experts "
                         f"(hidden_act='silu') only")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"{where}: expected experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I], "
                         f"got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    E, two_i, H = gate_up.shape
    I = two_i // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"{where}: experts.down_proj must have shape [E, H, I] = {[E, H, I]}, "
                         f"got {list(down.shape)}")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"{where}: expert weights are {gate_up.dtype}; kt_ops runs float32, bfloat16 or "
                         f"float64 experts (cast the model first, e.g. model.to(torch.bfloat16))")
    return E, I, H


def _convert_block(name: str, block: nn.Module, spec: _BlockSpec, *, lora_rank: int, lora_alpha: float,
                   train_base: bool, owner_rank: int,
                   process_group: Optional[dist.ProcessGroup]) -> KTSparseMoeBlock:
    experts, router = block.experts, block.gate
    gate_up, down = experts.gate_up_proj, experts.down_proj
    E, I, H = _check_block(name, block)
    top_k = int(router.top_k)

    # Build the layer without allocating or randomly initialising expert memory (the owner's
    # weights come from the model: build on the meta device; non-owners allocate none), and
    # without touching the global RNG (KTMoE.reset_parameters draws from it except on the meta
    # device), so that every rank stays in RNG step.
    rank, _ = discover_rank(process_group)
    with torch.random.fork_rng(devices=[]), (torch.device("meta") if rank == owner_rank else nullcontext()):
        kt = KTMoE(H, I, E, top_k, lora_rank=lora_rank, lora_alpha=lora_alpha, train_base=train_base,
                   norm_topk_prob=bool(getattr(router, "norm_topk_prob", True)), owner_rank=owner_rank,
                   process_group=process_group, dtype=gate_up.dtype, router=HFRouter(router))
    # One draw per layer on every rank (whether or not it owns the experts), like KTMoE.
    lora_seed = int(torch.randint(0, 2**62, ()).item())
    if kt.is_owner:
        on_meta = gate_up.device.type == "meta"
        cpu = gate_up.device if on_meta else torch.device("cpu")
        with torch.no_grad():
            kt.gate_proj = nn.Parameter(gate_up.detach()[:, :I].to(cpu).contiguous(), requires_grad=train_base)
            kt.up_proj = nn.Parameter(gate_up.detach()[:, I:].to(cpu).contiguous(), requires_grad=train_base)
            kt.down_proj = nn.Parameter(down.detach().to(cpu).contiguous(), requires_grad=train_base)
            if lora_rank:
                _init_lora(kt, cpu, lora_seed, on_meta)
    experts.gate_up_proj = None  # drop the model's copies now (on every rank), not at the next gc
    experts.down_proj = None
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0) if spec.jitter else 0.0
    if spec.shared == "qwen2":
        extras = dict(shared=block.shared_expert, shared_gate=block.shared_expert_gate)
    elif spec.shared == "deepseek":
        extras = dict(shared=block.shared_experts)
    else:
        extras = {}
    new_block = KTSparseMoeBlock(spec.architecture, router, kt, shared_kind=spec.shared,
                                 jitter_noise=jitter, **extras)
    new_block.train(block.training)
    return new_block


def _init_lora(kt: KTMoE, device: torch.device, seed: int, on_meta: bool) -> None:
    """PEFT-layout LoRA of the experts, PEFT's init (A ~ U(±1/sqrt(in)), B = 0), with the
    gate and up A tied (one parameter: PEFT's single LoRA on the fused gate_up_proj)."""
    E, I, H, r = kt.num_experts, kt.intermediate_size, kt.hidden_size, kt.lora_rank
    dtype = kt.gate_proj.dtype
    g = torch.Generator().manual_seed(seed)

    def a(fan_in):
        if on_meta:
            return nn.Parameter(torch.empty(E, r, fan_in, dtype=dtype, device=device))
        bound = fan_in ** -0.5
        return nn.Parameter((torch.rand(E, r, fan_in, generator=g, dtype=torch.float64) * (2 * bound) - bound)
                            .to(device=device, dtype=dtype))

    def b(out):
        return nn.Parameter(torch.zeros(E, out, r, dtype=dtype, device=device))

    kt.gate_lora_a = a(H)
    kt.up_lora_a = kt.gate_lora_a  # tied: see patch_model's docstring
    kt.gate_lora_b, kt.up_lora_b = b(I), b(I)
    kt.down_lora_a, kt.down_lora_b = a(I), b(H)
