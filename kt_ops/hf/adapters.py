"""Expert LoRA of patched models in PEFT's adapter format.

How PEFT 0.21 puts LoRA on transformers-5 fused experts
(``LoraConfig(target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])``):
each targeted 3-D parameter ``W [E, out, in]`` gets a ``ParamWrapper`` whose LoRA is stored as
two ``nn.Linear`` weights covering all experts,

- ``lora_A.weight [r·E, in]``: rows grouped by expert, ``A[e] = lora_A.reshape(E, r, in)[e]``;
- ``lora_B.weight [out, r·E]``: columns interleaved with the expert index fastest,
  ``B[e] = lora_B.reshape(out, r, E)[:, :, e]``;

and the forward uses ``W[e] + s·B[e]·A[e]`` (``s = lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA). For ``gate_up_proj [E, 2I, H]`` that is ONE rank-r LoRA on the fused matrix: ``A[e]``
``[r, H]`` is shared by the gate and up halves and ``B[e] [2I, r]`` splits into the gate rows
``[:I]`` and up rows ``[I:]``. kt_ops represents exactly that: ``gate_lora_a`` and
``up_lora_a`` are one tied parameter, ``gate_lora_b = B[:, :I]``, ``up_lora_b = B[:, I:]``.
Transposed experts (gpt-oss, Aria: ``W [E, in, out]``) get the same factors (PEFT swaps its
in/out for them: ``W[e] + s·(B[e]·A[e])ᵀ``); where gate and up outputs are interleaved
(gpt-oss), so are B's rows: gate ``B[:, 0::2]``, up ``B[:, 1::2]``.

Wrappers on one module nest in parameter registration order: ``gate_up_proj`` (registered
first) is the inner wrapper, so its keys are ``<block>.experts.base_layer.lora_{A,B}.weight``,
and ``down_proj``'s are ``<block>.experts.lora_{A,B}.weight``; saved keys carry the prefix
``base_model.model.`` and no adapter name. (When loading, each pair is identified by its
shapes, so either nesting order loads.)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.distributed import PEFT_MODEL_PREFIX
from kt_ops.hf.expert_layout import ExpertsLayout
from kt_ops.hf.patch import patched_blocks

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"
ADAPTER_CONFIG = "adapter_config.json"
TARGET_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
_PREFIX = PEFT_MODEL_PREFIX
# relative to a block: PEFT's keys for the inner (gate_up_proj) and outer (down_proj) wrapper
_GATE_UP_KEYS = ("experts.base_layer.lora_A.weight", "experts.base_layer.lora_B.weight")
_DOWN_KEYS = ("experts.lora_A.weight", "experts.lora_B.weight")
# the same, relative to the experts module (what PEFT's save asks a kt experts module for)
PEFT_EXPERT_KEYS = tuple(k[len("experts."):] for k in _GATE_UP_KEYS + _DOWN_KEYS)
_KEY_RE = re.compile(r"^experts\.((?:base_layer\.)*)lora_([AB])\.weight$")


def _blocks(model: nn.Module, who: str) -> list[tuple[str, nn.Module]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    blocks = patched_blocks(model)
    if not blocks:
        raise ValueError(f"{who}: model has no kt_ops-patched MoE block; call kt_ops.patch_model(model, ...) first")
    return blocks


# ---------------------------------------------------------------------------------------------
# Layout conversions (pure functions on tensors)


def peft_factors_to_kt(lora_a: Tensor, lora_b: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """PEFT ParamWrapper LoRA -> stacked per-expert factors.

    ``lora_a [r·E, in]``, ``lora_b [out, r·E]`` -> ``(A [E, r, in], B [E, out, r])``."""
    E = num_experts
    A = lora_a.reshape(E, -1, lora_a.shape[-1])
    B = lora_b.reshape(lora_b.shape[0], -1, E).permute(2, 0, 1)
    return A, B


def kt_factors_to_peft(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`peft_factors_to_kt`: ``A [E, r, in]``, ``B [E, out, r]`` ->
    ``(lora_A.weight [r·E, in], lora_B.weight [out, r·E])``."""
    E, r, fan_in = A.shape
    return A.reshape(E * r, fan_in), B.permute(1, 2, 0).reshape(B.shape[1], r * E)


_LORA_PARTS = ("gate_lora_a", "gate_lora_b", "up_lora_b", "down_lora_a", "down_lora_b")


