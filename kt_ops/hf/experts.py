"""kt as a transformers experts implementation.

transformers 5.x gives every MoE family one experts contract (``transformers.integrations.moe``):
a module whose class is decorated with ``@use_experts_implementation``, holding
``gate_up_proj [E, 2I, H]`` (gate rows first, then up) and ``down_proj [E, H, I]``, with
``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``; the
model's own MoE block computes the routing and calls it. Slots whose expert id is outside
``[0, E)`` (``num_experts`` or negative: masked by the model) contribute nothing.

Two ways in:

* :func:`patch_model` (``kt_ops.hf.patch``) swaps each such module for a :class:`KTExperts`:
  the expert weights move to the owner rank's CPU (other ranks hold none), with LoRA, the
  gather/scatter collectives and the kt checkpoint policy. The model's block, router and
  shared experts are untouched, so routing is the model's own code, exact by construction.
* ``"kt"`` registered in transformers' ``ALL_EXPERTS_FUNCTIONS`` (:func:`register_kt_experts`;
  patch_model calls it): ``model.set_experts_implementation("kt")`` or
  ``from_pretrained(..., experts_implementation="kt")`` runs the unchanged experts modules
  through ``kt.moe`` on their own weights, in one process, autograd included.

What the kernels compute is SwiGLU experts: concatenated gate|up, not transposed, no bias,
gated, no post-expert norm, ``act(gate)·up`` with ``act`` SiLU or GELU's tanh approximation
(or, with a ``swiglu_limit`` L, ``act(min(gate, L))·clamp(up, -L, L)``), float32/bfloat16/float64
weights.
:func:`experts_support` says why a module is refused. The gating is checked by what it
computes, not by name: transformers' backends call the module's ``_apply_gate`` (the
decorator's default is ``act_fn(gate)·up``), which some families override, e.g. to clamp gate
and up at ``swiglu_limit`` (DeepSeek-V4, GLM-5, HY-V4; MiniMax-M3 and gpt-oss also scale
and shift it, which kt.moe does not compute): each such gating is run
once on a range of pre-activations and compared with those forms, and kt.moe runs the one it
matched (:func:`gating_of`); any other gating is refused.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.layer import KTMoE  # transformers itself is imported lazily (register_kt_experts)

# The decorator's layout flags (set on each instance by use_experts_implementation) and the
# value kt.moe's layout needs.
_LAYOUT_FLAGS = (("is_transposed", False), ("has_bias", False), ("is_concatenated", True), ("has_gate", True),
                 ("has_post_expert_norm", False))
# Pre-activations the gating is probed at: far beyond any clamp the families use (gpt-oss 7,
# DeepSeek-V4 and GLM-5 10), and far beyond what a tiny random model's logits would reach.
_GATE_PROBE_RANGE = 1000.0
_KT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def is_experts_class(cls: type) -> bool:
    """True for a transformers experts class: ``@use_experts_implementation`` replaced its
    forward by the dispatcher defined in transformers/integrations/moe.py."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")


def is_experts_module(module: nn.Module) -> bool:
    """True for instances of a transformers experts class (:func:`is_experts_class`)."""
    return is_experts_class(type(module))


