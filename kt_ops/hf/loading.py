"""``kt_ops.hf.from_pretrained``: a patched model straight from a checkpoint's safetensors
shards, with bounded memory.

``AutoModelForCausalLM.from_pretrained`` + :func:`~kt_ops.hf.patch_model` materialises the whole
model in the model's dtype before moving the experts (twice the checkpoint for FP8 dequantized
to bf16). Here the model is built from its config on the meta device and patched there; then
every stored tensor is read once, memory-mapped, and written where it ends: non-expert weights
to ``device``, routed experts one expert matrix at a time into the owner rank's CPU layout
(quantized on the way when asked, or copied as stored when the checkpoint already holds that
format). Non-owner ranks read no expert tensor at all.

Checkpoint names are mapped to the model's with transformers' own conversion mapping (the one
its ``from_pretrained`` uses: ``block_sparse_moe`` -> ``mlp``, per-expert
``experts.{e}.gate_proj.weight`` -> the fused ``experts.gate_up_proj``, ...), so any family
transformers loads and kt_ops patches is read the same way. Everything is checked against the
headers before a byte of data is read: a tensor the model lacks, a weight the checkpoint lacks
(each expert's each projection), a shape or a quantization layout kt_ops does not read raise a
ValueError naming the tensor.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from kt_ops import quantization
from kt_ops.hf import fp4_checkpoints
from kt_ops.hf.checkpoint_formats import CheckpointQuantization, StoredMatrix
from kt_ops.hf.expert_layout import ExpertsLayout
from kt_ops.hf.experts import is_experts_module
from kt_ops.hf.patch import materialize_experts, patch_model
from kt_ops.hf.shards import ShardReader, TensorRef, shard_files, tensor_refs
from kt_ops.placement import resolve as resolve_placement

_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                 "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                 "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_FLOAT_NAMES = ("F64", "F32", "BF16", "F16")


@dataclasses.dataclass
class _ExpertSlot:
    """Where a stored expert tensor goes: ``proj`` of experts module ``path``, expert ``expert``
    (None: a fused tensor holding every expert; ``proj == "gate_up_proj"``: both halves;
    ``"gate_up_proj_bias"`` / ``"down_proj_bias"``: the fused biases of experts with biases)."""
    path: str
    proj: str
    expert: Optional[int]
    # fused tensors stored [E, in, out] (transformers' Transpose(1, 2)): "always", "if_needed"
    # (check_dims: when the shape differs) or None; ``transposed`` is what the header said
    transpose: Optional[str] = None
    transposed: bool = False


@dataclasses.dataclass
class _Weight:
    """What one group of stored tensors fills: an expert slot, or non-expert model tensors
    (``targets``; several when a transformers converter splits or merges them)."""
    target: str  # the model's state-dict key (experts: the fused key transformers would fill)
    slot: Optional[_ExpertSlot]
    converter: object = None  # the transformers WeightConverter building a non-expert target
    # checkpoint weight key -> {role: TensorRef} (one weight, except for a converter's inputs)
    sources: dict = dataclasses.field(default_factory=dict)
    patterns: dict = dataclasses.field(default_factory=dict)  # weight key -> the converter's source pattern

    @property
    def name(self) -> str:
        return next(iter(self.sources))

    @property
    def parts(self) -> dict:
        """The roles of the (single) stored weight."""
        return self.sources[self.name]

    @property
    def refs(self) -> list[TensorRef]:
        return [ref for parts in self.sources.values() for ref in parts.values()]

    @property
    def nbytes(self) -> int:
        return sum(ref.nbytes for ref in self.refs)

    @property
    def first_file(self) -> str:
        return min(ref.file for ref in self.refs)

    @property
    def targets(self) -> list[str]:
        """The model keys this fills (a converter's first target pattern names ``target``)."""
        if self.converter is None:
            return [self.target]
        first = self.converter.target_patterns[0]
        return [self.target.replace(first, t, 1) for t in self.converter.target_patterns]


def from_pretrained(path: Union[str, os.PathLike], *, lora_rank: int = 0, lora_alpha: Optional[float] = None,
                    train_base: bool = False, expert_format: Optional[str] = None, group_size: Optional[int] = None,
                    dtype: Optional[torch.dtype] = None, device: Optional[Union[str, torch.device]] = None,
                    owner_rank: int = 0, process_group: Optional[dist.ProcessGroup] = None,
                    progress: bool = True, owners: Optional[str] = None, expert_shards: int = 1) -> nn.Module:
    """The model of checkpoint directory ``path``, patched by :func:`~kt_ops.hf.patch_model`,
    filled from its safetensors shards without ever holding the unpatched model in memory.

    Returns what ``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` followed by
    ``patch_model(model, lora_rank=..., ...)`` returns (equal logits; in eval mode; LoRA drawn
    as patch_model draws it), with the checkpoint's generation config.

    Checkpoints read as they ship: float (bf16 / fp16 / fp32) with experts stored per expert
    (``experts.{e}.gate_proj.weight``: hub layout, and what transformers' save_pretrained
    writes) or fused (``experts.gate_up_proj [E, 2I, H]``); FP8 block checkpoints
    (``quant_method: "fp8"``, ``weight_block_size [128, 128]``: DeepSeek-V3, Kimi-K2);
    compressed-tensors' float-quantized FP8 (llm-compressor's FP8_BLOCK, FP8_DYNAMIC and FP8
    schemes: one scale per 128x128 block, per output channel or per tensor), int-quantized
    INT8 (W8A8: one scale per output channel or per tensor) and pack-quantized symmetric INT4
    (Kimi-K2-Thinking), their activation quantization left out (kt_ops is weight-only); and
    GPTQ's symmetric INT4 without ``desc_act`` (Qwen3's GPTQ-Int4: the same 4-bit values
    repacked, its fp16 scales held exactly as float32); gpt-oss's MXFP4 experts
    (``quant_method: "mxfp4"``), compressed-tensors' NVFP4 (``nvfp4-pack-quantized``) and
    ModelOpt's NVFP4 (``quant_method: "modelopt"``, or its ``hf_quant_config.json``), their
    activation scales left out (:mod:`kt_ops.hf.fp4_checkpoints`). Experts in transformers'
    other layouts (gpt-oss's and Aria's: transposed, gate/up interleaved, with biases) are read
    into kt's. The routed experts end in
    ``expert_format``: copied as stored when the checkpoint holds that format (FP8 blocks, or
    a tensor's one scale, as ``"fp8"``; INT8 as ``"int8"``; INT4 as ``"int4"`` with the
    checkpoint's group size, the default then; MXFP4 as ``"mxfp4"``; NVFP4 as ``"nvfp4"``,
    with its global scale), else dequantized and cast to ``dtype``
    (``expert_format=None``) or requantized (per-channel FP8 has no kt_ops format of its own:
    ``"fp8"`` requantizes it into blocks). Quantized non-expert weights are dequantized to
    ``dtype``.

    Memory: the finished model, plus one stored tensor in flight and at most
    :data:`~kt_ops.hf.shards.REMAP_BYTES` of mapped shard pages; non-owner ranks read only
    the non-expert tensors.

    Args:
        path: a local checkpoint directory (``config.json`` + ``model.safetensors`` or a
            sharded ``model.safetensors.index.json``).
        lora_rank, lora_alpha, train_base, expert_format, group_size, owner_rank,
            process_group, owners, expert_shards: as :func:`~kt_ops.hf.patch_model`
            (``owners="per-node"``: every node's owner reads the experts; ``expert_shards=S``:
            each shard's owner reads only its experts from the files).
        dtype: the model's dtype (default: the config's ``dtype``, else float32).
        device: where the non-expert weights go (default: the rank's GPU, ``cuda:LOCAL_RANK``,
            when CUDA is available, else the CPU). The experts always live on the owner's CPU.
        progress: a progress bar over the bytes read (on the owner rank).

    Raises:
        ValueError: no safetensors checkpoint at ``path``; a quantization method or layout kt_ops
            does not read; a checkpoint tensor the model has no place for, a model weight (or an
            expert's projection) the checkpoint lacks, or a shape that does not fit (each named);
            or anything :func:`~kt_ops.hf.patch_model` refuses.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    owner = resolve_placement(owners, owner_rank, process_group, None, "from_pretrained", expert_shards).is_owner
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"from_pretrained: path must be a local checkpoint directory, got {path!r}")
    files = shard_files(path)
    config = AutoConfig.from_pretrained(path)
    stored = CheckpointQuantization.from_config(getattr(config, "quantization_config", None)
                                                or fp4_checkpoints.hf_quant_config(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the model is built unquantized; kt_ops holds the experts' format
    # Parsed once (and passed down as is); int4's default group size is the checkpoint's own
    # when it stores int4, so that its experts are copied as stored.
    fmt = quantization.ExpertFormat.parse(expert_format, group_size, "from_pretrained",
                                          default_group_size=stored.group_size if stored.method == "int4" else 32)
    dtype = _model_dtype(dtype, config)
    device = _default_device(device)

    # Parameters on meta, the buffers computed at construction (rotary frequencies) for real; the
    # global RNG untouched (from_pretrained draws nothing either), so that the LoRA patch_model
    # draws is the one it draws after from_pretrained.
    with init_empty_weights(include_buffers=False), torch.random.fork_rng(devices=[]):
        model = _build_model(config, dtype)
    plan = _Plan(model, stored)
    patch_model(model, lora_rank=lora_rank, lora_alpha=lora_alpha, train_base=train_base, owner_rank=owner_rank,
                process_group=process_group, expert_format=fmt, owners=owners, expert_shards=expert_shards)
    weights = plan.weights_of([ref for f in files for ref in tensor_refs(f)])

    experts = {p: model.get_submodule(p) for p in plan.experts_paths}
    scale_dtype = _copied_int4_scale_dtype(weights, stored, fmt.name, fmt.group_size)
    for kt in experts.values():
        materialize_experts(kt, device, scale_dtype=scale_dtype)
    todo = [w for w in weights if w.slot is None or _holds(experts[w.slot.path], w.slot.expert)]
    _Loader(model, plan, experts, device).load(todo, progress=progress and owner)

    _move_buffers(model, device)
    if plan.tied:
        model.tie_weights()
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:  # a bug of ours, not the checkpoint's: every weight was planned above
        raise RuntimeError(f"from_pretrained: tensors left uninitialised: {still_meta[:8]}")
    _attach_generation_config(model, path)
    model.config.name_or_path = path
    return model.eval()


def _holds(kt, expert: Optional[int]) -> bool:
    """Whether this rank reads an expert tensor (``expert`` None: a fused one, of all experts)."""
    return kt.is_owner and (expert is None or expert in kt.expert_range)


def _copied_int4_scale_dtype(weights: list, stored: CheckpointQuantization, expert_format: Optional[str],
                             group_size: Optional[int]) -> Optional[torch.dtype]:
    """float32 when int4 experts are copied as stored and the checkpoint's expert scales are not
    all bf16 (GPTQ's are fp16): kt's int4 scales default to bf16, which would round them. None
    (the format's default) otherwise."""
    if not (stored.method == "int4" and expert_format == "int4" and group_size == stored.group_size):
        return None
    dtypes = {ref.dtype for w in weights if w.slot is not None for parts in w.sources.values()
              for role, ref in parts.items() if role in ("group_scale", "gptq_scales")}
    return torch.float32 if dtypes - {"BF16"} else None


def _build_model(config, dtype: torch.dtype) -> nn.Module:
    """The class the checkpoint names (``config.architectures``, as transformers writes it:
    multimodal wrappers too), else ``AutoModelForCausalLM``, built from ``config``."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls._from_config(config, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _model_dtype(dtype: Optional[torch.dtype], config) -> torch.dtype:
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"from_pretrained: dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


class _Plan:
    """Maps checkpoint tensors to the model's weights (transformers' conversion mapping),
    checked against the headers: built on the unpatched meta model."""

    def __init__(self, model: nn.Module, stored: CheckpointQuantization):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.stored = stored
        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.meta_state = model.state_dict()
        self.experts_paths = [n for n, m in model.named_modules() if is_experts_module(m)]
        # transformers' layout of each experts module (transposed, interleaved, with biases); the
        # shapes below are kt's: gate_up [E, 2I, H]
        self.layouts = {n: ExpertsLayout.of(model.get_submodule(n)) for n in self.experts_paths}
        self.expert_shapes = {}
        for n, layout in self.layouts.items():
            E, I, H = layout.sizes(model.get_submodule(n).gate_up_proj)
            self.expert_shapes[n] = (E, 2 * I, H)
        self.num_experts = {n: shape[0] for n, shape in self.expert_shapes.items()}
        self.tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        # transformers' keep-in-fp32 rule (e.g. DeepSeek-V3's routing bias stays fp32 in a bf16 model)
        self.dtype_plan = model._get_dtype_plan(model.dtype) if hasattr(model, "_get_dtype_plan") else {}
        if self.dtype_plan:
            from transformers.core_model_loading import build_glob_alternation
            self.dtype_patterns, self.dtype_groups, _ = build_glob_alternation(list(self.dtype_plan))

    def dtype_of(self, target: str) -> torch.dtype:
        """The dtype transformers' from_pretrained gives a non-expert tensor."""
        found = self.dtype_patterns.search(target) if self.dtype_plan else None
        if found is not None:
            return self.dtype_plan[self.dtype_groups[found.lastgroup]]
        return self.meta_state[target].dtype

    def weights_of(self, refs: list[TensorRef]) -> list[_Weight]:
        """Groups the stored tensors into the weights they fill; ValueError for anything the
        model has no place for, lacks, or cannot read."""
        weights: dict[tuple, _Weight] = {}
        unexpected = []
        for ref in refs:
            if self.stored.unused(ref.key):  # an FP4 checkpoint's activation / KV-cache scales
                continue
            base, role = self.stored.split_role(ref.key)
            target, slot, converter, pattern = self._target_of(base)
            if slot is None and target not in self.meta_state:
                if not any(p.search(ref.key) for p in self.ignored):
                    unexpected.append(ref.key)
                continue
            key = (slot.path, slot.proj, slot.expert) if slot else (target,)
            weight = weights.setdefault(key, _Weight(target, slot, converter))
            parts = weight.sources.setdefault(base, {})
            if role in parts or (converter is None and len(weight.sources) > 1):
                other = parts[role].key if role in parts else weight.refs[0].key
                raise ValueError(f"checkpoint: {ref.key} and {other} both fill {target}")
            parts[role] = ref
            if pattern is not None:
                weight.patterns[base] = pattern
        if unexpected:
            raise ValueError(f"checkpoint: {len(unexpected)} tensor(s) the model has no place for: "
                             f"{_names(unexpected)}")
        for weight in weights.values():
            for name, parts in weight.sources.items():
                self._check_parts(weight, name, parts)
        self._check_complete(weights)
        return list(weights.values())

    def _target_of(self, key: str):
        """``(model key, expert slot or None, converter or None, its source pattern or None)``."""
        from transformers.core_model_loading import apply_renamings, rename_source_key

        target, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta_state)
        if target not in self.meta_state and key in self.meta_state:  # as transformers: the key as it is
            target, pattern = rename_source_key(key, [], [], self.prefix, self.meta_state)
        renamed = apply_renamings(key, self.renamings)
        converter = None if pattern is None else next(
            c for c in self.converters if pattern in c.source_patterns and c.compiled_sources.search(renamed))
        path, _, leaf = target.rpartition(".")
        if path not in self.num_experts or leaf not in ("gate_up_proj", "down_proj") + _BIAS_LEAVES:
            return target, None, converter, pattern
        if pattern is None:  # stored fused, as the model holds it (transposed: relative to kt's layout)
            transpose = "always" if self.layouts[path].transposed else None
            return target, _ExpertSlot(path, leaf, None, transpose), None, None
        if leaf in _BIAS_LEAVES:
            raise ValueError(f"checkpoint: {key}: transformers builds {target} from it with a conversion; kt_ops reads "
                             "expert biases stored fused, as the model holds them")
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        op = converter.operations[0]
        if (len(ops) == 1 and ops[0][0] == "Transpose" and (op.dim0, op.dim1) in ((1, 2), (2, 1))
                and len(converter.source_patterns) == 1):  # fused, stored transposed
            return target, _ExpertSlot(path, leaf, None, "if_needed" if op.check_dims else "always"), None, None
        want = [("MergeModulelist", 0), ("Concatenate", 1)] if leaf == "gate_up_proj" else [("MergeModulelist", 0)]
        if ops != want or len(converter.source_patterns) != len(want):
            raise ValueError(f"checkpoint: {key}: transformers builds {target} from it with {ops}; kt_ops reads experts "
                             "stored per expert (stacked, gate|up concatenated) or fused as the model holds them")
        # the pattern is a regex as transformers reads it ("*." -> any name), its "*" the expert index
        found = re.search(pattern.replace("*.", r"(\d+)\."), renamed)
        if found is None:
            raise ValueError(f"checkpoint: {key}: no expert index where {pattern!r} has its '*'")
        proj = "down_proj" if leaf == "down_proj" else ("gate_proj", "up_proj")[converter.source_patterns.index(pattern)]
        return target, _ExpertSlot(path, proj, int(found.group(1))), None, None

    def _check_parts(self, weight: _Weight, name: str, parts: dict) -> None:
        if "zero_point" in parts:
            raise ValueError(f"checkpoint: {parts['zero_point'].key}: asymmetric quantization (zero points); kt_ops "
                             "reads symmetric weights")
        if "qweight" in parts:
            if "gptq_scales" not in parts:
                raise ValueError(f"checkpoint: {parts['qweight'].key} has no {name[: -len('.weight')]}.scales")
            if "value" in parts:
                raise ValueError(f"checkpoint: {name} is stored both as GPTQ qweight and as {parts['value'].key}")
            expected = ("qweight", "qzeros", "gptq_scales", "g_idx")
        elif "packed" in parts:
            if "group_scale" not in parts:
                raise ValueError(f"checkpoint: {parts['packed'].key} has no {name}_scale")
            if "value" in parts:
                raise ValueError(f"checkpoint: {name} is stored both packed and as {parts['value'].key}")
            expected = ("packed", "group_scale", "shape")
        elif set(parts) & set(_FP4_ROLES):
            expected = self._check_fp4_parts(weight, name, parts)
        else:
            if "value" not in parts:
                raise ValueError(f"checkpoint: {_names([r.key for r in parts.values()])} without the weight {name}")
            stored_as = {"F8_E4M3": "float8_e4m3fn", "I8": "int8"}.get(parts["value"].dtype)  # values with a scale
            if self.stored.quant_method == "modelopt" and parts["value"].dtype == "U8":
                raise ValueError(f"checkpoint: {name} is uint8 (packed NVFP4) without {name}_scale and "
                                 f"{name}_scale_2")
            if stored_as and "value_scale" not in parts:
                raise ValueError(f"checkpoint: {name} is {stored_as} without {self.stored.scale_key(name)} "
                                 "(kt_ops reads FP8 and INT8 weights with their scales)")
            if not stored_as and "value_scale" in parts:
                raise ValueError(f"checkpoint: {parts['value_scale'].key} belongs to {name}, which is "
                                 f"{parts['value'].dtype}, not float8_e4m3fn or int8")
            expected = ("value", "value_scale")
        extra = [r.key for role, r in parts.items() if role not in expected]
        if extra:
            raise ValueError(f"checkpoint: {_names(extra)}: not read with {name}")
        got = _logical_shape(parts, self.stored.int8_is_fp4)
        if weight.converter is not None:
            return  # transformers' ops make the target: its shape is checked once they have
        if weight.slot is None:
            want, what = tuple(self.meta_state[weight.target].shape), f"the model's {weight.target}"
        else:
            slot = weight.slot
            E, two_i, H = self.expert_shapes[slot.path]
            I = two_i // 2
            want = {"gate_up_proj": (E, two_i, H), "down_proj": (E, H, I), "gate_up_proj_bias": (E, two_i),
                    "down_proj_bias": (E, H)}[slot.proj] if slot.expert is None \
                else ((H, I) if slot.proj == "down_proj" else (I, H))
            what = f"{slot.path}'s {slot.proj}" + ("" if slot.expert is None else " of one expert")
            if slot.expert is not None and not 0 <= slot.expert < E:
                raise ValueError(f"checkpoint: {name}: expert {slot.expert}, but {slot.path} has {E} experts")
            swapped = (got[0], got[2], got[1]) if len(got) == 3 else got
            stored_as_model = "value" in parts and slot.proj not in _BIAS_LEAVES  # MXFP4 blocks are [E, out, ...]
            if stored_as_model and (slot.transpose == "always" or (slot.transpose == "if_needed" and got != want
                                                                   and swapped == want)):
                slot.transposed, got = True, swapped
        if got != want:
            raise ValueError(f"checkpoint: {name} has shape {list(got)}; {what} is {list(want)}")

    def _check_fp4_parts(self, weight: _Weight, name: str, parts: dict) -> tuple:
        """The roles an FP4 weight is stored with (ValueError naming what is missing):
        gpt-oss's fused MXFP4 blocks and scales, or an NVFP4 weight's packed codes, scales and
        global scale."""
        if "mx_blocks" in parts or "mx_scales" in parts:
            present = parts.get("mx_blocks") or parts.get("mx_scales")
            if weight.slot is None or weight.slot.expert is not None:
                raise ValueError(f"checkpoint: {present.key}: kt_ops reads MXFP4 blocks of fused experts "
                                 "(gpt-oss's experts.gate_up_proj_blocks / down_proj_blocks)")
            for role, suffix in (("mx_blocks", "_blocks"), ("mx_scales", "_scales")):
                if role not in parts:
                    raise ValueError(f"checkpoint: {present.key} has no {name}{suffix}")
            blocks, scales = parts["mx_blocks"], parts["mx_scales"]
            if len(blocks.shape) != 4 or blocks.shape[-1] != fp4_checkpoints.MXFP4_GROUP // 2 \
                    or tuple(scales.shape) != tuple(blocks.shape[:-1]):
                raise ValueError(f"checkpoint: {blocks.key} {list(blocks.shape)} and {scales.key} "
                                 f"{list(scales.shape)}: expected [E, out, in/32, 16] and [E, out, in/32]")
            return ("mx_blocks", "mx_scales")
        packed_role, global_role, global_suffix = (
            ("fp4_packed", "global_scale_inv", "_global_scale") if self.stored.quant_method == "compressed-tensors"
            else ("value", "global_scale", "_scale_2"))
        expected = (packed_role, "fp4_scale", global_role)
        present = next(parts[r] for r in expected + tuple(_FP4_ROLES) if r in parts)
        for role, suffix in zip(expected, ("_packed" if packed_role == "fp4_packed" else "", "_scale", global_suffix)):
            if role not in parts:
                raise ValueError(f"checkpoint: {present.key} has no {name}{suffix} (kt_ops reads NVFP4 weights "
                                 "with their codes, scales and global scale)")
        if parts[packed_role].dtype != "U8":
            raise ValueError(f"checkpoint: {parts[packed_role].key} is {parts[packed_role].dtype}; an NVFP4 "
                             "weight's codes are uint8 (two per byte)")
        return expected

    def _check_complete(self, weights: dict) -> None:
        missing = []
        filled = {t for w in weights.values() if w.slot is None for t in w.targets}
        for target in self.meta_state:
            path, _, leaf = target.rpartition(".")
            if path in self.num_experts:
                continue
            if target not in filled and not (target in self.tied and self.tied[target] in filled):
                missing.append(target)
        for path, E in self.num_experts.items():
            if self.layouts[path].has_bias:  # fused, as the model holds them
                missing += [f"{path}.{leaf}" for leaf in _BIAS_LEAVES if (path, leaf, None) not in weights]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                fused = (path, "gate_up_proj" if proj != "down_proj" else "down_proj", None)
                if fused in weights:
                    if any((path, proj, e) in weights for e in range(E)):
                        raise ValueError(f"checkpoint: {path}.{proj} is stored both fused and per expert")
                    continue
                lacking = [e for e in range(E) if (path, proj, e) not in weights]
                if lacking:
                    missing.append(f"{path}.{{{_ranges(lacking)}}}.{proj}.weight (expert {proj} of {path})")
        if missing:
            raise ValueError(f"checkpoint: {len(missing)} weight(s) of the model missing: {_names(missing)}")


_BIAS_LEAVES = ("gate_up_proj_bias", "down_proj_bias")
# The roles of FP4 tensors (fp4_checkpoints): gpt-oss's MXFP4 blocks, NVFP4's codes and scales.
_FP4_ROLES = ("mx_blocks", "mx_scales", "fp4_packed", "fp4_scale", "global_scale", "global_scale_inv")


def _logical_shape(parts: dict, int8_is_fp4: bool = False) -> tuple:
    if "qweight" in parts:  # GPTQ: [in/8, out]
        words, out = parts["qweight"].shape
        return (out, 8 * words)
    if "mx_blocks" in parts:  # gpt-oss: [E, out, in/32, 16]
        E, out, groups, half = parts["mx_blocks"].shape
        return (E, out, 2 * groups * half)
    if "fp4_scale" in parts:  # NVFP4 codes, two per byte: [out, in/2]
        packed = parts.get("fp4_packed") or parts["value"]
        return (*packed.shape[:-1], 2 * packed.shape[-1])
    if int8_is_fp4 and parts["value"].dtype == "I8":  # DeepSeek-V4's FP4 experts: [out, in/2]
        *lead, half = parts["value"].shape
        return (*lead, 2 * half)
    if "packed" in parts:
        out, words = parts["packed"].shape
        return (out, 8 * words)
    return tuple(parts["value"].shape)


class _Loader:
    """Reads the planned weights shard by shard and writes each where it ends."""

    def __init__(self, model: nn.Module, plan: _Plan, experts: dict, device: torch.device):
        self.model, self.plan, self.experts, self.device = model, plan, experts, device
        self.readers: dict[str, ShardReader] = {}
        self.stats = {"tensors_read": 0, "expert_tensors_read": 0, "bytes_read": 0}

    def load(self, weights: list[_Weight], progress: bool) -> None:
        from transformers.utils.logging import tqdm

        order = {f: i for i, f in enumerate(dict.fromkeys(w.first_file for w in weights))}
        weights = sorted(weights, key=lambda w: (order[w.first_file], w.name))
        with tqdm(total=sum(w.nbytes for w in weights), unit="B", unit_scale=True, desc="Loading checkpoint",
                  disable=not progress) as bar:
            current = None
            for weight in weights:
                file = weight.first_file
                if file != current and current is not None:
                    self._close(current)  # done with that shard: drop its mapping
                current = file
                if weight.slot is None:
                    self._load_param(weight)
                else:
                    self._load_expert(weight)
                bar.update(weight.nbytes)
        for file in list(self.readers):
            self._close(file)
        self.model.kt_load_stats = self.stats

    def _close(self, file: str) -> None:
        reader = self.readers.pop(file)
        reader.close()
        self.stats["tensors_read"] += reader.tensors_read
        self.stats["bytes_read"] += reader.bytes_read

    def _read(self, ref: TensorRef, index: Optional[int] = None, expert: bool = False) -> torch.Tensor:
        self.stats["expert_tensors_read"] += int(expert)
        return self.readers.setdefault(ref.file, ShardReader(ref.file)).read(ref, index)

    def _stored(self, weight: _Weight, index: Optional[int] = None, expert: bool = False,
                name: Optional[str] = None) -> StoredMatrix:
        name = name or weight.name
        refs = weight.sources[name]
        # a fused expert tensor's every part holds all experts: one expert's is read
        parts = {role: self._read(ref, index, expert) for role, ref in refs.items()}
        matrix = StoredMatrix.from_parts(parts, name, self.plan.stored.gptq_stored_zero, self.plan.stored.int8_is_fp4)
        scale_ref = next((refs[r] for r in ("value_scale", "fp4_scale", "mx_scales") if r in refs), None)
        scale_name = scale_ref and scale_ref.key
        matrix.check(name if index is None else f"{name}[{index}]",
                     scale_name if index is None or scale_name is None else f"{scale_name}[{index}]")
        return matrix

    def _value(self, weight: _Weight, name: str) -> torch.Tensor:
        matrix = self._stored(weight, name=name)
        return matrix.to_float() if matrix.fmt else matrix.data

    def _load_param(self, weight: _Weight) -> None:
        from accelerate.utils import set_module_tensor_to_device

        if weight.converter is None:
            values = {weight.target: self._value(weight, weight.name)}
        else:  # transformers' own ops (merge, split, permute...) on the stored tensors, in its order
            from transformers.core_model_loading import dot_natural_key

            converter = copy.deepcopy(weight.converter)
            for name in sorted(weight.sources, key=dot_natural_key):
                value = self._value(weight, name)
                converter.add_tensor(weight.target, name, weight.patterns[name], lambda v=value: v)
            values = converter.convert(weight.target, model=self.model, config=self.model.config)
        for target, value in values.items():
            expected = self.plan.meta_state.get(target)
            if expected is None or tuple(value.shape) != tuple(expected.shape):
                raise ValueError(f"checkpoint: {_names(list(weight.sources))} make {target} of shape {list(value.shape)}; "
                                 f"the model's is {None if expected is None else list(expected.shape)}")
            with torch.no_grad():
                set_module_tensor_to_device(self.model, target, self.device, value=value, dtype=self.plan.dtype_of(target))
            module_path, _, leaf = target.rpartition(".")
            param = self.model.get_submodule(module_path)._parameters.get(leaf)
            if param is not None:  # as transformers' loader: every loaded float parameter trains
                param.requires_grad_(param.is_floating_point())

    def _load_expert(self, weight: _Weight) -> None:
        slot = weight.slot
        kt = self.experts[slot.path]
        first = kt.expert_range.start  # the experts of this rank's shard sit at e - first
        if slot.expert is not None:
            self._write(kt, slot.proj, slot.expert - first, self._stored(weight, expert=True), weight.name)
            return
        # Fused (its shapes were checked from the headers: _Plan._check_parts), in the model's
        # layout: gate and up rows concatenated or interleaved.
        layout = self.plan.layouts[slot.path]
        I = kt.intermediate_size
        gate, up = (slice(0, None, 2), slice(1, None, 2)) if layout.interleaved else (slice(0, I), slice(I, None))
        for e in kt.expert_range:  # one expert at a time: a fused tensor is never read whole
            name = f"{weight.name}[{e}]"
            if slot.proj in _BIAS_LEAVES:
                bias = self._read(weight.parts["value"], e, expert=True)
                targets = {"gate_bias": bias[gate], "up_bias": bias[up]} if slot.proj == "gate_up_proj_bias" \
                    else {"down_bias": bias}
                with torch.no_grad():
                    for target, value in targets.items():
                        getattr(kt, target)[e - first].copy_(value)
                continue
            m = self._stored(weight, index=e, expert=True)
            if slot.transposed:
                m = m.transposed()
            if slot.proj == "gate_up_proj":
                self._write(kt, "gate_proj", e - first, m.rows(gate), name)
                self._write(kt, "up_proj", e - first, m.rows(up), name)
            else:
                self._write(kt, "down_proj", e - first, m, name)

    @staticmethod
    def _write(kt, proj: str, e: int, matrix: StoredMatrix, name: str) -> None:
        data = getattr(kt, proj)
        with torch.no_grad():
            if kt.expert_format is None:
                data[e].copy_(matrix.to_float())
                return
            scale = getattr(kt, proj.replace("proj", "scale"))
            global_scale = getattr(kt, proj.replace("proj", "global_scale"), None)  # nvfp4's, per expert
            if matrix.fmt == kt.expert_format and matrix.scale.shape == scale.shape[1:]:
                data[e].copy_(matrix.data)  # stored in kt's own format: copied as is
                scale[e].copy_(matrix.scale)
                if global_scale is not None:
                    global_scale[e].copy_(matrix.global_scale)
                return
            # Through the model's dtype first, as from_pretrained(dtype) + patch_model would quantize it.
            quantized = quantization.quantize(matrix.to_float().to(kt.expert_dtype).unsqueeze(0), kt.expert_format,
                                              kt.group_size, scale_dtype=scale.dtype, name=name)
            data[e].copy_(quantized[0][0])
            scale[e].copy_(quantized[1][0])
            if global_scale is not None:
                global_scale[e].copy_(quantized[2][0])


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """The buffers computed at construction (rotary frequencies, ...) go where the weights went."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)


def _attach_generation_config(model: nn.Module, path: str) -> None:
    if not os.path.isfile(os.path.join(path, "generation_config.json")) or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(path)


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
