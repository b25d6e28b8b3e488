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

What the kernels compute is gated experts without a post-expert norm, in any of transformers'
layouts (:mod:`kt_ops.hf.expert_layout`: transposed or not, gate|up concatenated or interleaved,
with biases or without), ``act(gate)·up`` with ``act`` SiLU or GELU's tanh approximation, or
gpt-oss's ``gate·σ(α·gate)·(up + 1)`` (kt.moe's "swigluoai"), each with or without a clamp at
``swiglu_limit`` L (``gate <- min(gate, L)``, ``up <- clamp(up, -L, L)`` first);
float32/bfloat16/float64 weights.
:func:`experts_support` says why a module is refused. The gating is checked by what it
computes, not by name: transformers' backends call the module's ``_apply_gate`` (the
decorator's default is ``act_fn(gate)·up``), which some families override, e.g. to clamp gate
and up at ``swiglu_limit`` (DeepSeek-V4, GLM-5, HY-V4) or to compute gpt-oss's form
(MiniMax-M3): each such gating is run once on a range of pre-activations and compared with
those forms, and kt.moe runs the one it matched (:func:`gating_of`); any other gating is refused.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.hf.expert_adapters import LORA_NAMES, ExpertAdapters, ExpertLoRA
from kt_ops.hf.expert_layout import ExpertsLayout
from kt_ops.layer import KTMoE  # transformers itself is imported lazily (register_kt_experts)

# The decorator's flags (set on each instance by use_experts_implementation) that kt.moe needs
# at one value; the others (is_transposed, is_concatenated, has_bias) are layouts it reads
# (ExpertsLayout).
_REQUIRED_FLAGS = (("has_gate", True), ("has_post_expert_norm", False))
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
    return _support_and_gating(module)[0]


def _support_and_gating(module: nn.Module) -> tuple[Optional[str], Optional[dict]]:
    """(None, the gating kt.moe runs it with: :func:`gating_of`) or (why not, None)."""
    cls = type(module).__name__
    for flag, needed in _REQUIRED_FLAGS:
        value = getattr(module, flag, needed)
        if value != needed:
            return f"{cls} has {flag}={value!r}; kt.moe computes {flag}={needed} experts", None
    layout = ExpertsLayout.of(module)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor):
        return f"{cls} holds no gate_up_proj / down_proj tensors (already converted?)", None
    names = ("[E, H, 2I]", "[E, I, H]") if layout.transposed else ("[E, 2I, H]", "[E, H, I]")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2 if layout.transposed else 1] % 2:
        return (f"{cls}: expected gate_up_proj {names[0]} and down_proj {names[1]}, got {tuple(gate_up.shape)} "
                f"and {tuple(down.shape)}"), None
    E, I, H = layout.sizes(gate_up)
    want = [E, I, H] if layout.transposed else [E, H, I]
    if list(down.shape) != want:
        return f"{cls}: down_proj must have shape {names[1]} = {want}, got {list(down.shape)}", None
    tensors = [gate_up, down]
    if layout.has_bias:
        biases = (("gate_up_proj_bias", [E, 2 * I]), ("down_proj_bias", [E, H]))
        for name, shape in biases:
            bias = getattr(module, name, None)
            if not isinstance(bias, Tensor) or list(bias.shape) != shape:
                got = list(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
                return f"{cls} has has_bias=True but its {name} is {got}, not a tensor of shape {shape}", None
            tensors.append(bias)
    why, gating = _gating_verdict(module, I)
    if why is not None:
        return why, None
    if gate_up.dtype not in _KT_DTYPES or any(t.dtype != gate_up.dtype for t in tensors):
        dtypes = " and ".join(sorted({str(t.dtype) for t in tensors}))
        return (f"{cls}'s expert weights are {dtypes}; kt.moe runs float32, bfloat16 "
                f"or float64 experts, all of one dtype (cast the model first, e.g. model.to(torch.bfloat16))"), None
    return None, gating


# Verdicts of _probe_gating, per (experts class, activation, limit, alpha): the probe runs once,
# eagerly, and a compiled forward reads the verdict (torch.compile cannot trace the probe).
_GATING_VERDICTS: dict = {}


def _number_attribute(module: nn.Module, names: tuple[str, ...]) -> Optional[float]:
    """The first of ``names`` the module holds as a number, as a float; None if none."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _gating(limit: Optional[float] = None, activation: str = "silu", alpha: Optional[float] = None) -> dict:
    """kt.moe's gating arguments, by name."""
    return {"swiglu_limit": limit, "activation": activation, "swiglu_alpha": alpha}


def _gating_verdict(module: nn.Module, intermediate: int) -> tuple[Optional[str], Optional[dict]]:
    """(None, gating) when kt.moe computes the module's gating (:func:`_gating`'s arguments),
    else (why not, None). transformers' default ``_apply_gate`` (``act_fn(gate)·up``) with a
    SiLU ``act_fn`` is known to be plain SwiGLU; any other gating is probed (_probe_gating)."""
    act = getattr(module, "act_fn", None)
    apply_gate = getattr(type(module), "_apply_gate", None)
    if getattr(apply_gate, "__name__", None) == "_default_apply_gate" or apply_gate is None:
        if act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation"):
            return None, _gating()
    # The clamp a family's gating names (swiglu_limit, or gpt-oss's limit) and gpt-oss's alpha.
    limit = _number_attribute(module, ("swiglu_limit", "limit"))
    alpha = _number_attribute(module, ("swiglu_alpha", "alpha"))
    interleaved = ExpertsLayout.of(module).interleaved
    key = (type(module), act if callable(act) and not isinstance(act, nn.Module) else type(act), limit, alpha,
           interleaved)
    if key not in _GATING_VERDICTS:
        if torch.compiler.is_compiling():
            return (f"{type(module).__name__} has a gating of its own, which kt checks by running it: call the "
                    f"model once without torch.compile first"), None
        _GATING_VERDICTS[key] = _probe_gating(module, intermediate, limit, alpha, interleaved)
    return _GATING_VERDICTS[key]


def gating_of(module: nn.Module) -> dict:
    """``{"swiglu_limit": ..., "activation": ..., "swiglu_alpha": ...}``: the gating kt.moe must
    run this experts module with; call after :func:`experts_support` accepted it."""
    _, gating = _gating_verdict(module, ExpertsLayout.of(module).sizes(module.gate_up_proj)[1])
    return gating


def _candidate_gatings(limit: Optional[float], alpha: Optional[float]):
    """(gating, its float64 form f(gate, up)) for each gating kt.moe computes that the module
    could hold: SwiGLU and GeGLU, gpt-oss's form when it names an alpha, each unclamped and,
    when it names a limit, clamped."""
    forms = {"silu": lambda g, u: torch.nn.functional.silu(g) * u,
             "gelu_tanh": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u}
    if alpha is not None and 0 < alpha < float("inf"):
        forms["swigluoai"] = lambda g, u: g * torch.sigmoid(alpha * g) * (u + 1)
    for activation, form in forms.items():
        for candidate in [None] + ([limit] if limit is not None and limit > 0 else []):
            yield _gating(candidate, activation, alpha if activation == "swigluoai" else None), form


def _probe_gating(module: nn.Module, intermediate: int, limit: Optional[float], alpha: Optional[float],
                  interleaved: bool) -> tuple[Optional[str], Optional[dict]]:
    """_gating_verdict's probe: the module's gating (its ``_apply_gate``, else
    ``act_fn(gate)·up``) on float32 CPU pre-activations spanning ±_GATE_PROBE_RANGE, gate and up
    in the module's order of the fused outputs, against each form kt.moe computes
    (_candidate_gatings) in float64."""
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
    layout = ExpertsLayout(interleaved=interleaved)
    gate_up = layout.fuse_gate_up(gate_part, up_part).float()
    gate_up_parts = layout.split_gate_up(gate_up)
    gate, up = (t.double() for t in gate_up_parts)
    try:
        apply_gate = getattr(module, "_apply_gate", None)
        with torch.no_grad():
            got = apply_gate(gate_up) if apply_gate is not None else act(gate_up_parts[0]) * gate_up_parts[1]
        for gating, form in _candidate_gatings(limit, alpha):
            cut = gating["swiglu_limit"]
            g, u = (gate, up) if cut is None else (gate.clamp(max=cut), up.clamp(-cut, cut))
            expected = form(g, u)
            # Per element, float32's rounding (GELU-tanh's 1 + tanh cancels: an error up to about
            # 2^-24·|g·u|) passes; GELU's erf form against its tanh one (4.7e-4·|u| at 2) fails.
            allowed = 1e-5 * expected.abs() + 1e-6 * (gate.abs() * (up.abs() + 1)) + 1e-6
            if isinstance(got, Tensor) and got.shape == expected.shape and bool(
                    ((got.double() - expected).abs() <= allowed).all()):
                return None, gating
    except Exception as e:  # noqa: BLE001 - a gating we cannot even call is not ours
        return (f"{cls}'s gating cannot be probed ({type(e).__name__}: {e}); kt.moe computes silu(gate)·up, "
                f"gelu_tanh(gate)·up and gpt-oss's gate·σ(alpha·gate)·(up + 1) experts only"), None
    forms = "act(gate)·up (act: silu or gelu_tanh)" + (
        f" or gate·σ({alpha}·gate)·(up + 1) (gpt-oss's)" if alpha is not None else "")
    if limit is not None:
        return (f"{cls}'s gating with swiglu_limit={limit} is not {forms}, clamped at the limit (gate <- min(gate, "
                f"limit), up <- clamp(up, -limit, limit)) or not; kt.moe computes those only"), None
    return (f"{cls}'s gating (activation {act_name}) is not {forms}; kt.moe computes SwiGLU, GeGLU and gpt-oss's "
            f"gated experts only"), None


def _masked(top_k_index: Tensor, top_k_weights: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Masked slots (ids outside [0, E)) -> kt.moe's empty slot (id -1, weight 0): no expert
    computes them, they add nothing, and their routing-weight gradient is 0, as in
    transformers' loops that skip them. Branch-free, so it traces under torch.compile."""
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    ids = torch.where(valid, top_k_index, torch.full_like(top_k_index, -1))
    weights = torch.where(valid, top_k_weights, torch.zeros_like(top_k_weights))
    return ids, weights


# What a KTExperts keeps per named adapter (kt_ops.hf.expert_adapters): read and written as
# the layer's own attributes, they are the active adapter's.
_PER_ADAPTER = frozenset(LORA_NAMES + ("lora_scale", "lora_alpha"))


class KTExperts(KTMoE):
    """A transformers experts module on kt: same ``forward(hidden_states [T, H], top_k_index,
    top_k_weights) -> [T, H]``, experts on the owner rank's CPU (``gate_proj``/``up_proj``
    ``[E, I, H]``, ``down_proj [E, H, I]``), routing from the model. Built by
    :func:`kt_ops.patch_model`; everything else is :class:`~kt_ops.KTMoE`'s (collectives, DDP
    gradient semantics, ``routed_experts``).

    The expert LoRA lives in ``adapters`` (:class:`~kt_ops.hf.expert_adapters.ExpertAdapters`),
    one tensor set per named adapter (``adapters.lora.default.gate_lora_a``, ...), switched by
    PEFT (:mod:`kt_ops.hf.peft_experts`); ``self.gate_lora_a``, ``self.lora_scale``, ... read
    and write the active adapter's. The forward uses the active adapter, or none while PEFT has
    the adapters disabled. :func:`kt_ops.patch_model` builds them as
    :func:`kt_experts_class` says (with PEFT installed, a subclass that
    PEFT's walks over a model reach)."""

    # Whether the model's fused gate_up outputs (and so PEFT's LoRA B rows) interleave gate and
    # up (gpt-oss) rather than concatenate them; set by patch_model, read by the adapters.
    gate_up_interleaved = False

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, **kwargs):
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, router=nn.Identity(), **kwargs)
        del self.gate  # the routing is the model's: no router here

    def __setattr__(self, name, value):
        if name in _PER_ADAPTER:
            if "adapters" not in self._modules:  # the first LoRA attribute KTMoE's constructor sets
                nn.Module.__setattr__(self, "adapters", ExpertAdapters())
            setattr(self._modules["adapters"].active(), name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name):
        if name in _PER_ADAPTER:
            adapters = self.__dict__["_modules"].get("adapters")
            if adapters is not None and adapters.active_adapter in adapters.lora:
                return getattr(adapters.lora[adapters.active_adapter], name)
        return nn.Module.__getattr__(self, name)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # State dicts from before named adapters (Trainer checkpoints of earlier kt_ops) hold
        # the LoRA as experts.gate_lora_a ...: the active adapter's.
        for name in LORA_NAMES:
            if prefix + name in state_dict:
                state_dict[f"{prefix}adapters.lora.{self.adapters.active_adapter}.{name}"] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def expert_lora(self, adapter_name: str) -> ExpertLoRA:
        """The named adapter's expert LoRA (KeyError naming the adapters there are)."""
        if adapter_name not in self.adapters.lora:
            raise KeyError(f"kt experts have no expert adapter {adapter_name!r} (they have "
                           f"{sorted(self.adapters.lora)})")
        return self.adapters.lora[adapter_name]

    def _all_lora_tensors(self) -> list:
        return self.adapters.parameters_of_all() if self.lora_rank and self.is_owner else []

    def _forward_lora(self) -> tuple[tuple, float]:
        adapter = self.adapters.current() if self.lora_rank else None
        tensors = adapter.tensors() if adapter is not None else None
        if tensors is None:
            return (None,) * 6, 1.0
        # An adapter kept in another dtype than the experts (e.g. float32 LoRA over bf16 experts):
        # kt.moe computes LoRA in the experts' dtype; the cast is differentiable (a no-op otherwise).
        return tuple(t.to(self.expert_dtype) for t in tensors), adapter.lora_scale

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if torch.nn.utils.parametrize.is_parametrized(self):
            # PEFT's get_peft_model with target_parameters=["experts.down_proj", ...] (what one
            # writes for the unpatched model) wraps kt's base weight in a LoRA of its own.
            raise ValueError(
                f"KTExperts (layer {self.layer_id}): its base weights are parametrized "
                f"({sorted(self.parametrizations)}): PEFT's LoraConfig(target_parameters=[...]) put a LoRA of its own "
                "on kt's experts. kt's expert LoRA is the experts' adapter (patch_model(lora_rank=..., lora_alpha=...)): "
                "drop target_parameters from the LoraConfig (and keep target_modules for the other modules)")
        ids, weights = _masked(top_k_index, top_k_weights, self.num_experts)
        return self.routed_experts(hidden_states, ids, weights)