def _all_experts_lora(kt) -> Optional[dict[str, Tensor]]:
    """``{name: [E, ...]}`` of the five LoRA tensors of all experts: this rank's own on a
    one-owner layer; on a sharded one, every owner's rows gathered in expert order on the
    group's rank 0 (None elsewhere). Sharded: a collective of the layer's group."""
    if kt.expert_shards == 1:
        return {n: getattr(kt, n) for n in _LORA_PARTS}
    from kt_ops.collectives import gather_to_owner
    from kt_ops.layer import lora_shapes

    E = kt.num_experts
    none = lora_shapes(0, kt.intermediate_size, kt.hidden_size, kt.lora_rank)  # what a rank without experts sends
    group = kt.process_group
    device = kt.grad_anchor.device  # where the job's collectives run (the GPU under NCCL)
    rows = [getattr(kt, n).detach() if kt.is_owner else torch.empty(none[n], dtype=kt.expert_dtype)
            for n in _LORA_PARTS]
    gathered, _ = gather_to_owner([t.to(device) for t in rows], 0, group=group, tag=kt.layer_id)
    if kt.rank != 0:
        return None
    assert all(t.shape[0] == E for t in gathered)
    return {n: t.cpu() for n, t in zip(_LORA_PARTS, gathered)}


def kt_experts_to_peft(kt, lora: dict[str, Tensor]) -> dict[str, Tensor]:
    """The expert LoRA of one kt experts module (``lora``: its five tensors of all experts) in
    PEFT's layout, keys relative to the experts module (``base_layer.lora_A.weight`` ...)."""
    fused_b = ExpertsLayout(interleaved=kt.gate_up_interleaved).fuse_gate_up(lora["gate_lora_b"], lora["up_lora_b"])
    a, b = kt_factors_to_peft(lora["gate_lora_a"], fused_b)
    a_d, b_d = kt_factors_to_peft(lora["down_lora_a"], lora["down_lora_b"])
    out = dict(zip(PEFT_EXPERT_KEYS, (a, b, a_d, b_d)))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def kt_block_to_peft(block: nn.Module, lora: Optional[dict[str, Tensor]] = None) -> dict[str, Tensor]:
    """The expert LoRA of one patched block in PEFT's layout, keys relative to the block
    (``experts.base_layer.lora_A.weight`` ...: see the module docstring). ``lora``: the
    block's LoRA tensors of all experts (default: the layer's own, on a one-owner layer)."""
    kt = block.experts
    if kt.gate_lora_a is not kt.up_lora_a and not torch.equal(kt.gate_lora_a, kt.up_lora_a):
        raise ValueError("save_adapter: gate_lora_a and up_lora_a differ; PEFT's LoRA on the fused "
                         "experts.gate_up_proj has one A shared by gate and up (patch_model ties them)")
    lora = lora if lora is not None else {n: getattr(kt, n) for n in _LORA_PARTS}
    return {f"experts.{k}": v for k, v in kt_experts_to_peft(kt, lora).items()}


def peft_block_to_kt(tensors: dict[str, Tensor], block: nn.Module, r: int,
                     who: str = "load_adapter") -> dict[str, Tensor]:
    """PEFT expert LoRA of one block -> KTMoE tensors.

    ``tensors``: PEFT keys relative to the block (``experts[.base_layer]*.lora_{A,B}.weight``).
    Returns ``{kt name: tensor}`` for ``gate_lora_a`` (= ``up_lora_a``, tied), ``gate_lora_b``,
    ``up_lora_b`` (``[E, I, r]``), ``down_lora_a [E, r, I]``, ``down_lora_b [E, H, r]`` for the
    projections present. Each A/B pair is identified by its shapes (gate_up: ``[r·E, H]`` /
    ``[2I, r·E]``; down: ``[r·E, I]`` / ``[H, r·E]``)."""
    kt = block.experts
    E, I, H = kt.num_experts, kt.intermediate_size, kt.hidden_size
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise ValueError(f"{who}: unexpected adapter key {key!r} for a patched MoE block")
        pairs.setdefault(m.group(1), {})[m.group(2)] = value
    out: dict[str, Tensor] = {}
    for nesting, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{who}: adapter has lora_{''.join(pair)} without its partner at experts.{nesting}")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r * E or b.shape[1] != r * E:
            raise ValueError(f"{who}: experts.{nesting}lora_A/B have shapes {tuple(a.shape)} / {tuple(b.shape)}; "
                             f"expected [r·E, in] / [out, r·E] with r={r}, E={E}")
        A, B = peft_factors_to_kt(a, b, E)
        if a.shape[1] == H and b.shape[0] == 2 * I:
            if "gate_lora_a" in out:
                raise ValueError(f"{who}: two LoRAs for experts.gate_up_proj")
            out["gate_lora_a"] = A
            out["gate_lora_b"], out["up_lora_b"] = ExpertsLayout(interleaved=kt.gate_up_interleaved).split_gate_up(B)
        elif a.shape[1] == I and b.shape[0] == H:
            if "down_lora_a" in out:
                raise ValueError(f"{who}: two LoRAs for experts.down_proj")
            out["down_lora_a"], out["down_lora_b"] = A, B
        else:
            raise ValueError(f"{who}: experts.{nesting}lora_A/B of shapes {tuple(a.shape)} / {tuple(b.shape)} "
                             f"fit neither gate_up_proj (in={H}, out={2 * I}) nor down_proj (in={I}, out={H})")
    return out


