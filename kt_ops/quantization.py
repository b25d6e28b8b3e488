"""Weight-only quantization of frozen expert weights: the formats kt.moe computes on.

=======  ====================  ===========================  ==========================================
format   weight dtype          weight shape                 scale (one per ...)
=======  ====================  ===========================  ==========================================
fp8      float8_e4m3fn         ``[E, out, in]``             128x128 block: ``[E, ceil(out/128), ceil(in/128)]``
int8     int8                  ``[E, out, in]``             output channel: ``[E, out]``
int4     uint8 (2 per byte)    ``[E, out, in/2]``           group of g input columns: ``[E, out, in/g]``
=======  ====================  ===========================  ==========================================

A weight is ``q * scale`` computed in float32 (that float32 value is the dequantized weight:
:func:`dequantize` returns it, the kernels multiply by it). int4 stores ``q + 8`` (q in
``[-8, 7]``), column ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in the high one:
the byte order of compressed-tensors' pack-quantized int32 words. The fp8 block is DeepSeek-V3's
``weight_block_size [128, 128]`` (its ``weight_scale_inv`` is this scale).

Scales may be float32 or bfloat16 (the kernels read either). :func:`quantize` writes float32
scales for fp8 and int8 (a few per thousand weights) and bfloat16 ones for int4, whose scales
are one per ``g`` weights: float32 there would add a quarter to int4's bytes at ``g = 32``.
Quantization is symmetric (amax / 448 for fp8, amax / 127 for int8, amax / 7 for int4),
round to nearest even; an all-zero block or group gets scale 1.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FORMATS = ("fp8", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
FP8_BLOCK = 128
_DTYPE_OF = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}
_FORMAT_OF = {dtype: fmt for fmt, dtype in _DTYPE_OF.items()}
_DEFAULT_SCALE_DTYPE = {"fp8": torch.float32, "int8": torch.float32, "int4": torch.bfloat16}
_QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def format_of(weight: Tensor) -> Optional[str]:
    """``"fp8"``, ``"int8"`` or ``"int4"`` for a quantized weight tensor, None for a float one."""
    return _FORMAT_OF.get(weight.dtype)


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How frozen base experts are stored: ``name`` None (the model's dtype) or one of
    :data:`FORMATS`, and int4's input columns per scale (``group_size``, None for the others).

    Made by :meth:`parse`, which checks an ``expert_format`` / ``group_size`` pair once, with
    one message per mistake; the entry points (``kt_ops.finetune``'s ``--expert-format``,
    ``from_pretrained``, ``patch_model``, ``KTMoE``, :func:`quantize`) parse what they are given
    and pass the parsed value down, where it parses to itself."""
    name: Optional[str] = None
    group_size: Optional[int] = None

    @classmethod
    def parse(cls, expert_format, group_size: Optional[int] = None, where: str = "expert_format", *,
              default_group_size: int = 32) -> "ExpertFormat":
        """``expert_format`` (None, a name of :data:`FORMATS`, or an ExpertFormat) with
        ``group_size`` (int4 only; ``default_group_size`` when None). ValueError naming
        ``where`` and the argument otherwise."""
        if isinstance(expert_format, ExpertFormat):
            if group_size is not None and group_size != expert_format.group_size:
                raise ValueError(f"{where}: group_size={group_size!r} given beside {expert_format}")
            return expert_format
        if expert_format is not None and expert_format not in FORMATS:
            raise ValueError(f"{where}: expert_format must be None or one of {FORMATS}, got {expert_format!r}")
        if expert_format != "int4":
            if group_size is not None:
                raise ValueError(f"{where}: group_size is for expert_format='int4' only, got group_size={group_size!r} "
                                 f"with expert_format={expert_format!r}")
            return cls(expert_format, None)
        group_size = default_group_size if group_size is None else group_size
        if group_size not in GROUP_SIZES:
            raise ValueError(f"{where}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        return cls("int4", group_size)

    @property
    def quantized(self) -> bool:
        return self.name is not None

    def check_trainable(self, train_base: bool, where: str) -> None:
        """ValueError when quantized experts would be trained in full (``train_base=True``)."""
        if self.quantized and train_base:
            raise ValueError(f"{where}: train_base=True cannot train quantized experts (expert_format={self.name!r}): "
                             "quantized base weights are frozen; train LoRA adapters (lora_rank > 0) or use float "
                             "experts")

    def size_problem(self, hidden_size: int, intermediate_size: int) -> Optional[str]:
        """Why experts of these sizes cannot be stored in this format, or None."""
        if self.name == "int4" and (hidden_size % self.group_size or intermediate_size % self.group_size):
            return (f"int4 groups of {self.group_size} must divide hidden size {hidden_size} and intermediate size "
                    f"{intermediate_size}; choose another group_size")
        return None

    def __str__(self) -> str:
        if self.name == "int4":
            return f"expert_format='int4' (group_size={self.group_size})"
        return f"expert_format={self.name!r}"


def check_format(expert_format: Optional[str], group_size: Optional[int], where: str) -> Optional[int]:
    """The group size to use for an ``expert_format`` / ``group_size`` pair (32 by default for
    int4, None otherwise), checked: :meth:`ExpertFormat.parse`'s ``group_size``."""
    return ExpertFormat.parse(expert_format, group_size, where).group_size


def quantize(weight: Tensor, expert_format: str, group_size: Optional[int] = None, *,
             scale_dtype: Optional[torch.dtype] = None, name: str = "weight") -> tuple[Tensor, Tensor]:
    """``weight [E, out, in]`` (any float dtype) -> ``(data, scale)`` in ``expert_format``.

    Works one expert at a time, so the extra memory is one expert's float32 copy. Raises
    ValueError (naming ``name``) for NaN or inf weights, or an ``in`` that int4's groups do not
    divide."""
    fmt = ExpertFormat.parse(expert_format, group_size, "quantize")
    if not fmt.quantized:
        raise ValueError("quantize: expert_format must be one of " + repr(FORMATS))
    expert_format, group_size = fmt.name, fmt.group_size
    if weight.dim() != 3 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize: {name} must be a 3-d float tensor [E, out, in], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    E, out, inp = weight.shape
    if expert_format == "int4" and inp % group_size:
        raise ValueError(f"quantize: {name} has {inp} input columns, not a multiple of group_size={group_size}")
    scale_dtype = scale_dtype or _DEFAULT_SCALE_DTYPE[expert_format]
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize: scale_dtype must be float32 or bfloat16, got {scale_dtype}")
    stored_in = inp // 2 if expert_format == "int4" else inp
    data = torch.empty(E, out, stored_in, dtype=_DTYPE_OF[expert_format], device=weight.device)
    scale = torch.empty(_scale_shape(expert_format, E, out, inp, group_size), dtype=scale_dtype, device=weight.device)
    with torch.no_grad():
        for e in range(E):
            w = weight[e].float()
            if not torch.isfinite(w.abs().amax()):  # amax keeps a NaN or inf (and is 6x cheaper)
                raise ValueError(f"quantize: {name} has NaN or inf values (expert {e}); they cannot be quantized")
            data[e], scale[e] = _quantize_matrix(w, expert_format, group_size, scale_dtype)
    return data, scale


def fp8_scale_grid(out: int, inp: int) -> tuple[int, int]:
    """The fp8 scales of an ``[out, in]`` weight: one per 128x128 block, partial blocks included."""
    return -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)