def experts_support(module: nn.Module) -> Optional[str]:
    """None when kt can run this experts module, else why not (a sentence naming the class)."""
    cls = type(module).__name__
    for flag, needed in _LAYOUT_FLAGS:
        value = getattr(module, flag, needed)
        if value != needed:
            return f"{cls} has {flag}={value!r}; kt.moe computes {flag}={needed} experts"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor):
        return f"{cls} holds no gate_up_proj / down_proj tensors (already converted?)"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        return (f"{cls}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got {tuple(gate_up.shape)} "
                f"and {tuple(down.shape)}")
    E, two_i, H = gate_up.shape
    if tuple(down.shape) != (E, H, two_i // 2):
        return f"{cls}: down_proj must have shape [E, H, I] = {[E, H, two_i // 2]}, got {list(down.shape)}"
    why, _, _ = _gating_verdict(module, two_i // 2)
    if why is not None:
        return why
    if gate_up.dtype not in _KT_DTYPES or down.dtype != gate_up.dtype:
        return (f"{cls}'s expert weights are {gate_up.dtype}; kt.moe runs float32, bfloat16 or float64 experts "
                f"(cast the model first, e.g. model.to(torch.bfloat16))")
    return None


# Verdicts of _probe_gating, per (experts class, activation, clamp limit): the probe runs once,
# eagerly, and a compiled forward reads the verdict (torch.compile cannot trace the probe).
_GATING_VERDICTS: dict = {}


def _limit_attribute(module: nn.Module) -> Optional[float]:
    """The clamp a family's gating names (``swiglu_limit``, or gpt-oss-style ``limit``), if any."""
    for name in ("swiglu_limit", "limit"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _gating_verdict(module: nn.Module, intermediate: int) -> tuple[Optional[str], Optional[float], str]:
    """(None, swiglu_limit, activation) when kt.moe computes the module's gating
    (``act(gate)·up``, act "silu" or "gelu_tanh", clamped at swiglu_limit or not), else
    (why not, None, "silu"). transformers' default ``_apply_gate`` (``act_fn(gate)·up``) with a
    SiLU ``act_fn`` is known to be plain SwiGLU; any other gating is probed (_probe_gating)."""
    act = getattr(module, "act_fn", None)
    apply_gate = getattr(type(module), "_apply_gate", None)
    if getattr(apply_gate, "__name__", None) == "_default_apply_gate" or apply_gate is None:
        if act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation"):
            return None, None, "silu"
    limit = _limit_attribute(module)
    key = (type(module), act if callable(act) and not isinstance(act, nn.Module) else type(act), limit)
    if key not in _GATING_VERDICTS:
        if torch.compiler.is_compiling():
            return (f"{type(module).__name__} has a gating of its own, which kt checks by running it: call the "
                    f"model once without torch.compile first"), None, "silu"
        _GATING_VERDICTS[key] = _probe_gating(module, intermediate, limit)
    return _GATING_VERDICTS[key]


def gating_of(module: nn.Module) -> dict:
    """``{"swiglu_limit": ..., "activation": ...}``: the gating kt.moe must run this experts
    module with; call after :func:`experts_support` accepted it."""
    _, limit, activation = _gating_verdict(module, module.gate_up_proj.shape[1] // 2)
    return {"swiglu_limit": limit, "activation": activation}


_ACTIVATIONS = {"silu": torch.nn.functional.silu,
                "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


def _probe_gating(module: nn.Module, intermediate: int, limit: Optional[float]) -> tuple[Optional[str], Optional[float], str]:
    """_gating_verdict's probe: the module's gating (its ``_apply_gate``, else
    ``act_fn(gate)·up``) on float32 CPU pre-activations spanning ±_GATE_PROBE_RANGE against
    ``act(gate)·up`` in float64 for each activation kt.moe computes, unclamped and, when the
    module names a limit, clamped."""
    cls = type(module).__name__
    act = getattr(module, "act_fn", None)
    act_name = getattr(act, "__name__", None) or type(act).__name__
    # Every gate value against every up value would be large; instead two interleaved sweeps: the
    # range where activations differ in shape (|x| <= 8, densely) and far beyond any clamp.
    values = torch.cat([torch.linspace(-8, 8, 1601), torch.linspace(-_GATE_PROBE_RANGE, _GATE_PROBE_RANGE, 401)])
    rows = -(-values.numel() // intermediate)
    reps = -(-rows * intermediate // values.numel())
    gate_part = values.repeat(reps)[: rows * intermediate].view(rows, intermediate)
    up_part = values.flip(0).repeat(reps)[: rows * intermediate].view(rows, intermediate)
    gate_up = torch.cat([gate_part, up_part], dim=1).float()
    gate, up = gate_up.double().chunk(2, dim=-1)
    limits = [None] + ([limit] if limit is not None and limit > 0 else [])
    try:
        apply_gate = getattr(module, "_apply_gate", None)
        with torch.no_grad():
            got = apply_gate(gate_up) if apply_gate is not None else act(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        for activation, fn in _ACTIVATIONS.items():
            for candidate in limits:
                g, u = (gate, up) if candidate is None else (gate.clamp(max=candidate), up.clamp(-candidate, candidate))
                expected = fn(g) * u
                # Per element, float32's rounding (GELU-tanh's 1 + tanh cancels: an error up to about
                # 2^-24·|g·u|) passes; GELU's erf form against its tanh one (4.7e-4·|u| at 2) fails.
                allowed = 1e-5 * expected.abs() + 1e-6 * (gate * up).abs() + 1e-6
                if isinstance(got, Tensor) and got.shape == expected.shape and bool(
                        ((got.double() - expected).abs() <= allowed).all()):
                    return None, candidate, activation
    except Exception as e:  # noqa: BLE001 - a gating we cannot even call is not ours
        return (f"{cls}'s gating cannot be probed ({type(e).__name__}: {e}); kt.moe computes silu(gate)·up "
                f"and gelu_tanh(gate)·up experts only"), None, "silu"
    if limit is not None:
        return (f"{cls}'s gating with swiglu_limit={limit} is not act(min(gate, limit))·clamp(up, -limit, limit) "
                f"(act: silu or gelu_tanh); kt.moe computes that and unclamped gated experts only"), None, "silu"
    return (f"{cls}'s activation is {act_name}; kt.moe computes SwiGLU and GeGLU experts (silu(gate)·up, "
            f"gelu_tanh(gate)·up) only"), None, "silu"


def _masked(top_k_index: Tensor, top_k_weights: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Masked slots (ids outside [0, E)) -> expert 0 with weight 0: they add nothing, and their
    routing-weight gradient is 0, as in transformers' loops that skip them. Branch-free, so it
    traces under torch.compile."""
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    ids = torch.where(valid, top_k_index, torch.zeros_like(top_k_index))
    weights = torch.where(valid, top_k_weights, torch.zeros_like(top_k_weights))
    return ids, weights


class KTExperts(KTMoE):
    """A transformers experts module on kt: same ``forward(hidden_states [T, H], top_k_index,
    top_k_weights) -> [T, H]``, experts on the owner rank's CPU (``gate_proj``/``up_proj``
    ``[E, I, H]``, ``down_proj [E, H, I]``, LoRA ``{gate,up,down}_lora_{a,b}``), routing from
    the model. Built by :func:`kt_ops.patch_model`; everything else is :class:`~kt_ops.KTMoE`'s
    (collectives, DDP gradient semantics, ``routed_experts``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, **kwargs):
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, router=nn.Identity(), **kwargs)
        del self.gate  # the routing is the model's: no router here

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        ids, weights = _masked(top_k_index, top_k_weights, self.num_experts)
        return self.routed_experts(hidden_states, ids, weights)


def kt_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                       top_k_weights: Tensor) -> Tensor:
    """The ``"kt"`` entry of transformers' experts interface: ``kt.moe`` on the module's own
    ``gate_up_proj`` / ``down_proj`` (wherever they live; computed on the CPU)."""
    why = experts_support(self)
    if why is not None:
        raise ValueError(f'experts_implementation="kt": {why}')
    gate_up, down = self.gate_up_proj, self.down_proj
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    ids, weights = _masked(top_k_index, top_k_weights, E)
    cpu = torch.device("cpu")
    out = torch.ops.kt.moe(hidden_states.to(cpu, gate_up.dtype), ids.to(cpu), weights.to(cpu),
                           gate_up[:, :I].to(cpu), gate_up[:, I:].to(cpu), down.to(cpu),
                           None, None, None, None, None, None, 1.0, None, None, None, *gating_of(self).values())
    return out.to(hidden_states.device, hidden_states.dtype)


def register_kt_experts() -> None:
    """Register ``"kt"`` in transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("kt", kt_experts_forward)