def adapter_state_dict(model: nn.Module) -> Optional[dict[str, Tensor]]:
    """The expert LoRA of a patched model as the state dict PEFT saves
    (``base_model.model.<block>.experts[.base_layer].lora_{A,B}.weight``, CPU tensors). With
    sharded experts, a collective of the layers' group whose rank 0 gets the whole state dict
    (the other ranks None)."""
    blocks = _blocks(model, "save_adapter")
    state: Optional[dict[str, Tensor]] = {}
    for name, block in blocks:
        lora = _all_experts_lora(block.experts)
        if lora is None:
            state = None  # still gathering every block, as the holder does
            continue
        for key, value in kt_block_to_peft(block, lora).items():
            state[f"{_PREFIX}{name}.{key}"] = value
    return state


def load_adapter_state_dict(model: nn.Module, state_dict: dict[str, Tensor], *, r: int, scaling: float,
                            lora_alpha: Optional[float] = None, who: str = "load_adapter") -> nn.Module:
    """Copy a PEFT expert-LoRA state dict (keys as PEFT saves them, with or without the
    ``base_model.model.`` prefix) into a patched model and set its LoRA scale to ``scaling``.

    Projections (or blocks) the adapter does not cover get ``B = 0`` (no LoRA effect), as in
    the PEFT model. Keys that belong to no patched MoE block raise ValueError."""
    blocks = _blocks(model, who)
    kt0 = blocks[0][1].experts
    if kt0.lora_rank != r:
        raise ValueError(f"{who}: the adapter has rank r={r} but the model was patched with "
                         f"lora_rank={kt0.lora_rank}; patch with kt_ops.patch_model(model, lora_rank={r}, ...)")
    remaining = {(k[len(_PREFIX):] if k.startswith(_PREFIX) else k): v for k, v in state_dict.items()}
    per_block = []
    for name, block in blocks:
        prefix = f"{name}."
        mine = {k[len(prefix):]: remaining.pop(k) for k in [k for k in remaining if k.startswith(prefix)]}
        per_block.append((block, mine))
    if remaining:
        extra = sorted(remaining)
        raise ValueError(f"{who}: the adapter holds {len(extra)} tensor(s) outside the patched experts "
                         f"(kt_ops loads expert LoRA only), e.g. {extra[:4]}")
    converted = [(block, peft_block_to_kt(mine, block, r, who)) for block, mine in per_block]  # check all first
    for block, tensors in converted:
        kt = block.experts
        kt.lora_scale = float(scaling)
        if lora_alpha is not None:
            kt.lora_alpha = float(lora_alpha)
        if not kt.is_owner:
            continue
        mine = slice(kt.expert_range.start, kt.expert_range.stop)  # all experts unless sharded
        with torch.no_grad():
            for kt_name in _LORA_PARTS:
                param = getattr(kt, kt_name)
                if kt_name in tensors:
                    param.copy_(tensors[kt_name][mine])
                elif kt_name.endswith("_b"):
                    param.zero_()  # projection without LoRA in the adapter
            if kt.up_lora_a is not kt.gate_lora_a:
                kt.up_lora_a.copy_(kt.gate_lora_a)
    return model


# ---------------------------------------------------------------------------------------------
# Public API


