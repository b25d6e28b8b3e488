"""How a shipped checkpoint stores a weight matrix, and how to turn it into kt_ops' forms.

Storage forms, told apart by the config's ``quantization_config`` and the tensor names:

============================  ======================================  ====================================
checkpoint                    tensors of one ``X.weight``             kt_ops form
============================  ======================================  ====================================
float (bf16 / fp16 / fp32)    ``X.weight``                            any dtype, or quantized on the way
FP8 blocks (DeepSeek-V3:      ``X.weight`` float8_e4m3fn ``[out, in]``   ``"fp8"`` as is (``weight_scale_inv``
``quant_method: fp8``,        ``X.weight_scale_inv`` fp32               is kt's fp8 block scale)
``weight_block_size [128,     ``[ceil(out/128), ceil(in/128)]``
128]``)
compressed-tensors            ``X.weight`` float8_e4m3fn ``[out, in]``   ``block`` and ``tensor``: ``"fp8"`` as
``float-quantized`` FP8       ``X.weight_scale`` fp32 / bf16:          is (a tensor's one scale is every
(llm-compressor's FP8_BLOCK,  ``block`` ``[ceil(out/128),             block's); ``channel``: dequantized
FP8_DYNAMIC, FP8)             ceil(in/128)]``, ``channel`` ``[out,     (exactly), then cast or requantized
                              1]``, ``tensor`` ``[1]``                 like a float checkpoint
compressed-tensors            ``X.weight`` int8 ``[out, in]``          ``"int8"`` as is (a tensor's one
``int-quantized`` INT8        ``X.weight_scale`` ``[out, 1]`` or ``[1]``  scale is every row's)
(W8A8: ``channel``, ``tensor``)
compressed-tensors            ``X.weight_packed`` int32 ``[out, in/8]``  ``"int4"`` as is (the int32 words'
``pack-quantized`` INT4       ``X.weight_scale`` ``[out, in/g]``        little-endian bytes are kt's int4
(symmetric, group ``g``;      ``X.weight_shape`` ``[2]``                bytes: value ``q + 8``, column
Kimi-K2-Thinking)                                                     ``2j`` low nibble of byte ``j``)
GPTQ INT4 (``quant_method:    ``X.qweight`` int32 ``[in/8, out]``        ``"int4"``: the same 4-bit values
gptq``, ``sym``, no           ``X.qzeros`` int32 ``[in/g, out/8]``      (``q`` with zero point 8), repacked
``desc_act``: Qwen3's         ``X.scales`` fp16 ``[in/g, out]``         along the input columns; the fp16
GPTQ-Int4)                    ``X.g_idx`` int32 ``[in]``                scales exactly, as float32
============================  ======================================  ====================================

and the FP4 checkpoints (gpt-oss MXFP4, compressed-tensors and ModelOpt NVFP4, DeepSeek-V4's FP4
experts in an FP8 checkpoint: ``"mxfp4"`` and ``"nvfp4"`` as is), tabled in
:mod:`kt_ops.hf.fp4_checkpoints`. DeepSeek-V4-Flash's FP8 checkpoint names a scale ``X.scale``
(transformers renames it ``X.weight_scale_inv``), stores it in E8M0 (``scale_fmt: ue8m0``: exact in
float32) and its experts' weights as int8 holding two E2M1 codes per byte (``expert_dtype: fp4``,
an E8M0 scale per 32 input columns: ``"mxfp4"``).

Only weight quantization is read: kt_ops computes activations in the model's dtype (a
checkpoint's dynamic activation quantization is left out; static activation scales are refused,
but for NVFP4's activation global scale and an FP8 KV cache's scales, which FP4 checkpoints carry
beside their weights: see fp4_checkpoints).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from kt_ops import quantization
from kt_ops.hf import fp4_checkpoints

# Tensor-name suffixes that belong to a quantized ``X.weight``, per (method, quant_method). A
# "value_scale" is the scale of a weight stored as float8 or int8 values in ``X.weight``; every
# scale is the multiplier (weight = q * scale), whatever DeepSeek's "_inv" suggests, but for
# compressed-tensors' NVFP4 "global_scale_inv" (weight_global_scale: a divisor).
_ROLE_SUFFIXES = {
    # DeepSeek-V4-Flash names the scales ``X.scale`` (transformers renames them to weight_scale_inv)
    ("fp8", "fp8"): ((".weight_scale_inv", "value_scale"), (".scale", "value_scale")),
    ("fp8", "compressed-tensors"): ((".weight_scale", "value_scale"), (".weight_zero_point", "zero_point")),
    ("int8", "compressed-tensors"): ((".weight_scale", "value_scale"), (".weight_zero_point", "zero_point")),
    ("int4", "compressed-tensors"): ((".weight_packed", "packed"), (".weight_scale", "group_scale"),
                                     (".weight_shape", "shape"), (".weight_zero_point", "zero_point")),
    ("int4", "gptq"): ((".qweight", "qweight"), (".qzeros", "qzeros"), (".scales", "gptq_scales"),
                       (".g_idx", "g_idx")),
    ("nvfp4", "compressed-tensors"): ((".weight_packed", "fp4_packed"), (".weight_scale", "fp4_scale"),
                                      (".weight_global_scale", "global_scale_inv"),
                                      (".weight_zero_point", "zero_point")),
    ("nvfp4", "modelopt"): ((".weight_scale_2", "global_scale"), (".weight_scale", "fp4_scale")),
}
# Parameters named like a scale that are none (transformers' FP8 loader leaves them alone too).
_NOT_SCALES = ("_l2_clip.scale",)
# gpt-oss names its experts' MXFP4 tensors after the fused parameter (``experts.gate_up_proj_blocks``),
# not after a ``.weight``: the weight they belong to is the parameter itself.
_PARAM_ROLE_SUFFIXES = {("mxfp4", "mxfp4"): (("_blocks", "mx_blocks"), ("_scales", "mx_scales"))}
# Tensors of an FP4 checkpoint kt_ops has no use for (see fp4_checkpoints): NVFP4's activation
# global scale; with a quantized KV cache, its scales.
_UNUSED_SUFFIXES = {("nvfp4", "compressed-tensors"): (".input_global_scale",),
                    ("nvfp4", "modelopt"): (".input_scale",)}
_KV_CACHE_SUFFIXES = (".k_scale", ".v_scale")

# GPTQ's stored zero point of symmetric 4-bit weights (2^3 = 8): its original checkpoint format
# stores zero - 1, "gptq_v2" the zero itself.
_GPTQ_STORED_ZERO = {"gptq": 7, "gptq_v2": 8}
# Formats storing two 4-bit values per byte along the input columns.
_PACKED_4BIT = ("int4", "mxfp4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What ``config.quantization_config`` says about the stored weights (``method`` None:
    plain float tensors)."""
    method: Optional[str] = None      # None, "fp8", "int8", "int4", "mxfp4" or "nvfp4"
    group_size: Optional[int] = None  # int4's input columns per scale
    # the config's: "fp8", "compressed-tensors", "gptq", "mxfp4" or "modelopt" (how tensors are named)
    quant_method: Optional[str] = None
    gptq_stored_zero: Optional[int] = None  # what a GPTQ checkpoint's qzeros hold for symmetric weights
    kv_cache_quantized: bool = False  # its k_scale / v_scale tensors are left out

    @classmethod
    def from_config(cls, quantization_config) -> "CheckpointQuantization":
        """Reads a config's ``quantization_config`` (a dict, a transformers quantization config
        or None). ValueError naming the field for a method or layout kt_ops cannot read."""
        if quantization_config is None:
            return cls()
        qc = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            if block is None or list(block) != [quantization.FP8_BLOCK] * 2:
                raise ValueError(f"quantization_config.weight_block_size is {block!r}; kt_ops reads FP8 checkpoints "
                                 f"with blocks of [{quantization.FP8_BLOCK}, {quantization.FP8_BLOCK}] (DeepSeek-V3's)")
            if qc.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"quantization_config.fmt is {qc.get('fmt')!r}; kt_ops reads float8 e4m3 weights")
            if qc.get("activation_scheme", "dynamic") != "dynamic":
                raise ValueError(f"quantization_config.activation_scheme is {qc.get('activation_scheme')!r}; kt_ops "
                                 "is weight-only and reads FP8 checkpoints with dynamic activation scales")
            for field, values in (("scale_fmt", ("float", "ue8m0")), ("expert_dtype", ("fp8", "fp4"))):
                if qc.get(field, values[0]) not in values:
                    raise ValueError(f"quantization_config.{field} is {qc.get(field)!r}; kt_ops reads FP8 checkpoints "
                                     f"with {field} in {values}")
            return cls("fp8", quant_method="fp8")
        if method == "compressed-tensors":
            kind = _compressed_tensors_kind(qc)
            if kind == "nvfp4":
                fp4_checkpoints.check_compressed_tensors_nvfp4(qc)
                return cls("nvfp4", quant_method=method, kv_cache_quantized=bool(qc.get("kv_cache_scheme")))
            if kind in _COMPRESSED_8BIT:
                _check_compressed_tensors_8bit(qc, kind)
                return cls(kind, quant_method=method)
            return cls("int4", _compressed_tensors_group_size(qc), quant_method=method)
        if method == "gptq":
            return cls("int4", _gptq_group_size(qc), quant_method=method,
                       gptq_stored_zero=_GPTQ_STORED_ZERO[qc.get("checkpoint_format", "gptq")])
        if method == "mxfp4":
            fp4_checkpoints.check_gpt_oss(qc)
            return cls("mxfp4", quant_method=method)
        if isinstance(method, str) and method.startswith("modelopt"):  # vLLM also knows "modelopt_fp4"
            return cls("nvfp4", quant_method="modelopt", kv_cache_quantized=fp4_checkpoints.check_modelopt(qc))
        raise ValueError(f"quantization_config.quant_method is {method!r}; kt_ops reads float checkpoints, "
                         "'fp8' (128x128 block scales), 'compressed-tensors' (pack-quantized INT4, "
                         "float-quantized FP8, NVFP4), 'gptq' (symmetric INT4), 'mxfp4' (gpt-oss) and "
                         "'modelopt' (NVFP4)")

    def scale_key(self, weight_key: str) -> str:
        """The name of the scale tensor of an FP8 or INT8 ``X.weight``, as this checkpoint names it."""
        suffix = ".weight_scale_inv" if self.quant_method == "fp8" else ".weight_scale"
        return weight_key[: -len(".weight")] + suffix if weight_key.endswith(".weight") else weight_key + "_scale"

    def split_role(self, key: str) -> tuple[str, str]:
        """``(the key of the weight it belongs to, role)``: ``"value"`` for a weight (or any
        other tensor), else the quantization tensor's role (``value_scale``, ``packed``, ...)."""
        for suffix, role in _ROLE_SUFFIXES.get((self.method, self.quant_method), ()):
            if key.endswith(suffix) and not key.endswith(_NOT_SCALES):
                return key[: -len(suffix)] + ".weight", role
        for suffix, role in _PARAM_ROLE_SUFFIXES.get((self.method, self.quant_method), ()):
            if key.endswith(suffix):
                return key[: -len(suffix)], role
        return key, "value"

    @property
    def int8_is_fp4(self) -> bool:
        """Whether int8 weights hold two E2M1 codes per byte: in DeepSeek's FP8 checkpoints
        (``quant_method: fp8``) they do (DeepSeek-V4's ``expert_dtype: fp4`` experts, read as
        transformers' FP8 loader reads any int8 weight there)."""
        return self.quant_method == "fp8"

    def unused(self, key: str) -> bool:
        """Whether a stored tensor is one kt_ops leaves out (never read): NVFP4's activation
        global scales, a quantized KV cache's scales."""
        suffixes = _UNUSED_SUFFIXES.get((self.method, self.quant_method), ())
        if self.kv_cache_quantized:
            suffixes += _KV_CACHE_SUFFIXES
        return key.endswith(suffixes) if suffixes else False


