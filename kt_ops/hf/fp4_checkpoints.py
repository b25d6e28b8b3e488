"""FP4 checkpoints as they ship: which configs kt_ops reads, and their tensors in kt's layout.

Four producers store 4-bit float (E2M1) weights, all with kt's nibble order (column ``2j`` in the
low nibble of byte ``j``, ``2j + 1`` in the high one; codes 0..7 = +{0, 0.5, 1, 1.5, 2, 3, 4, 6},
8..15 the same negated):

================================  ==============================================  ==========================
checkpoint                        tensors                                         kt_ops form
================================  ==============================================  ==========================
gpt-oss MXFP4                     ``experts.gate_up_proj_blocks`` U8              ``"mxfp4"``: the bytes,
(``quant_method: mxfp4``;         ``[E, 2I, H/32, 16]`` (rows: the fused outputs,  blocks reshaped to
transformers' integrations/       gate at the even rows, up at the odd ones),     ``[out, in/2]``, gate and
mxfp4.py)                         ``_scales`` U8 ``[E, 2I, H/32]`` (E8M0: value    up rows taken out of the
                                  ``2^(byte - 127)``), ``down_proj_blocks``        interleave, scales viewed
                                  ``[E, H, I/32, 16]``, ``down_proj_scales``,      as float8_e8m0fnu
                                  biases ``gate_up_proj_bias [E, 2I]``,
                                  ``down_proj_bias [E, H]`` (float)
compressed-tensors NVFP4          ``X.weight_packed`` U8 ``[out, in/2]``,          ``"nvfp4"``: the bytes;
(``nvfp4-pack-quantized``,        ``X.weight_scale`` F8_E4M3 ``[out, in/16]``,     global = 1 /
llm-compressor's NVFP4 and        ``X.weight_global_scale`` F32 ``[1]``: a         weight_global_scale in
NVFP4A16 schemes)                 DIVISOR, w = e2m1 * scale / global_scale         float32
NVIDIA ModelOpt NVFP4             ``X.weight`` U8 ``[out, in/2]``,                 ``"nvfp4"``: the bytes,
(``quant_method: modelopt``,      ``X.weight_scale`` F8_E4M3 ``[out, in/16]``,     ``weight_scale_2`` the
``quant_algo: NVFP4`` or          ``X.weight_scale_2`` F32 ``[]``: a MULTIPLIER,   global scale as is
``W4A16_NVFP4``; or               w = e2m1 * scale * weight_scale_2
``hf_quant_config.json``)
DeepSeek-V4-Flash                 experts' ``wN.weight`` I8 ``[out, in/2]`` (two  ``"mxfp4"``: the bytes
(``quant_method: fp8``,           E2M1 codes per byte), ``wN.scale`` E8M0         (int8 viewed as uint8),
``expert_dtype: fp4``)            ``[out, in/32]`` (read by checkpoint_formats)   the scales as they are
================================  ==============================================  ==========================

kt's weight is ``e2m1 * (float(scale) * global)`` in float32 (``kt_ops.quantization.dequantize``); for
compressed-tensors that is ``e2m1 * (scale * (1 / global_scale))``, which can differ from
compressed-tensors' own ``scale / global_scale`` by one float32 rounding.

Only the weights are read: kt_ops is weight-only (activations stay in the model's dtype). NVFP4's
activation quantization (W4A4: every 16 activations scaled dynamically, under a calibrated global
scale stored as ``X.input_global_scale`` / ``X.input_scale``) and an FP8 KV cache's calibrated
scales (``k_scale`` / ``v_scale``) are left out: those tensors are not read. Other activation
schemes are refused by name, as anything else in a config kt_ops cannot honour.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import Tensor

from kt_ops.quantization import FP4_FORMATS, FP4_GROUP as _GROUP, storage_layout

MXFP4_GROUP = _GROUP["mxfp4"]
NVFP4_GROUP = _GROUP["nvfp4"]
HF_QUANT_CONFIG = "hf_quant_config.json"
_SCALE_DTYPE = {fmt: storage_layout(fmt, 1, 1, 32, None)[3] for fmt in FP4_FORMATS}  # the formats' own

# What a gpt-oss MXFP4 config may hold (Mxfp4Config.to_dict; "dequantize" is a loading option).
_GPT_OSS_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")
# ModelOpt's fields kt_ops reads or has no use for (see check_modelopt); any other is refused.
_MODELOPT_FIELDS = ("quant_method", "quant_algo", "group_size", "exclude_modules", "ignore", "producer",
                    "kv_cache_quant_algo", "kv_cache_scheme", "config_groups", "quantization")
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")


def hf_quant_config(path: str) -> Optional[dict]:
    """ModelOpt's ``hf_quant_config.json`` beside a checkpoint whose config.json has no
    ``quantization_config`` (the older ModelOpt exports), as a quantization config
    (``{"quant_method": "modelopt", "quantization": {...}, "producer": ...}``); None without one."""
    file = os.path.join(path, HF_QUANT_CONFIG)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        config = json.load(f)
    if not isinstance(config, dict) or not isinstance(config.get("quantization"), dict):
        raise ValueError(f"{file}: expected a 'quantization' object (ModelOpt's export)")
    return {"quant_method": "modelopt", **config}


def check_gpt_oss(qc: dict) -> None:
    """ValueError naming a field of a gpt-oss MXFP4 config kt_ops cannot honour. Its
    ``modules_to_not_convert`` needs nothing: transformers quantizes only the experts, and
    whatever a checkpoint stores unquantized is read as the float tensor it is."""
    extra = sorted(set(qc) - set(_GPT_OSS_FIELDS))
    if extra:
        raise ValueError(f"quantization_config.{extra[0]} is set ({qc[extra[0]]!r}); kt_ops reads gpt-oss MXFP4 "
                         f"checkpoints (quant_method 'mxfp4' with fields {list(_GPT_OSS_FIELDS)})")


def check_compressed_tensors_nvfp4(qc: dict) -> None:
    """ValueError naming the field of a compressed-tensors config group of 4-bit float weights
    that is not NVFP4 as kt_ops reads it: symmetric E2M1 weights, one FP8 scale per 16 input
    columns under a global scale (``tensor_group``), ``nvfp4-pack-quantized``; activations
    unquantized (NVFP4A16) or NVFP4's own (4-bit float, ``tensor_group`` of 16, ``dynamic:
    "local"``), left out; no output activation quantization."""
    fmt = qc.get("format")
    for name, group in (qc.get("config_groups") or {}).items():
        where = f"quantization_config.config_groups.{name}"
        w = group.get("weights") or {}
        expected = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                    "group_size": NVFP4_GROUP}
        for field, value in expected.items():
            if w.get(field) != value:
                raise ValueError(f"{where}.weights.{field} is {w.get(field)!r}; kt_ops reads NVFP4 weights "
                                 f"({field}={value!r})")
        if w.get("dynamic", False):
            raise ValueError(f"{where}.weights.dynamic is {w.get('dynamic')!r}; kt_ops reads stored NVFP4 weights")
        if group.get("format", fmt) != "nvfp4-pack-quantized":
            raise ValueError(f"{where}: format is {group.get('format', fmt)!r}; kt_ops reads 4-bit float weights "
                             "'nvfp4-pack-quantized'")
        acts = group.get("input_activations")
        if acts is not None:
            nvfp4_acts = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP,
                          "dynamic": "local"}
            for field, value in nvfp4_acts.items():
                if acts.get(field) != value:
                    raise ValueError(f"{where}.input_activations.{field} is {acts.get(field)!r}; kt_ops is weight-only "
                                     "and leaves out NVFP4's own activation quantization only (4-bit float, "
                                     f"tensor_group of {NVFP4_GROUP}, dynamic 'local')")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations is set; kt_ops is weight-only and reads checkpoints "
                             "without output activation quantization")


def check_modelopt(qc: dict) -> bool:
    """ValueError naming the field of a ModelOpt config kt_ops cannot read: it reads NVFP4
    (``quant_algo`` NVFP4 or W4A16_NVFP4, groups of 16). Accepts both of ModelOpt's layouts:
    ``{"quantization": {"quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo"}}``
    (hf_quant_config.json) and config.json's flat one (``quant_algo``, ``config_groups``,
    ``ignore``, ``kv_cache_scheme``). ``exclude_modules`` / ``ignore`` need nothing: the modules
    they name are stored unquantized and read as such. Returns whether the KV cache is quantized
    (its ``k_scale`` / ``v_scale`` tensors are then left out)."""
    extra = sorted(set(qc) - set(_MODELOPT_FIELDS))
    if extra:
        raise ValueError(f"quantization_config.{extra[0]} is set; kt_ops reads ModelOpt NVFP4 checkpoints "
                         f"(fields {list(_MODELOPT_FIELDS)})")
    where, fields = "quantization_config", qc
    if isinstance(qc.get("quantization"), dict):
        where, fields = "quantization_config.quantization", qc["quantization"]
    algo = fields.get("quant_algo")
    if str(algo).upper() not in MODELOPT_ALGOS:
        raise ValueError(f"{where}.quant_algo is {algo!r}; kt_ops reads ModelOpt checkpoints of {MODELOPT_ALGOS}")
    if fields.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise ValueError(f"{where}.group_size is {fields.get('group_size')!r}; NVFP4 scales groups of {NVFP4_GROUP}")
    for name, group in (fields.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        for field, value in {"num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}.items():
            if w.get(field, value) != value:
                raise ValueError(f"{where}.config_groups.{name}.weights.{field} is {w.get(field)!r}; kt_ops reads "
                                 f"NVFP4 weights ({field}={value!r})")
        acts = group.get("input_activations")
        if acts is not None and (acts.get("num_bits"), acts.get("type")) != (4, "float"):
            raise ValueError(f"{where}.config_groups.{name}.input_activations is {acts.get('num_bits')}-bit "
                             f"{acts.get('type')}; kt_ops is weight-only and leaves out NVFP4's own activation "
                             "scales only (4-bit float)")
    return bool(fields.get("kv_cache_quant_algo") or fields.get("kv_cache_scheme"))


def mxfp4_from_blocks(blocks: Tensor, scales: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """gpt-oss's MXFP4 tensors of one expert (``blocks [out, in/32, 16]`` uint8, ``scales
    [out, in/32]`` uint8 E8M0) -> kt's mxfp4 ``(data [out, in/2] uint8, scale [out, in/32]
    float8_e8m0fnu)``: the same bytes (block ``g``'s byte ``j`` is the row's byte ``16 g + j``,
    holding columns ``32 g + 2 j`` (low nibble) and ``+ 1`` (high)), nothing computed."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"{name}_blocks: expected uint8 [out, in/32, 16] per expert, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu) or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}_scales: expected uint8 (E8M0) scales {list(blocks.shape[:-1])} (one per block of "
                         f"{MXFP4_GROUP} of {name}_blocks), got {scales.dtype} {tuple(scales.shape)}")
    out, groups, _ = blocks.shape
    return blocks.reshape(out, groups * (MXFP4_GROUP // 2)), scales.contiguous().view(torch.float8_e8m0fnu)


def nvfp4_parts(packed: Tensor, scale: Tensor, name: str, *, global_scale: Optional[Tensor] = None,
                global_scale_inv: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """An NVFP4 weight's tensors -> kt's nvfp4 ``(data [out, in/2] uint8, scale [out, in/16]
    float8_e4m3fn, global float32 [])``, the bytes as stored. The global scale is ModelOpt's
    ``weight_scale_2`` (a multiplier) as is, or ``1 / weight_global_scale`` (compressed-tensors'
    divisor) in float32."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{name}: expected uint8 [out, in/2] (two E2M1 codes per byte), got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    stored = global_scale if global_scale is not None else global_scale_inv
    what = "weight_scale_2" if global_scale is not None else "weight_global_scale"
    if stored is None or stored.dtype != torch.float32 or stored.numel() != 1:
        got = "none" if stored is None else f"{stored.dtype} {tuple(stored.shape)}"
        raise ValueError(f"{name}: expected one float32 {what} (the tensor's global scale), got {got}")
    value = stored.reshape(())
    if global_scale is None:
        value = torch.reciprocal(value)  # float32: kt's global multiplies
    if not bool(torch.isfinite(value)) or float(value) <= 0:
        raise ValueError(f"{name}: {what} is {float(stored.reshape(()))}; a global scale is positive and finite")
    return packed, scale, value.clone()


def check_scale(fmt: str, scale: Tensor, out: int, inp: int, scale_name: str) -> None:
    """ValueError naming ``scale_name`` when an FP4 weight's scale is not ``[out, in/group]`` of
    the format's scale dtype."""
    group = _GROUP[fmt]
    want = (out, inp // group)
    if inp % group or tuple(scale.shape) != want or scale.dtype != _SCALE_DTYPE[fmt]:
        raise ValueError(f"{scale_name}: expected {_SCALE_DTYPE[fmt]} scales {list(want)} (one per {group} input "
                         f"columns) for a [{out}, {inp}] {fmt} weight, got {scale.dtype} {tuple(scale.shape)}")