def save_adapter(model: nn.Module, output_dir: str, *, write: bool = True, adapter_name: Optional[str] = None) -> None:
    """Write the expert LoRA of a patched model in PEFT's adapter format.

    Writes ``output_dir/adapter_model.safetensors`` (PEFT keys
    ``base_model.model.<block>.experts.base_layer.lora_A.weight [r·E, H]`` and
    ``...lora_B.weight [2I, r·E]`` for ``gate_up_proj``, ``...experts.lora_A.weight [r·E, I]``
    and ``...lora_B.weight [H, r·E]`` for ``down_proj``) and ``output_dir/adapter_config.json``
    (``LoraConfig(r, lora_alpha, target_modules=[], target_parameters=["experts.gate_up_proj",
    "experts.down_proj"])``), so that ``PeftModel.from_pretrained(unpatched_model, output_dir)``
    gives the patched model's logits.

    ``model`` may also be a PEFT model over a patched one (:func:`kt_ops.hf.get_peft_model`,
    LoRA on attention or other modules): the adapter then holds both, as PEFT writes
    ``LoraConfig(target_modules=[...], target_parameters=["experts.gate_up_proj",
    "experts.down_proj"])`` for the unpatched model (same ``r`` and ``lora_alpha`` for both).

    Only the owner rank holds the expert LoRA: call this on the owner rank. With sharded
    experts (``expert_shards > 1``) call it on every rank of the layers' group: the shards are
    gathered to the group's rank 0, which writes one adapter equal to what one process holding
    all the experts writes. ``write=False``: take part without writing (the gather only with
    sharded experts, nothing with one owner), so that every rank of a job can make the same
    call with ``write`` true on one of them. ``adapter_name``: which named adapter (PEFT's
    ``add_adapter`` / ``load_adapter(..., name)``) to write; default the active one.
    Trainable expert base weights (``train_base=True``) are not part of an adapter and are not
    saved (a warning says so).

    Raises:
        ValueError: ``model`` is not patched, has no LoRA (``lora_rank=0``), or this is not the
            owner rank; ``output_dir`` exists and is not a directory; PEFT's and the experts'
            LoRA differ in rank or alpha.
    """
    peft_model = model if is_peft_model(model) else None
    if peft_model is not None:
        model = peft_model.get_base_model()
    blocks = _blocks(model, "save_adapter")
    kt0 = blocks[0][1].experts
    if adapter_name is None:
        adapter_name = peft_model.active_adapter if peft_model is not None else kt0.adapters.active_adapter
    with _reading_adapter(blocks, adapter_name):
        _save_adapter(peft_model, model, blocks, output_dir, write, adapter_name)


@contextlib.contextmanager
def _reading_adapter(blocks, adapter_name: str):
    """The experts' LoRA attributes read ``adapter_name``'s tensors inside (nothing else changes)."""
    adapters = [b.experts.adapters for _, b in blocks]
    for a in adapters:
        if adapter_name not in a.lora:
            raise ValueError(f"the experts have no adapter {adapter_name!r} (they have {sorted(a.lora)})")
    previous = [a.active_adapter for a in adapters]
    for a in adapters:
        a.active_adapter = adapter_name
    try:
        yield
    finally:
        for a, name in zip(adapters, previous):
            a.active_adapter = name