def _compressed_tensors_kind(qc: dict) -> str:
    """"fp8" when every config group quantizes weights to 8-bit floats, "nvfp4" to 4-bit floats,
    "int8" to 8-bit ints, else "int4" (each then checked field by field); ValueError naming the
    groups of a mix."""
    groups = qc.get("config_groups") or {}
    kinds = {}
    for name, g in groups.items():
        w = g.get("weights") or {}
        if w.get("type") == "float":
            kinds[name] = "nvfp4" if w.get("num_bits") == 4 else "fp8"
        else:
            kinds[name] = "int8" if w.get("num_bits") == 8 else "int4"
    if len(set(kinds.values())) > 1:
        by_kind = {k: [n for n, v in kinds.items() if v == k] for k in sorted(set(kinds.values()))}
        raise ValueError(f"quantization_config.config_groups mix weight kinds {by_kind}; kt_ops reads one of them")
    return next(iter(kinds.values()), "int4")


# What kt_ops reads of compressed-tensors' 8-bit weights, per kind: the weights' type, the
# strategies (one scale per ... ; see StoredMatrix.from_parts) and the checkpoint format.
_COMPRESSED_8BIT = {
    "fp8": ("float", ("block", "channel", "tensor"), "float-quantized"),
    "int8": ("int", ("channel", "tensor"), "int-quantized"),
}