def kt_experts_class() -> type:
    """The class :func:`kt_ops.patch_model` builds experts modules of: with PEFT installed, the
    :class:`KTExperts` that PEFT's adapter switches, save and load reach
    (:class:`kt_ops.hf.peft_experts.PeftKTExperts`), else :class:`KTExperts`."""
    try:
        from kt_ops.hf.peft_experts import PeftKTExperts
    except ImportError:
        return KTExperts
    return PeftKTExperts


def kt_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                       top_k_weights: Tensor) -> Tensor:
    """The ``"kt"`` entry of transformers' experts interface: ``kt.moe`` on the module's own
    ``gate_up_proj`` / ``down_proj`` (and biases; wherever they live; computed on the CPU). A
    layout other than kt's own (transposed or interleaved: gpt-oss, Aria) is copied into it
    on every call; :func:`kt_ops.patch_model` converts it once instead."""
    why, gating = _support_and_gating(self)
    if why is not None:
        raise ValueError(f'experts_implementation="kt": {why}')
    layout = ExpertsLayout.of(self)
    cpu = torch.device("cpu")
    weights = {name: w.to(cpu) for name, w in layout.weights(self).items()}
    biases = {name: None if b is None else b.to(cpu) for name, b in layout.biases(self).items()}
    ids, routing = _masked(top_k_index, top_k_weights, weights["gate_proj"].shape[0])
    out = torch.ops.kt.moe(hidden_states.to(cpu, weights["gate_proj"].dtype), ids.to(cpu), routing.to(cpu),
                           weights["gate_proj"], weights["up_proj"], weights["down_proj"],
                           None, None, None, None, None, None, 1.0, None, None, None, **gating, **biases)
    return out.to(hidden_states.device, hidden_states.dtype)


def register_kt_experts() -> None:
    """Register ``"kt"`` in transformers' experts interface (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("kt", kt_experts_forward)
