"""How a shipped checkpoint stores a weight matrix, and how to turn it into kt_ops' forms.

Three storage forms, told apart by the config's ``quantization_config`` and the tensor names:

============================  ======================================  ====================================
checkpoint                    tensors of one ``X.weight``             kt_ops form
============================  ======================================  ====================================
float (bf16 / fp16 / fp32)    ``X.weight``                            any dtype, or quantized on the way
FP8 blocks (DeepSeek-V3:      ``X.weight`` float8_e4m3fn ``[out, in]``   ``"fp8"`` as is (``weight_scale_inv``
``quant_method: fp8``,        ``X.weight_scale_inv`` fp32               is kt's fp8 block scale)
``weight_block_size [128,     ``[ceil(out/128), ceil(in/128)]``
128]``)
compressed-tensors            ``X.weight_packed`` int32 ``[out, in/8]``  ``"int4"`` as is (the int32 words'
``pack-quantized`` INT4       ``X.weight_scale`` ``[out, in/g]``        little-endian bytes are kt's int4
(symmetric, group ``g``;      ``X.weight_shape`` ``[2]``                bytes: value ``q + 8``, column
Kimi-K2-Thinking)                                                     ``2j`` low nibble of byte ``j``)
============================  ======================================  ====================================

Only weight quantization is read: kt_ops computes activations in the model's dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from kt_ops import quantization

# Tensor-name suffixes that belong to a quantized ``X.weight``, per checkpoint method.
_ROLE_SUFFIXES = {
    "fp8": ((".weight_scale_inv", "scale_inv"),),
    "int4": ((".weight_packed", "packed"), (".weight_scale", "group_scale"), (".weight_shape", "shape"),
             (".weight_zero_point", "zero_point")),
}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What ``config.quantization_config`` says about the stored weights (``method`` None:
    plain float tensors)."""
    method: Optional[str] = None      # None, "fp8" or "int4"
    group_size: Optional[int] = None  # int4's input columns per scale

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
            return cls("fp8")
        if method == "compressed-tensors":
            return cls("int4", _compressed_tensors_group_size(qc))
        raise ValueError(f"quantization_config.quant_method is {method!r}; kt_ops reads float checkpoints, "
                         "'fp8' (128x128 block scales) and 'compressed-tensors' pack-quantized INT4")

    def split_role(self, key: str) -> tuple[str, str]:
        """``(the key of the weight it belongs to, role)``: ``"value"`` for a weight (or any
        other tensor), else the quantization tensor's role (``scale_inv``, ``packed``, ...)."""
        for suffix, role in _ROLE_SUFFIXES.get(self.method, ()):
            if key.endswith(suffix):
                return key[: -len(suffix)] + ".weight", role
        return key, "value"


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
    ``data``), ``"fp8"`` or ``"int4"`` (``data`` in kt_ops' layout of that format, ``scale``)."""
    data: Tensor
    fmt: Optional[str] = None
    scale: Optional[Tensor] = None

    @classmethod
    def from_parts(cls, parts: dict[str, Tensor], name: str) -> "StoredMatrix":
        """From the tensors of one weight, by role (see :meth:`CheckpointQuantization.split_role`)."""
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
            return cls(data, "fp8", parts["scale_inv"])
        return cls(data)

    @property
    def shape(self) -> tuple[int, int]:
        out, stored_in = self.data.shape
        return out, 2 * stored_in if self.fmt == "int4" else stored_in

    @property
    def group_size(self) -> Optional[int]:
        return self.shape[1] // self.scale.shape[1] if self.fmt == "int4" else None

    def to_float(self) -> Tensor:
        """The weight's values (float32 for a quantized one: exactly what kt's kernels compute)."""
        if self.fmt is None:
            return self.data
        return quantization.dequantize(self.data.unsqueeze(0), self.scale.unsqueeze(0))[0]

    def check(self, name: str) -> None:
        """ValueError naming ``name`` when the scale does not fit the data."""
        if self.fmt is None:
            return
        out, inp = self.shape
        if self.fmt == "fp8":
            want = (-(-out // quantization.FP8_BLOCK), -(-inp // quantization.FP8_BLOCK))
            what = "one per 128x128 block"
        else:
            g = inp // self.scale.shape[1] if self.scale.dim() == 2 and self.scale.shape[1] else 0
            want = (out, inp // g) if g in quantization.GROUP_SIZES and inp % g == 0 else None
            what = f"one per group of {quantization.GROUP_SIZES} input columns"
        if want is None or tuple(self.scale.shape) != want or self.scale.dtype not in (torch.float32, torch.bfloat16):
            suffix = "_scale_inv" if self.fmt == "fp8" else "_scale"
            raise ValueError(f"{name}{suffix}: expected float32/bfloat16 scales {want or '[out, in/g]'} ({what}) for "
                             f"a [{out}, {inp}] weight, got {self.scale.dtype} {tuple(self.scale.shape)}")