def _check_compressed_tensors_8bit(qc: dict, kind: str) -> None:
    """ValueError naming the field of a config group of 8-bit weights kt_ops cannot read: they
    must be symmetric, FP8 (e4m3) per 128x128 block, per output channel or per tensor, INT8 per
    output channel or per tensor (kt's int8 holds one scale per output channel), in the kind's
    checkpoint format; activations unquantized or quantized dynamically (kt_ops is weight-only,
    so it leaves dynamic activation quantization out; static activation scales would be
    checkpoint tensors it has no use for)."""
    wtype, strategies, wanted_format = _COMPRESSED_8BIT[kind]
    fmt = qc.get("format")
    for name, group in qc["config_groups"].items():
        w = group.get("weights") or {}
        where = f"quantization_config.config_groups.{name}"
        for field, value in {"num_bits": 8, "type": wtype, "symmetric": True}.items():
            if w.get(field) != value:
                raise ValueError(f"{where}.weights.{field} is {w.get(field)!r}; kt_ops reads symmetric 8-bit {wtype} "
                                 f"weights ({field}={value!r})")
        if w.get("strategy") not in strategies:
            raise ValueError(f"{where}.weights.strategy is {w.get('strategy')!r}; kt_ops reads {kind.upper()} weights "
                             f"with one of {strategies}")
        block = w.get("block_structure")
        if w["strategy"] == "block" and (block is None or list(block) != [quantization.FP8_BLOCK] * 2):
            raise ValueError(f"{where}.weights.block_structure is {block!r}; kt_ops reads FP8 blocks of "
                             f"[{quantization.FP8_BLOCK}, {quantization.FP8_BLOCK}]")
        acts = group.get("input_activations")
        if acts is not None and not acts.get("dynamic"):
            raise ValueError(f"{where}.input_activations.dynamic is {acts.get('dynamic')!r}; kt_ops is weight-only "
                             "(activations stay in the model's dtype) and reads checkpoints whose activation "
                             "scales are dynamic, not stored")
        if group.get("format", fmt) != wanted_format:
            raise ValueError(f"{where}: format is {group.get('format', fmt)!r}; kt_ops reads {kind.upper()} weights "
                             f"{wanted_format!r}")


