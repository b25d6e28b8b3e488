"""KTMoE: a mixture-of-experts layer whose routed experts live in CPU memory on one rank."""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kt_ops import quantization
from kt_ops.expert_init import draw_experts
from kt_ops.placement import resolve as resolve_placement
from kt_ops.shard_collectives import shard_starts

_layer_ids = itertools.count()

_LORA_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
_BASE_NAMES = ("gate_proj", "up_proj", "down_proj")
_SCALE_NAMES = ("gate_scale", "up_scale", "down_scale")
_GLOBAL_SCALE_NAMES = ("gate_global_scale", "up_global_scale", "down_global_scale")  # nvfp4's, float32 [E]
_BIAS_NAMES = ("gate_bias", "up_bias", "down_bias")  # with expert_bias=True (gpt-oss's experts)
_REPLICATED_NAMES = ("grad_anchor", "expert_grad_norm")  # on every rank, owner or not (see __init__)


def lora_shapes(E: int, I: int, H: int, r: int) -> dict:
    """``{name: shape}`` of the six PEFT-layout expert LoRA tensors of ``E`` experts."""
    return {"gate_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_a": (E, r, H), "up_lora_b": (E, I, r),
            "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}


@torch.compiler.assume_constant_result
def _default_group_name() -> str:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("KTMoE was built for a multi-rank job but torch.distributed is not "
                           "initialized: call init_process_group before the first forward")
    return dist.group.WORLD.group_name


class KTMoE(nn.Module):
    """Routed SwiGLU experts (optionally with LoRA) computed on the CPU of one owner rank.

    ``forward(hidden_states[..., H]) -> [..., H]``: the router (``self.gate``) runs on the
    rank's own device; hidden states, expert ids and routing weights are gathered to the
    owner rank, ``kt.moe`` runs there on the CPU, and each rank gets its rows back. In one
    process (no process group, or world size 1) the same code runs without collectives.

    Parameters: ``gate`` (the router: by default a :class:`SoftmaxTopKRouter` with
    ``gate.weight`` ``[E, H]``, or the ``router`` module given, mapping ``x [T, H]`` to
    ``(topk_weights, topk_ids)``, each ``[T, K]``); on the owner rank
    only, ``gate_proj``/``up_proj`` ``[E, I, H]``, ``down_proj`` ``[E, H, I]`` and, with
    ``lora_rank > 0``, the PEFT-layout adapters ``{gate,up,down}_lora_{a,b}``
    (``[E, r, in]`` / ``[E, out, r]``, B initialised to zero). Other ranks allocate no expert
    memory at all. Base weights require grad only with ``train_base=True``. Every rank also holds
    ``grad_anchor`` (0 elements, trainable when the experts are) and ``expert_grad_norm`` (1
    element, frozen): see :mod:`kt_ops.distributed` (DDP, FSDP2, gradient clipping).

    Quantized experts (``expert_format="fp8" | "int8" | "int4"``, see
    :mod:`kt_ops.quantization`): ``gate_proj``/``up_proj``/``down_proj`` hold the quantized
    weights (float8_e4m3fn / int8 / uint8 with two int4 values per byte) and
    ``gate_scale``/``up_scale``/``down_scale`` their scales, all frozen (``train_base=True``
    is refused); activations, LoRA, routing weights and gradients stay in ``dtype``, so the
    only error is the weights' own rounding. ``group_size`` (int4 only: 32, 64 or 128,
    default 32) is the number of input columns per int4 scale.

    ``swiglu_limit`` (None, or a number > 0): the experts clamp gate at ``min(g, L)`` and up at
    ``clamp(u, -L, L)`` before ``silu(g)·u``, as transformers' clamped SwiGLU families
    (DeepSeek-V4, GLM-5, HY-V4) do. ``activation="gelu_tanh"``: GeGLU experts (GELU's tanh
    approximation in place of SiLU, as Gemma 4's). ``activation="swigluoai"`` with
    ``swiglu_alpha=α``: gpt-oss's SwiGLU ``g·σ(α·g)·(u + 1)`` (MiniMax-M3's too; gpt-oss clamps
    at ``swiglu_limit=7`` with ``α = 1.702``).

    ``expert_bias=True``: per-expert biases ``gate_bias``/``up_bias`` ``[E, I]`` and
    ``down_bias [E, H]`` (gpt-oss's experts), in ``dtype``, initialised to zero and, like the
    base weights, trained only with ``train_base=True``.

    Gradient semantics: the owner's expert (and LoRA) gradients are the *average* over ranks
    of each rank's loss gradient, exactly what DDP would give if every rank held the experts,
    so the same optimizer settings work with 1 or N ranks. Router gradients are each rank's
    own (average them with DDP, as for any replicated parameter); hidden-state gradients
    are each rank's own.

    One owner per node: with ``process_group`` the node's ranks (its tokens go to the node's
    owner) and ``expert_replica_group`` the group of the owners of all nodes (each holding a
    replica of the experts), the owners average their expert gradients over that group as
    they are accumulated (a hook per trainable expert tensor), so N nodes of R ranks train like
    one process on all N·R ranks' batches: the same optimizer step keeps the replicas equal.

    ``owners="per-node"`` builds that placement from torchrun's environment instead (the node's
    local rank 0 owns, the groups are made on first use; :mod:`kt_ops.placement`);
    ``owners="rank0"`` is the default placement, named.

    Sharded experts (``expert_shards=S``): the experts are split into S contiguous ranges
    (``expert_starts``; sizes differ by at most one) held by the group's ranks 0..S-1 (of each
    node with ``owners="per-node"``), each allocating only its own range (``expert_range``;
    its expert tensors are ``[E_s, ...]``). Each token goes only to the shards of its experts
    (``kt.dispatch_to_shards``), every owner runs ``kt.moe`` on what it received, and the
    partial outputs come back summed in float32 in shard order (``kt.combine_from_shards``);
    backward is the adjoint. Gradients mean what they mean with one owner. ``S = 1`` is the
    one-owner layer (same code path).

    The rank and world size come from ``process_group`` (or the default group) when it
    exists, else from ``RANK``/``WORLD_SIZE`` (see :mod:`kt_ops.rank_discovery`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 lora_rank: int = 0, lora_alpha: Optional[float] = None, train_base: bool = False,
                 norm_topk_prob: bool = True, owner_rank: int = 0,
                 process_group: Optional[dist.ProcessGroup] = None, dtype: torch.dtype = torch.bfloat16,
                 router: Optional[nn.Module] = None, expert_format: Optional[str] = None,
                 group_size: Optional[int] = None, expert_replica_group: Optional[dist.ProcessGroup] = None,
                 swiglu_limit: Optional[float] = None, activation: str = "silu",
                 swiglu_alpha: Optional[float] = None, expert_bias: bool = False, owners: Optional[str] = None,
                 expert_shards: int = 1):
        nn.Module.__init__(self)  # not super(): a KTExperts may derive from a PEFT class too (hf.peft_experts)
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KTMoE: {name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"KTMoE: top_k ({top_k}) must be <= num_experts ({num_experts})")
        if not isinstance(lora_rank, int) or lora_rank < 0:
            raise ValueError(f"KTMoE: lora_rank must be an int >= 0, got {lora_rank!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"KTMoE: dtype must be float32, bfloat16 or float64, got {dtype}")
        fmt = quantization.ExpertFormat.parse(expert_format, group_size, "KTMoE")  # or as parsed by the caller
        fmt.check_trainable(train_base, "KTMoE")
        if (problem := fmt.size_problem(hidden_size, intermediate_size)) is not None:
            raise ValueError(f"KTMoE: {problem}")
        self.expert_format, self.group_size = fmt.name, fmt.group_size
        expert_format = fmt.name
        if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0):
            raise ValueError(f"KTMoE: swiglu_limit must be None or a number > 0, got {swiglu_limit!r}")
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        if activation not in ("silu", "gelu_tanh", "swigluoai"):
            raise ValueError(f"KTMoE: activation must be 'silu', 'gelu_tanh' or 'swigluoai', got {activation!r}")
        self.activation = activation
        if activation == "swigluoai" and not (isinstance(swiglu_alpha, (int, float)) and 0 < swiglu_alpha < math.inf):
            raise ValueError(f"KTMoE: activation='swigluoai' needs swiglu_alpha, a finite number > 0 "
                             f"(gpt-oss: 1.702), got {swiglu_alpha!r}")
        if activation != "swigluoai" and swiglu_alpha is not None:
            raise ValueError(f"KTMoE: swiglu_alpha is the alpha of activation='swigluoai'; it must be None with "
                             f"activation={activation!r}, got {swiglu_alpha!r}")
        self.swiglu_alpha = None if swiglu_alpha is None else float(swiglu_alpha)
        self.expert_bias = bool(expert_bias)
        self.expert_dtype = dtype  # of activations, LoRA and (unless quantized) the base weights
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.lora_rank = lora_rank
        self.lora_alpha = float(lora_alpha) if lora_alpha is not None else float(max(lora_rank, 1))
        self.lora_scale = self.lora_alpha / lora_rank if lora_rank else 1.0
        self.train_base = train_base
        self.norm_topk_prob = norm_topk_prob
        self._placement = resolve_placement(owners, owner_rank, process_group, expert_replica_group, "KTMoE",
                                            expert_shards, num_experts)
        self.rank, self.world_size = self._placement.rank, self._placement.world_size
        self.owner_rank = self._placement.owner_rank
        self.expert_shards = self._placement.shards
        self.expert_starts = shard_starts(num_experts, self.expert_shards)
        shard = self._placement.shard
        # The experts this rank holds (global ids): all of them on a one-owner layer's owner.
        self.expert_range = range(self.expert_starts[shard], self.expert_starts[shard + 1]) if shard is not None \
            else range(0)
        self.layer_id = next(_layer_ids)  # same on every rank when the model is built the same way

        self.set_replicated_parameters(None, dtype, trainable=bool(lora_rank or train_base))  # default device
        # The router: x [T, H] -> (topk_weights [T, K], topk_ids [T, K]). Model integrations
        # (kt_ops.hf) pass the architecture's own router so that routing is reproduced exactly.
        self.gate = router if router is not None else SoftmaxTopKRouter(
            hidden_size, num_experts, top_k, norm_topk_prob, dtype=dtype)
        if self.is_owner:
            E, I, H = len(self.expert_range), intermediate_size, hidden_size
            cpu = {"dtype": dtype, "device": "cpu"} if not _building_on_meta() else {"dtype": dtype}
            for name, scale_name, (out, inp) in zip(_BASE_NAMES, _SCALE_NAMES, ((I, H), (I, H), (H, I))):
                if expert_format is None:
                    setattr(self, name, nn.Parameter(torch.empty(E, out, inp, **cpu), requires_grad=train_base))
                    continue
                shape, qdtype, scale_shape, scale_dtype = quantization.storage_layout(
                    expert_format, E, out, inp, self.group_size)
                setattr(self, name, nn.Parameter(torch.empty(shape, **{**cpu, "dtype": qdtype}), requires_grad=False))
                setattr(self, scale_name,
                        nn.Parameter(torch.empty(scale_shape, **{**cpu, "dtype": scale_dtype}), requires_grad=False))
                if fmt.has_global_scale:
                    setattr(self, _GLOBAL_SCALE_NAMES[_BASE_NAMES.index(name)],
                            nn.Parameter(torch.ones(E, **{**cpu, "dtype": torch.float32}), requires_grad=False))
            if expert_bias:
                for name, shape in zip(_BIAS_NAMES, ((E, I), (E, I), (E, H))):
                    setattr(self, name, nn.Parameter(torch.empty(shape, **cpu), requires_grad=train_base))
            if lora_rank:
                for name, shape in lora_shapes(E, I, H, lora_rank).items():
                    setattr(self, name, nn.Parameter(torch.empty(shape, **cpu)))
        self.reset_parameters()
        self.register_gradient_hooks()

    def set_replicated_parameters(self, device: Optional[torch.device], dtype: torch.dtype, trainable: bool) -> None:
        """(Re)creates, on ``device`` (None: the default device), the two parameters every rank holds, owner or not:

        * ``grad_anchor``: 0 elements of ``dtype``, requiring grad when the experts train
          (``trainable``), added (as 0) to the layer's output. It keeps a rank whose own
          parameters are all frozen in the backward that the owner's experts need (its output
          requires grad), and gives DDP the same parameter set on every rank once the owner-only
          expert tensors are ignored (kt_ops.distributed). It holds no memory and never changes.
        * ``expert_grad_norm``: after each backward, the norm of the owner's expert gradients as
          the .grad of this frozen 1-element parameter off the owner (0 on it), so that gradient
          clipping by the norm of a rank's own parameters (clip_grad_norm_, Trainer's
          max_grad_norm) sees the same total norm, and clips by the same factor, on every rank.

        Call :meth:`register_gradient_hooks` after replacing them."""
        self.grad_anchor = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=trainable)
        self.expert_grad_norm = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks whose tokens go to this layer's owner (None: the default group)."""
        return self._placement.process_group

    @property
    def expert_replica_group(self) -> Optional[dist.ProcessGroup]:
        """The owners that hold replicas of the experts and average their gradients, or None."""
        return self._placement.expert_replica_group

    def _unique_expert_tensors(self) -> list:
        """The owner's expert tensors, each once (gate_lora_a and up_lora_a may be one tensor;
        a subclass with several LoRA adapters adds all of theirs: :meth:`_all_lora_tensors`)."""
        tensors = self.expert_tensors()[:3] + self.expert_biases() + tuple(self._all_lora_tensors())
        return list({id(p): p for p in tensors if p is not None}.values())

    def _all_lora_tensors(self) -> list:
        """Every LoRA tensor this rank holds (the layer's one set)."""
        return list(self.expert_tensors()[3:]) if self.lora_rank and self.is_owner else []

    def _forward_lora(self) -> tuple[tuple, float]:
        """(the six LoRA tensors kt.moe computes with now, or six Nones; their scale)."""
        return self.expert_tensors()[3:], self.lora_scale

    @property
    def is_owner(self) -> bool:
        """Whether this rank holds experts (the owner, or the owner of a shard)."""
        return self._placement.is_owner

    def reset_parameters(self) -> None:
        """Router from the global RNG; experts from a generator seeded by one draw of it.

        Every rank draws the same numbers from the global RNG whether or not it owns the
        experts, so the rest of a model built after this layer initialises identically on
        all ranks (and like a single-process run with the same seed). An owner of a shard
        gets the values its experts have in the draw of all of them (kt_ops.expert_init), so
        the shard count never changes the weights."""
        if self._on_meta_device():
            return
        with torch.no_grad():
            if isinstance(getattr(self, "gate", None), SoftmaxTopKRouter):  # KTExperts has none
                nn.init.normal_(self.gate.weight, std=self.hidden_size ** -0.5)
            expert_seed = int(torch.randint(0, 2**62, ()).item())
            if not self.is_owner:
                return
            g = torch.Generator().manual_seed(expert_seed)
            E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
            mine = self.expert_range
            for name, scale_name, (out, fan_in) in zip(_BASE_NAMES, _SCALE_NAMES, ((I, H), (I, H), (H, I))):
                w = draw_experts(torch.randn, (E, out, fan_in), g, mine) * fan_in ** -0.5
                if self.expert_format is None:
                    getattr(self, name).copy_(w)
                else:
                    self.set_quantized_weight(name, w)
            for name in _BIAS_NAMES if self.expert_bias else ():
                nn.init.zeros_(getattr(self, name))
            if self.lora_rank:
                for name in ("gate_lora_a", "up_lora_a", "down_lora_a"):
                    a = getattr(self, name)  # PEFT's init: kaiming_uniform(a=sqrt(5)) = U(±1/sqrt(in))
                    bound = a.shape[-1] ** -0.5
                    a.copy_(draw_experts(torch.rand, (E,) + tuple(a.shape[1:]), g, mine) * (2 * bound) - bound)
                for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
                    nn.init.zeros_(getattr(self, name))

    def expert_tensors(self) -> tuple:
        """The owner's (gate_proj, up_proj, down_proj, *6 LoRA tensors or None)."""
        lora = tuple(getattr(self, n) for n in _LORA_NAMES) if self.lora_rank else (None,) * 6
        return (self.gate_proj, self.up_proj, self.down_proj) + lora

    def expert_biases(self) -> tuple:
        """The owner's (gate_bias, up_bias, down_bias) with ``expert_bias=True``, or three Nones."""
        return tuple(getattr(self, n) for n in _BIAS_NAMES) if self.expert_bias else (None,) * 3

    def register_gradient_hooks(self) -> None:
        """The gradient hooks of a multi-rank layer (idempotent; call again after replacing its
        parameters, as kt_ops.patch_model does):

        * every rank: when the grad anchor's gradient is accumulated (every backward through the
          layer), queue :meth:`share_expert_grad_norm` for the end of that backward;
        * an owner with an ``expert_replica_group`` of several owners: average each trainable
          expert tensor's gradient over the group once it is accumulated."""
        if self.world_size > 1 and self.grad_anchor.requires_grad and not hasattr(self.grad_anchor, "_kt_norm_hook"):
            def queue_share(_param):
                if not self._norm_share_queued:
                    self._norm_share_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self.share_expert_grad_norm)

            self._norm_share_queued = False
            self.grad_anchor.register_post_accumulate_grad_hook(queue_share)
            self.grad_anchor._kt_norm_hook = True
        placement = self._placement
        if not self.is_owner or placement.replicas() == 1:
            return
        for param in (p for p in self._unique_expert_tensors() if p.requires_grad):
            if getattr(param, "_kt_replica_hook", None) is placement:
                continue

            def average(p, placement=placement):
                group = placement.expert_replica_group  # owners="per-node": made on first use
                dist.all_reduce(p.grad, group=group)  # SUM: gloo has no AVG
                p.grad.div_(group.size())

            param.register_post_accumulate_grad_hook(average)
            param._kt_replica_hook = placement

    def share_expert_grad_norm(self) -> None:
        """The squared norms of the owners' expert gradients are summed over the layer's group;
        each rank keeps the part it does not hold as ``expert_grad_norm.grad`` (sqrt of the
        total less its own: 0 on a one-owner layer's owner), so that a rank's local gradient
        norm includes all the experts' on every rank. Runs at the end of each backward through
        the layer (see :meth:`register_gradient_hooks`)."""
        self._norm_share_queued = False
        share = self.expert_grad_norm
        own = torch.zeros(1, dtype=torch.float64, device=share.device)
        if self.is_owner:
            for p in self._unique_expert_tensors():
                if p.grad is not None:
                    own += p.grad.detach().double().pow(2).sum().to(own.device)
        total = own.clone()
        dist.all_reduce(total, group=self.process_group)  # only the owners add a non-zero
        share.grad = (total - own).clamp(min=0).sqrt().to(share.dtype)

    def expert_scales(self) -> tuple:
        """The owner's (gate_scale, up_scale, down_scale) of quantized experts, or three Nones."""
        if self.expert_format is None:
            return (None,) * 3
        return tuple(getattr(self, n) for n in _SCALE_NAMES)

    def expert_global_scales(self) -> tuple:
        """The owner's (gate_global_scale, up_global_scale, down_global_scale) of nvfp4 experts,
        or three Nones."""
        if self.expert_format != "nvfp4":
            return (None,) * 3
        return tuple(getattr(self, n) for n in _GLOBAL_SCALE_NAMES)

    def set_quantized_weight(self, name: str, weight: Tensor) -> None:
        """Quantizes float ``weight`` (``[E, out, in]``, any float dtype) into the quantized
        base weight ``name`` ("gate_proj", "up_proj" or "down_proj") and its scale (and nvfp4's
        global scale), in place."""
        i = _BASE_NAMES.index(name)
        data, scale = getattr(self, name), getattr(self, _SCALE_NAMES[i])
        q, s, *global_scale = quantization.quantize(weight, self.expert_format, self.group_size, scale_dtype=scale.dtype,
                                                    name=name)
        with torch.no_grad():
            data.copy_(q)
            scale.copy_(s)
            if global_scale:
                getattr(self, _GLOBAL_SCALE_NAMES[i]).copy_(global_scale[0])

    def expert_nbytes(self) -> int:
        """Bytes held by the base expert weights on this rank, scales (and biases) included (0
        off the owners; an owner's shard only)."""
        if not self.is_owner:
            return 0
        biases = sum(b.numel() * b.element_size() for b in self.expert_biases() if b is not None)
        return quantization.nbytes(self.gate_proj, self.up_proj, self.down_proj, *self.expert_scales(),
                                   *self.expert_global_scales()) + biases

    def dequantized_experts(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(gate [E, I, H], up [E, I, H], down [E, H, I])`` in float32: the weights kt.moe
        computes with (for quantized experts, exactly its dequantized values). Owner only; a
        shard's owner gets its experts (``expert_range``)."""
        if not self.is_owner:
            raise RuntimeError(f"KTMoE.dequantized_experts: rank {self.rank} does not hold the experts "
                               f"(owner_rank={self.owner_rank})")
        if self.expert_format is None:
            return tuple(w.detach().float() for w in (self.gate_proj, self.up_proj, self.down_proj))
        return tuple(quantization.dequantize(w.detach(), s.detach(), None if g is None else g.detach())
                     for w, s, g in zip((self.gate_proj, self.up_proj, self.down_proj), self.expert_scales(),
                                        self.expert_global_scales()))

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` / ``.bfloat16()`` move the router, never the experts: they
        stay in CPU memory (a dtype change still applies to them). The target dtype is read
        off an empty probe tensor, so no expert-sized copy is ever made on the device."""
        # The experts stay where they are (the grad anchor and the expert-gradient norm move like
        # any parameter).
        experts = {k: v for k, v in self._parameters.items() if k not in _REPLICATED_NAMES}
        for k in experts:
            del self._parameters[k]
        frozen_format = set(_BASE_NAMES + _SCALE_NAMES + _GLOBAL_SCALE_NAMES) if self.expert_format is not None else set()
        try:
            super()._apply(fn, recurse)
            target = fn(torch.empty(0, dtype=self.expert_dtype))
            if target.dtype.is_floating_point:
                self.expert_dtype = target.dtype
        finally:
            for name, param in experts.items():
                # Quantized weights and their scales keep their storage format.
                if param is not None and param.device.type != "meta" and name not in frozen_format:
                    target = fn(torch.empty(0, dtype=param.dtype))
                    if target.dtype != param.dtype and target.dtype.is_floating_point:
                        param.data = param.data.to(target.dtype)
                self._parameters[name] = param
        return self

    def _on_meta_device(self) -> bool:
        return any(p.device.type == "meta" for p in self.parameters())

    def _experts(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """kt.moe where the experts live (the owner's CPU); x, ids, weights may be anywhere."""
        device, dtype = self.gate_proj.device, self.expert_dtype
        lora, lora_scale = self._forward_lora()
        out = torch.ops.kt.moe(x.to(device, dtype), ids.to(device), weights.to(device),
                               *self.expert_tensors()[:3], *lora, lora_scale, *self.expert_scales(), self.swiglu_limit,
                               self.activation, self.swiglu_alpha, *self.expert_biases(), *self.expert_global_scales())
        return out.to(x.device, x.dtype)

    def _group_name(self) -> str:
        return self.process_group.group_name if self.process_group is not None else _default_group_name()

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        weights, ids = self.gate(x)
        return self.routed_experts(x, ids, weights).reshape(shape)

    def routed_experts(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The experts part alone, for routing computed elsewhere: x [T, H], topk_ids and
        topk_weights [T, K] on this rank -> [T, H] (gathered to the owner and back)."""
        ids, weights = topk_ids, topk_weights
        anchor = self.grad_anchor.sum()  # 0, requiring grad when the experts train (see __init__)
        if self.world_size == 1:
            return self._experts(x, ids, weights) + anchor.to(x.dtype)

        if (torch.is_grad_enabled() and (self.lora_rank or self.train_base)
                and not (x.requires_grad or weights.requires_grad or self.grad_anchor.requires_grad)):
            # The owner's experts train, so its backward needs every rank's output gradients,
            # but nothing on this rank would run backward through this layer (the grad anchor
            # was frozen too): the owner would wait for this rank forever. (Same condition, same
            # error, on every rank.)
            raise RuntimeError(
                f"KTMoE (layer {self.layer_id}, rank {self.rank}): the experts are trainable but neither "
                "hidden_states, the routing weights nor the layer's grad_anchor require grad here, so this "
                "rank would not run the backward the owner's experts need. Leave grad_anchor trainable "
                "(it is a 0-element parameter), or make the layer's input require grad.")
        if self.expert_shards > 1:
            return self._sharded_experts(x, ids, weights, anchor)
        args = (self.rank, self.world_size, self.owner_rank, self.layer_id, self._group_name())
        (x_all, ids_all, weights_all), lengths = torch.ops.kt.gather_to_owner([x, ids, weights], *args)
        out_all = self._received_experts(x_all, ids_all, weights_all, anchor)
        (out,) = torch.ops.kt.scatter_from_owner([out_all], lengths, x.shape[0], *args)
        return out

    def _received_experts(self, x: Tensor, ids: Tensor, weights: Tensor, anchor: Tensor) -> Tensor:
        """The experts on the rows this rank received (all ranks' on an owner, 0 rows elsewhere)."""
        if self.is_owner:
            # DDP semantics: the experts see every rank's loss, so scale their gradients by
            # 1/world_size, and undo the scale on the gradients that flow back to the ranks.
            w = float(self.world_size)
            x = torch.ops.kt.scale_grad(x, w)
            weights = torch.ops.kt.scale_grad(weights, w)
            return torch.ops.kt.scale_grad(self._experts(x, ids, weights), 1.0 / w) + anchor.to(x.dtype)
        # [0, H]: nothing to compute. Built from both received inputs and the grad anchor (0
        # elements, so no arithmetic really happens) so that this rank's output needs a gradient,
        # and this rank joins the backward collectives, whenever an owner's does.
        return x + weights.sum(-1, keepdim=True).to(x.dtype) + anchor.to(x.dtype)

    def _sharded_experts(self, x: Tensor, ids: Tensor, weights: Tensor, anchor: Tensor) -> Tensor:
        """The routed experts with ``expert_shards > 1``: each token to the shards of its experts
        and back (kt_ops/shard_collectives.py), with the gradient scaling of the one-owner path."""
        args = (self.expert_starts, self.rank, self.world_size, self.layer_id, self._group_name())
        (x_in,), (weights_in,), local_ids, counts = torch.ops.kt.dispatch_to_shards([x], [weights], ids, *args)
        out_in = self._received_experts(x_in, local_ids, weights_in, anchor)
        (out,), _ = torch.ops.kt.combine_from_shards([out_in], [], ids, counts, *args)
        return out


class SoftmaxTopKRouter(nn.Module):
    """Softmax over experts (in fp32), top-k, optionally renormalised (Qwen3-MoE's router).
    ``forward(x [T, H]) -> (topk_weights [T, K] fp32, topk_ids [T, K] int64)``.

    The logits are computed in fp32 whatever the weight's dtype: more exact for the top-k, and
    PyTorch's bf16 GEMMs on CPUs without AVX512-BF16 are up to ~150x slower than fp32 (the
    backward's [T, E] @ [E, H] took 0.94 s against 6 ms at T=1024, H=2048, E=128 on Zen 3)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.softmax(F.linear(x.float(), self.weight.float()), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def _building_on_meta() -> bool:
    """True inside `with torch.device("meta")`: then expert weights are not forced onto the CPU."""
    return torch.empty(0).device.type == "meta"