def _save_adapter(peft_model, model, blocks, output_dir: str, write: bool, adapter_name: str) -> None:
    kt0 = blocks[0][1].experts
    if not kt0.lora_rank:
        raise ValueError("save_adapter: the model was patched with lora_rank=0: there is no adapter to save")
    if kt0.expert_shards == 1 and not write:
        return  # one owner: no gather to take part in, nothing to write here
    if not kt0.is_owner and kt0.expert_shards == 1:
        raise ValueError(f"save_adapter: only the owner rank (owner_rank={kt0.owner_rank}) holds the expert "
                         f"LoRA; this is rank {kt0.rank}: call save_adapter on the owner rank")
    r = kt0.lora_rank
    scales = {(b.experts.lora_rank, b.experts.lora_scale) for _, b in blocks}
    if len(scales) != 1:
        raise ValueError(f"save_adapter: the patched blocks have different LoRA (rank, scale) pairs {sorted(scales)}")
    if kt0.is_owner and any(p.requires_grad for _, b in blocks
                            for p in (b.experts.gate_proj, b.experts.up_proj, b.experts.down_proj)):
        warnings.warn("save_adapter: the expert base weights are trainable (train_base=True) but an adapter holds "
                      "only the LoRA: the base weights are not saved", stacklevel=2)
    alpha = kt0.lora_alpha if math.isclose(kt0.lora_scale, kt0.lora_alpha / r, rel_tol=1e-12) else kt0.lora_scale * r
    if float(alpha).is_integer():
        alpha = int(alpha)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"save_adapter: output_dir {output_dir!r} exists and is not a directory")

    state = adapter_state_dict(model)  # sharded: gathered on the group's rank 0 (a collective)
    if state is None or not write:
        return
    os.makedirs(output_dir, exist_ok=True)
    config = _adapter_config(model, r, alpha)
    if peft_model is not None:
        state, config = combined_adapter(peft_model, state, r, alpha, adapter_name)
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, os.path.join(output_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(output_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _adapter_config(model: nn.Module, r: int, alpha: float) -> dict:
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    task_type = "CAUSAL_LM" if type(model).__name__.endswith("ForCausalLM") else None
    fields = dict(r=r, lora_alpha=alpha, target_modules=[], target_parameters=list(TARGET_PARAMETERS),
                  lora_dropout=0.0, bias="none", task_type=task_type, base_model_name_or_path=name_or_path)
    try:
        from peft import LoraConfig
    except ImportError:  # write the fields that matter; PEFT fills in its defaults on load
        config = dict(fields, peft_type="LORA", use_rslora=False, use_dora=False, lora_bias=False,
                      fan_in_fan_out=False, rank_pattern={}, alpha_pattern={}, inference_mode=True)
    else:
        config = LoraConfig(**fields).to_dict()
        config["inference_mode"] = True
        for k, v in config.items():  # sets -> lists (what PeftConfig.save_pretrained does)
            if isinstance(v, set):
                config[k] = sorted(v)
    if task_type is None:
        config["auto_mapping"] = {"base_model_class": type(model).__name__, "parent_library": type(model).__module__}
    return config


def read_adapter_config(adapter_dir: str, who: str = "load_adapter") -> dict:
    """``adapter_dir/adapter_config.json``; ValueError when there is none."""
    config_path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"{who}: adapter_dir {adapter_dir!r} has no {ADAPTER_CONFIG}")
    with open(config_path) as f:
        return json.load(f)


def _split_expert_keys(blocks, state: dict) -> tuple[dict, dict]:
    """(the tensors of the patched blocks' experts, the rest) of an adapter state dict."""
    prefixes = tuple(f"{_PREFIX}{name}.experts." for name, _ in blocks)
    experts = {k: v for k, v in state.items() if k.startswith(prefixes)}
    return experts, {k: v for k, v in state.items() if k not in experts}


def load_expert_part(model: nn.Module, adapter_dir: str, adapter_name: Optional[str] = None) -> None:
    """Only the experts' LoRA of an adapter into a patched model, into its named adapter
    ``adapter_name`` (default: the active one). PEFT loads the rest: see
    :func:`kt_ops.hf.get_peft_model`, whose PEFT model's ``load_adapter`` calls this."""
    blocks = _blocks(model, "load_adapter")
    r, alpha, scaling = _check_config(read_adapter_config(adapter_dir), adapter_dir)
    state = _read_adapter_weights(adapter_dir) if blocks[0][1].experts.is_owner else {}
    experts, _ = _split_expert_keys(blocks, state)
    with _reading_adapter(blocks, adapter_name or blocks[0][1].experts.adapters.active_adapter):
        load_adapter_state_dict(model, experts, r=r, scaling=scaling, lora_alpha=alpha)


def _load_peft_part(peft_model, blocks, state: dict, adapter_dir: str, adapter_name: str = "default") -> None:
    """An adapter's tensors through PEFT: its own modules', and the experts' where PEFT's load
    asks the experts for them (one owner's; kt_ops.hf.peft_experts). The experts' part is
    also read by kt (load_adapter_state_dict), for the scale and sharded owners."""
    from peft import set_peft_model_state_dict

    experts, rest = _split_expert_keys(blocks, state)
    wanted = {f"{_PREFIX}{name}.experts.{k}" for name, b in blocks
              for k in b.experts.adapter_state_dict_load_map(adapter_name)}
    result = set_peft_model_state_dict(peft_model, {**rest, **{k: v for k, v in experts.items() if k in wanted}},
                                       adapter_name=adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    if unexpected:
        raise ValueError(f"load_adapter: adapter_dir {adapter_dir!r} holds tensors PEFT's modules do not take: "
                         f"{unexpected[:4]}")


def _read_adapter_weights(adapter_dir: str) -> dict:
    st_path, bin_path = os.path.join(adapter_dir, ADAPTER_WEIGHTS), os.path.join(adapter_dir, ADAPTER_WEIGHTS_BIN)
    if os.path.isfile(st_path):
        from safetensors.torch import load_file
        state = load_file(st_path)
    elif os.path.isfile(bin_path):
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"load_adapter: adapter_dir {adapter_dir!r} has neither {ADAPTER_WEIGHTS} "
                         f"nor {ADAPTER_WEIGHTS_BIN}")
    return state


def lora_fields(config: dict, where: str) -> tuple[int, float, float]:
    """``(r, lora_alpha, scaling)`` of an adapter config kt_ops reads (LoRA with one rank and
    alpha; rsLoRA's ``alpha / sqrt(r)`` scale honoured): ValueError, prefixed with ``where``,
    naming the field otherwise. What loading and merging an adapter both check."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where} holds a {config.get('peft_type')} adapter; kt_ops reads LoRA adapters")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: adapter_config.json needs an int r >= 1 and a number lora_alpha, "
                         f"got r={r!r}, lora_alpha={alpha!r}")
    for key in ("use_dora", "lora_bias"):
        if config.get(key):
            raise ValueError(f"{where}: {key}=true is not supported by kt_ops")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported (kt_ops uses one rank and alpha "
                             f"for every module)")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(alpha), float(scaling)


def _check_config(config: dict, adapter_dir: str) -> tuple[int, float, float]:
    where = f"load_adapter: adapter_dir {adapter_dir!r}"
    r, alpha, scaling = lora_fields(config, where)
    params = config.get("target_parameters") or []
    unknown = [p for p in params if not (p.endswith("gate_up_proj") or p.endswith("down_proj"))]
    if unknown or not params:
        raise ValueError(f"{where}: target_parameters={params!r}; kt_ops loads LoRA on "
                         f"{list(TARGET_PARAMETERS)} only")
    return r, alpha, scaling


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _check_same_lora(peft_config, r: int, alpha: float, who: str) -> None:
    """ValueError unless PEFT's LoRA has the experts' rank and alpha (one LoraConfig, one adapter)."""
    if peft_config.r != r or not math.isclose(float(peft_config.lora_alpha), float(alpha)):
        raise ValueError(f"{who}: peft_config has r={peft_config.r}, lora_alpha={peft_config.lora_alpha} but the "
                         f"experts' LoRA has r={r}, lora_alpha={float(alpha):g}; one PEFT adapter holds one rank and "
                         "alpha: use the same for both")


def combined_adapter(peft_model, expert_state: dict, r: int, alpha: float, adapter_name: str) -> tuple[dict, dict]:
    """``(state dict, adapter config)`` of one PEFT adapter with the PEFT LoRA of ``peft_model``
    and kt's expert LoRA (``expert_state``: PEFT keys). ValueError when the two LoRAs' rank or
    alpha differ (one LoraConfig holds one of each)."""
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config[adapter_name]
    _check_same_lora(config, r, alpha, "save_adapter")
    state = dict(get_peft_model_state_dict(peft_model, adapter_name=adapter_name))
    # PEFT's state holds the experts' part too where this rank holds it whole (kt_ops.hf.peft_experts);
    # kt's (gathered when sharded) is the one written.
    state.update(expert_state)
    fields = config.to_dict()
    fields["target_parameters"] = list(TARGET_PARAMETERS)
    fields["inference_mode"] = True
    for k, v in fields.items():  # sets -> lists (what PeftConfig.save_pretrained does)
        if isinstance(v, set):
            fields[k] = sorted(v)
    return state, fields


def peft_config_without_experts(config: dict):
    """The ``LoraConfig`` of an adapter's non-expert part (``target_parameters`` dropped)."""
    from peft import LoraConfig

    fields = {k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}
    fields.pop("target_parameters", None)
    fields["inference_mode"] = False
    return LoraConfig(**fields)


def __getattr__(name: str):
    # load_adapter lives in kt_ops.hf.peft_attention (it may wrap the model with PEFT); this
    # module's old name for it stays.
    if name == "load_adapter":
        from kt_ops.hf.peft_attention import load_adapter
        return load_adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