def _gptq_group_size(qc: dict) -> int:
    """The group size of a GPTQ config kt_ops reads: symmetric 4-bit weights, groups of
    GROUP_SIZES input columns in order (no ``desc_act`` reordering), the original or v2
    checkpoint format. ValueError naming the field otherwise."""
    expected = {"bits": 4, "sym": True, "desc_act": False}
    for field, value in expected.items():
        if qc.get(field, value if field == "desc_act" else None) != value:
            raise ValueError(f"quantization_config.{field} is {qc.get(field)!r}; kt_ops reads symmetric 4-bit GPTQ "
                             f"weights with groups in column order ({field}={value!r})")
    if qc.get("group_size") not in quantization.GROUP_SIZES:
        raise ValueError(f"quantization_config.group_size is {qc.get('group_size')!r}; kt_ops' int4 groups are "
                         f"{quantization.GROUP_SIZES}")
    if qc.get("checkpoint_format", "gptq") not in _GPTQ_STORED_ZERO:
        raise ValueError(f"quantization_config.checkpoint_format is {qc.get('checkpoint_format')!r}; kt_ops reads "
                         f"GPTQ checkpoints {sorted(_GPTQ_STORED_ZERO)}")
    return qc["group_size"]


def _compressed_tensors_group_size(qc: dict) -> int:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty; kt_ops reads compressed-tensors "
                         "pack-quantized INT4 weights")
    sizes = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        where = f"quantization_config.config_groups.{name}"
        expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for field, value in expected.items():
            if w.get(field) != value:
                raise ValueError(f"{where}.weights.{field} is {w.get(field)!r}; kt_ops reads symmetric 4-bit int "
                                 f"group-quantized weights ({field}={value!r})")
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}.input_activations is set; kt_ops is weight-only (activations stay in the "
                             "model's dtype) and reads checkpoints without activation quantization")
        if group.get("format", fmt) != "pack-quantized":
            raise ValueError(f"{where}: format is {group.get('format', fmt)!r}; kt_ops reads 'pack-quantized'")
        if w.get("group_size") not in quantization.GROUP_SIZES:
            raise ValueError(f"{where}.weights.group_size is {w.get('group_size')!r}; kt_ops' int4 groups are "
                             f"{quantization.GROUP_SIZES}")
        sizes.add(w["group_size"])
    if len(sizes) > 1:
        raise ValueError(f"quantization_config.config_groups use several group sizes {sorted(sizes)}; kt_ops reads one")
    return sizes.pop()