def pack_int4(values: Tensor) -> Tensor:
    """int4's stored bytes from ``values [out, in]`` holding q + 8 (0..15): column 2j in byte j's
    low nibble, 2j + 1 in its high nibble."""
    return values[:, 0::2] | (values[:, 1::2] << 4)


def _scale_shape(fmt: str, E: int, out: int, inp: int, group_size: Optional[int]) -> tuple:
    if fmt == "fp8":
        return (E, *fp8_scale_grid(out, inp))
    if fmt == "int8":
        return (E, out)
    return (E, out, inp // group_size)


def _safe_scale(amax: Tensor, fmt: str, scale_dtype: torch.dtype) -> Tensor:
    """amax / qmax in scale_dtype (1 where amax is 0), returned in float32."""
    scale = torch.where(amax > 0, amax / _QMAX[fmt], torch.ones_like(amax))
    return scale.to(scale_dtype).float()


def _quantize_matrix(w: Tensor, fmt: str, group_size: Optional[int], scale_dtype: torch.dtype):
    out, inp = w.shape
    if fmt == "fp8":
        ob, ib = fp8_scale_grid(out, inp)
        padded = F.pad(w, (0, ib * FP8_BLOCK - inp, 0, ob * FP8_BLOCK - out))
        amax = padded.abs().reshape(ob, FP8_BLOCK, ib, FP8_BLOCK).amax(dim=(1, 3))
        scale = _safe_scale(amax, fmt, scale_dtype)
        full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:out, :inp]
        q = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, scale
    if fmt == "int8":
        scale = _safe_scale(w.abs().amax(dim=1), fmt, scale_dtype)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale
    groups = w.reshape(out, inp // group_size, group_size)
    scale = _safe_scale(groups.abs().amax(dim=2), fmt, scale_dtype)
    q = (torch.round(groups / scale[:, :, None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(out, inp)
    return pack_int4(q), scale


def dequantize(data: Tensor, scale: Tensor) -> Tensor:
    """The float32 weights ``[E, out, in]`` that quantized ``data`` and ``scale`` stand for
    (exactly the values the kernels compute with). Expert by expert, any device."""
    fmt = format_of(data)
    if fmt is None:
        raise ValueError(f"dequantize: data must be float8_e4m3fn, int8 or uint8 (int4), got {data.dtype}")
    E, out, stored_in = data.shape
    inp = 2 * stored_in if fmt == "int4" else stored_in
    result = torch.empty(E, out, inp, dtype=torch.float32, device=data.device)
    for e in range(E):
        result[e] = _dequantize_matrix(data[e], scale[e].float(), fmt, out, inp)
    return result


def _dequantize_matrix(q: Tensor, scale: Tensor, fmt: str, out: int, inp: int) -> Tensor:
    if fmt == "fp8":
        full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:out, :inp]
        return q.float() * full
    if fmt == "int8":
        return q.float() * scale.reshape(out, 1)
    values = torch.stack(((q & 0xF).to(torch.int16) - 8, (q >> 4).to(torch.int16) - 8), dim=-1).reshape(out, inp)
    return values.float() * scale.repeat_interleave(inp // scale.shape[-1], dim=1)


def nbytes(*tensors: Optional[Tensor]) -> int:
    """Bytes held by the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def storage_layout(expert_format: str, E: int, out: int, inp: int, group_size: Optional[int]
                   ) -> tuple[tuple, torch.dtype, tuple, torch.dtype]:
    """(data shape, data dtype, scale shape, scale dtype) of ``[E, out, in]`` weights in a format,
    as :func:`quantize` writes them."""
    stored_in = inp // 2 if expert_format == "int4" else inp
    return ((E, out, stored_in), _DTYPE_OF[expert_format], _scale_shape(expert_format, E, out, inp, group_size),
            _DEFAULT_SCALE_DTYPE[expert_format])


def expert_set_nbytes(num_experts: int, hidden_size: int, intermediate_size: int,
                      expert_format: Optional[str] = None, group_size: Optional[int] = None,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one layer's base experts (gate, up ``[E, I, H]``, down ``[E, H, I]``, scales
    included) as ``KTMoE`` holds them, computed from the shapes alone: what
    ``KTMoE(hidden_size, intermediate_size, num_experts, ..., expert_format=...).expert_nbytes()``
    returns, without making the layer. ``dtype`` is that of float experts (``expert_format=None``)."""
    fmt = ExpertFormat.parse(expert_format, group_size, "expert_set_nbytes")
    expert_format, group_size = fmt.name, fmt.group_size
    if (problem := fmt.size_problem(hidden_size, intermediate_size)) is not None:
        raise ValueError(f"expert_set_nbytes: {problem}")
    total = 0
    for out, inp in ((intermediate_size, hidden_size), (intermediate_size, hidden_size),
                     (hidden_size, intermediate_size)):
        if expert_format is None:
            total += num_experts * out * inp * dtype.itemsize
            continue
        shape, qdtype, scale_shape, scale_dtype = storage_layout(expert_format, num_experts, out, inp, group_size)
        total += math.prod(shape) * qdtype.itemsize + math.prod(scale_shape) * scale_dtype.itemsize
    return total