@dataclasses.dataclass
class StoredMatrix:
    """One ``[out, in]`` weight as the checkpoint stores it: ``fmt`` None (a float tensor in
    ``data``), ``"fp8"``, ``"int8"``, ``"int4"``, ``"mxfp4"`` or ``"nvfp4"`` (``data`` in kt_ops' layout
    of that format, ``scale``; nvfp4's ``global_scale`` a float32 scalar), or ``"fp8_rows"``
    (float8_e4m3fn ``data`` with one scale per output row, ``scale [out]``: no kt_ops format holds
    it as is)."""
    data: Tensor
    fmt: Optional[str] = None
    scale: Optional[Tensor] = None
    global_scale: Optional[Tensor] = None

    @classmethod
    def from_parts(cls, parts: dict[str, Tensor], name: str, gptq_stored_zero: Optional[int] = None,
                   int8_is_fp4: bool = False) -> "StoredMatrix":
        """From the tensors of one weight, by role (see :meth:`CheckpointQuantization.split_role`;
        ``int8_is_fp4``: its :attr:`~CheckpointQuantization.int8_is_fp4`)."""
        if "qweight" in parts:
            return cls._gptq(parts, name, gptq_stored_zero)
        if "mx_blocks" in parts:
            data, scale = fp4_checkpoints.mxfp4_from_blocks(parts["mx_blocks"], parts["mx_scales"], name)
            return cls(data, "mxfp4", scale)
        if "fp4_scale" in parts:  # NVFP4: compressed-tensors' weight_packed, or ModelOpt's uint8 weight
            packed = parts["fp4_packed"] if "fp4_packed" in parts else parts["value"]
            data, scale, global_scale = fp4_checkpoints.nvfp4_parts(
                packed, parts["fp4_scale"], name, global_scale=parts.get("global_scale"),
                global_scale_inv=parts.get("global_scale_inv"))
            return cls(data, "nvfp4", scale, global_scale)
        if "packed" in parts:
            packed, scale = parts["packed"], parts["group_scale"]
            if packed.dtype != torch.int32 or packed.dim() != 2:
                raise ValueError(f"{name}_packed: expected int32 [out, in/8], got {packed.dtype} {tuple(packed.shape)}")
            data = packed.contiguous().view(torch.uint8)  # little-endian words: kt's nibble order
            if "shape" in parts:
                out, inp = (int(v) for v in parts["shape"].tolist())
                if (out, inp) != (data.shape[0], 2 * data.shape[1]):
                    raise ValueError(f"{name}_shape is {[out, inp]}, but {name}_packed holds "
                                     f"[{data.shape[0]}, {2 * data.shape[1]}] values; kt_ops reads unpadded rows")
            return cls(data, "int4", scale)
        data = parts["value"]
        if data.dtype == torch.float8_e4m3fn:
            return cls._fp8(data, parts["value_scale"])
        if data.dtype == torch.int8 and int8_is_fp4:  # DeepSeek-V4's experts: E2M1 pairs, E8M0 per 32 columns
            scale = parts["value_scale"]
            if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
                raise ValueError(f"{name}: FP4 (int8-packed) with {scale.dtype} scales; kt_ops reads them with E8M0 "
                                 "(ue8m0) scales, one per 32 input columns: mxfp4")
            return cls(data.view(torch.uint8), "mxfp4", scale.contiguous().view(torch.float8_e8m0fnu))
        if data.dtype == torch.int8:  # one scale per output row ([out, 1]) or for the tensor ([1]: every row's)
            scale = parts["value_scale"]
            scale = scale.reshape(1).expand(data.shape[0]) if scale.numel() == 1 else scale.reshape(-1)
            return cls(data, "int8", scale.contiguous())
        return cls(data)

    @classmethod
    def _gptq(cls, parts: dict[str, Tensor], name: str, stored_zero: int) -> "StoredMatrix":
        """GPTQ's symmetric int4 in kt's layout. GPTQ packs eight input rows of one output column
        into an int32 (row 8k + j at bits 4j), each the value q + 8; kt packs two input columns
        of one output row into a byte (column 2j low nibble), each the same q + 8. ValueError
        naming the tensor for zero points other than the symmetric one (asymmetric weights) or a
        g_idx that reorders the groups (desc_act)."""
        base = name[: -len(".weight")]
        qweight, scales = parts["qweight"], parts["gptq_scales"]
        if qweight.dtype != torch.int32 or qweight.dim() != 2 or scales.dim() != 2:
            raise ValueError(f"{base}.qweight / .scales: expected int32 [in/8, out] and [in/g, out], got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}")
        # A little-endian word's byte k holds rows 8r + 2k (low nibble) and 8r + 2k + 1: kt's byte
        # 4r + k of the column's row. So the repacking is a transpose of bytes.
        words, out = qweight.shape
        data = qweight.contiguous().view(torch.uint8).reshape(words, out, 4).transpose(0, 1).reshape(out, 4 * words)
        data = data.contiguous()
        if "qzeros" in parts:
            zeros = parts["qzeros"].contiguous().view(torch.uint8)
            if not bool(((zeros & 0xF) == stored_zero).all() and ((zeros >> 4) == stored_zero).all()):
                raise ValueError(f"{base}.qzeros: zero points other than the symmetric one ({stored_zero} stored); "
                                 "kt_ops reads symmetric INT4 (asymmetric GPTQ weights are not supported)")
        inp = 8 * words
        if "g_idx" in parts and scales.shape[0] and inp % scales.shape[0] == 0:
            in_order = torch.arange(inp, dtype=torch.int64) // (inp // scales.shape[0])
            if not torch.equal(parts["g_idx"].to(torch.int64), in_order):
                raise ValueError(f"{base}.g_idx reorders the input columns' groups (desc_act); kt_ops reads groups "
                                 "of consecutive columns")
        return cls(data, "int4", scales.t().float().contiguous())  # fp16 scales: exact in float32

    @classmethod
    def _fp8(cls, data: Tensor, scale: Tensor) -> "StoredMatrix":
        """By the scale's shape: one per 128x128 block (kt's fp8 as is), one for the whole
        tensor (every block's, exactly), or one per output row ("fp8_rows"). Any other shape
        stays "fp8" for check() to name."""
        out, inp = data.shape
        grid = quantization.fp8_scale_grid(out, inp)
        if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):  # scale_fmt "ue8m0": powers of two, exact in float32
            scale = scale.contiguous().view(torch.float8_e8m0fnu).float()
        if tuple(scale.shape) == grid:
            return cls(data, "fp8", scale)
        if scale.numel() == 1:
            return cls(data, "fp8", scale.reshape(1, 1).expand(grid).contiguous())
        if tuple(scale.shape) in ((out, 1), (out,)):
            return cls(data, "fp8_rows", scale.reshape(out))
        return cls(data, "fp8", scale)

    @property
    def shape(self) -> tuple[int, int]:
        out, stored_in = self.data.shape
        return out, 2 * stored_in if self.fmt in _PACKED_4BIT else stored_in

    def rows(self, index) -> "StoredMatrix":
        """The output rows ``index`` (a slice) of this weight: its data and per-row scales (FP8
        blocks, whose scales span 128 rows, as float values)."""
        if self.fmt is None:
            return StoredMatrix(self.data[index])
        if self.fmt == "fp8":
            return StoredMatrix(self.to_float()[index])
        return StoredMatrix(self.data[index], self.fmt, self.scale[index], self.global_scale)

    def transposed(self) -> "StoredMatrix":
        """The ``[in, out]`` transpose, as float values (a quantized layout is not transposed)."""
        return StoredMatrix((self.data if self.fmt is None else self.to_float()).t())

    @property
    def group_size(self) -> Optional[int]:
        return self.shape[1] // self.scale.shape[1] if self.fmt == "int4" else None

    def to_float(self) -> Tensor:
        """The weight's values (float32 for a quantized one: exactly what kt's kernels compute)."""
        if self.fmt is None:
            return self.data
        if self.fmt == "fp8_rows":  # each float8 value (exact in float32) times its row's scale, rounded once
            return self.data.float() * self.scale.float()[:, None]
        global_scale = None if self.global_scale is None else self.global_scale.reshape(1)  # nvfp4's
        return quantization.dequantize(self.data.unsqueeze(0), self.scale.unsqueeze(0), global_scale)[0]

    def check(self, name: str, scale_name: Optional[str] = None) -> None:
        """ValueError naming the scale tensor (``scale_name``, else ``name`` + ``_scale``)
        when the scale does not fit the data."""
        if self.fmt is None:
            return
        out, inp = self.shape
        if self.fmt in fp4_checkpoints.FP4_FORMATS:
            fp4_checkpoints.check_scale(self.fmt, self.scale, out, inp, scale_name or name + "_scale")
            return
        if self.fmt == "fp8":
            want = quantization.fp8_scale_grid(out, inp)
            what = "one per 128x128 block, one per output row [out, 1] or one for the tensor [1]"
        elif self.fmt in ("fp8_rows", "int8"):
            want, what = (out,), "one per output row [out, 1] or one for the tensor [1]"
        else:
            g = inp // self.scale.shape[1] if self.scale.dim() == 2 and self.scale.shape[1] else 0
            want = (out, inp // g) if g in quantization.GROUP_SIZES and inp % g == 0 else None
            what = f"one per group of {quantization.GROUP_SIZES} input columns"
        if want is None or tuple(self.scale.shape) != want or self.scale.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{scale_name or name + '_scale'}: expected float32/bfloat16 scales "
                             f"{want or '[out, in/g]'} ({what}) for "
                             f"a [{out}, {inp}] weight, got {self.scale.dtype} {tuple(self.scale.shape)}")
