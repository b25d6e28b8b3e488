"""Weight-only quantization of frozen expert weights: the formats kt.moe computes on.

=======  ====================  ===========================  ==========================================
format   weight dtype          weight shape                 scale (one per ...)
=======  ====================  ===========================  ==========================================
fp8      float8_e4m3fn         ``[E, out, in]``             128x128 block: ``[E, ceil(out/128), ceil(in/128)]``
int8     int8                  ``[E, out, in]``             output channel: ``[E, out]``
int4     uint8 (2 per byte)    ``[E, out, in/2]``           group of g input columns: ``[E, out, in/g]``
mxfp4    uint8 (2 per byte)    ``[E, out, in/2]``           32 input columns: ``[E, out, in/32]`` float8_e8m0fnu
nvfp4    uint8 (2 per byte)    ``[E, out, in/2]``           16 input columns: ``[E, out, in/16]`` float8_e4m3fn,
                                                            times a global scale per expert ``[E]`` float32
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

The 4-bit float formats store E2M1 codes (bit 3 the sign, then 2 exponent and 1 mantissa bits:
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) in int4's nibble order. ``mxfp4`` (OCP MX, gpt-oss's
experts) scales each 32 columns by a power of two, ``2^(e - 127)`` for the E8M0 byte e, chosen
by the OCP rule ``2^(floor(log2(amax)) - 2)`` (the block's largest magnitude lands in [4, 8),
saturating at 6). ``nvfp4`` scales each 16 columns by an FP8 E4M3 scale times a float32 global
scale per expert (ModelOpt's ``weight_scale_2``; compressed-tensors stores its inverse): global
``amax / (448 * 6)``, block scale ``amax_block / 6 / global`` rounded to E4M3. A weight is
``e2m1 * (scale * global)`` in float32; values round to the nearest E2M1 (ties to the even code).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FORMATS = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
FP4_FORMATS = ("mxfp4", "nvfp4")
GROUP_SIZES = (32, 64, 128)
FP4_GROUP = {"mxfp4": 32, "nvfp4": 16}  # fixed by the formats
FP8_BLOCK = 128
_DTYPE_OF = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8, "mxfp4": torch.uint8,
             "nvfp4": torch.uint8}
_FORMAT_OF = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "int4"}
# The 4-bit float formats are uint8 data told apart from int4 by their scales' dtype.
_FP4_FORMAT_OF_SCALE = {torch.float8_e8m0fnu: "mxfp4", torch.float8_e4m3fn: "nvfp4"}
_DEFAULT_SCALE_DTYPE = {"fp8": torch.float32, "int8": torch.float32, "int4": torch.bfloat16,
                        "mxfp4": torch.float8_e8m0fnu, "nvfp4": torch.float8_e4m3fn}
_QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
# E2M1's magnitudes by code (bit 3 is the sign), and the midpoints between neighbours.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def format_of(weight: Tensor, scale: Optional[Tensor] = None) -> Optional[str]:
    """The format of a quantized weight tensor (uint8 data is int4, or mxfp4 / nvfp4 when its
    ``scale`` is float8_e8m0fnu / float8_e4m3fn), None for a float one."""
    fmt = _FORMAT_OF.get(weight.dtype)
    if fmt == "int4" and scale is not None:
        return _FP4_FORMAT_OF_SCALE.get(scale.dtype, fmt)
    return fmt


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
        if expert_format in FP4_FORMATS:
            fixed = FP4_GROUP[expert_format]
            if group_size is not None and group_size != fixed:
                raise ValueError(f"{where}: {expert_format} scales groups of {fixed} columns; group_size={group_size!r} "
                                 "cannot be chosen")
            return cls(expert_format, fixed)
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
        if self.name in FP4_FORMATS and (hidden_size % 32 or intermediate_size % 32):
            return (f"{self.name} needs hidden size {hidden_size} and intermediate size {intermediate_size} to be "
                    "multiples of 32")
        return None

    @property
    def has_global_scale(self) -> bool:
        """nvfp4 weights come with a float32 global scale per expert."""
        return self.name == "nvfp4"

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

    nvfp4 returns ``(data, scale, global_scale)``, ``global_scale [E]`` float32.

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
    if expert_format in FP4_FORMATS and inp % 32:
        raise ValueError(f"quantize: {name} has {inp} input columns; {expert_format} needs a multiple of 32")
    scale_dtype = scale_dtype or _DEFAULT_SCALE_DTYPE[expert_format]
    if expert_format in FP4_FORMATS:
        if scale_dtype != _DEFAULT_SCALE_DTYPE[expert_format]:
            raise ValueError(f"quantize: {expert_format}'s scales are {_DEFAULT_SCALE_DTYPE[expert_format]}, "
                             f"got scale_dtype={scale_dtype}")
    elif scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize: scale_dtype must be float32 or bfloat16, got {scale_dtype}")
    data_shape, data_dtype, scale_shape, _ = storage_layout(expert_format, E, out, inp, group_size)
    data = torch.empty(data_shape, dtype=data_dtype, device=weight.device)
    scale = torch.empty(scale_shape, dtype=scale_dtype, device=weight.device)
    global_scale = torch.empty(E, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for e in range(E):
            w = weight[e].float()
            if not torch.isfinite(w.abs().amax()):  # amax keeps a NaN or inf (and is 6x cheaper)
                raise ValueError(f"quantize: {name} has NaN or inf values (expert {e}); they cannot be quantized")
            if expert_format == "mxfp4":
                data[e], scale[e] = _quantize_mxfp4(w)
            elif expert_format == "nvfp4":
                data[e], scale[e], global_scale[e] = _quantize_nvfp4(w)
            else:
                data[e], scale[e] = _quantize_matrix(w, expert_format, group_size, scale_dtype)
    return (data, scale, global_scale) if expert_format == "nvfp4" else (data, scale)


def fp8_scale_grid(out: int, inp: int) -> tuple[int, int]:
    """The fp8 scales of an ``[out, in]`` weight: one per 128x128 block, partial blocks included."""
    return -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)


def pack_int4(values: Tensor) -> Tensor:
    """int4's stored bytes from ``values [out, in]`` holding q + 8 (0..15): column 2j in byte j's
    low nibble, 2j + 1 in its high nibble."""
    return values[:, 0::2] | (values[:, 1::2] << 4)


def e2m1_codes(x: Tensor) -> Tensor:
    """The E2M1 codes (uint8, 0..15) nearest to float32 ``x`` (ties to the even code,
    saturating at ±6; -0.0 keeps its sign)."""
    mag = x.abs().contiguous()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=x.dtype, device=x.device)
    code = torch.bucketize(mag, midpoints)  # a tie rounds down to the code below ...
    tie = (code < len(_E2M1_MIDPOINTS)) & (mag == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    code = code + (tie & (code % 2 == 1)).to(code.dtype)  # ... unless that code is odd
    return (code | (torch.signbit(x).to(code.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: Tensor) -> Tensor:
    """The float32 values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e8m0_values(scale: Tensor) -> Tensor:
    """float32 ``2^(e - 127)`` of float8_e8m0fnu (or uint8) scale bytes e (255 is NaN)."""
    e = scale.view(torch.uint8).to(torch.int32)
    return torch.where(e == 255, torch.nan, torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127))


def _quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    out, inp = w.shape
    groups = w.reshape(out, inp // 32, 32)
    amax = groups.abs().amax(dim=2)
    # OCP MX: shared exponent floor(log2(amax)) - emax(E2M1) = ... - 2; an all-zero block gets 2^0
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scale_bytes = (exponent + 127).to(torch.uint8)
    scale = e8m0_values(scale_bytes)
    codes = e2m1_codes((groups / scale[:, :, None]).reshape(out, inp))
    return pack_int4(codes), scale_bytes.view(torch.float8_e8m0fnu)


def _quantize_nvfp4(w: Tensor, global_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``global_scale``: the one a reader will use (default amax / (448 * 6)); a checkpoint
    storing its reciprocal passes the reciprocal of what it stores."""
    out, inp = w.shape
    if global_scale is None:
        amax = w.abs().amax()
        global_scale = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else torch.ones((), device=w.device)
    groups = w.reshape(out, inp // 16, 16)
    block = (groups.abs().amax(dim=2) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    effective = block.float() * global_scale
    safe = torch.where(effective > 0, effective, torch.ones_like(effective))
    codes = e2m1_codes((groups / safe[:, :, None]).reshape(out, inp))
    return pack_int4(codes), block, global_scale.float()


def _scale_shape(fmt: str, E: int, out: int, inp: int, group_size: Optional[int]) -> tuple:
    if fmt == "fp8":
        return (E, *fp8_scale_grid(out, inp))
    if fmt == "int8":
        return (E, out)
    return (E, out, inp // group_size)


def _safe_scale(amax: Tensor, fmt: str, scale_dtype: torch.dtype) -> Tensor:
    """amax / qmax in scale_dtype (1 where amax is 0; float8_e8m0fnu, a checkpoint's ue8m0,
    rounded up to a power of two so that no value overflows), returned in float32."""
    scale = torch.where(amax > 0, amax / _QMAX[fmt], torch.ones_like(amax))
    if scale_dtype == torch.float8_e8m0fnu:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale.to(scale_dtype).float()


def _quantize_matrix(w: Tensor, fmt: str, group_size: Optional[int], scale_dtype: torch.dtype):
    """``w [out, in]`` float32 -> (data, float32 scale rounded to ``scale_dtype``): fp8 per
    128x128 block, int8 per output row, int4 per group of ``group_size``."""
    out, inp = w.shape
    if fmt == "fp8":
        ob, ib = fp8_scale_grid(out, inp)
        if out % FP8_BLOCK == 0 and inp % FP8_BLOCK == 0:  # whole blocks: reshaped, the scales broadcast
            blocks = w.reshape(ob, FP8_BLOCK, ib, FP8_BLOCK)
            scale = _safe_scale(blocks.abs().amax(dim=(1, 3)), fmt, scale_dtype)
            q = (blocks / scale[:, None, :, None]).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
            return q.reshape(out, inp), scale
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


def dequantize(data: Tensor, scale: Tensor, global_scale: Optional[Tensor] = None) -> Tensor:
    """The float32 weights ``[E, out, in]`` that quantized ``data`` and ``scale`` (and nvfp4's
    ``global_scale [E]``) stand for (exactly the values the kernels compute with). Expert by
    expert, any device."""
    fmt = format_of(data, scale)
    if fmt is None:
        raise ValueError(f"dequantize: data must be float8_e4m3fn, int8 or uint8 (int4, mxfp4, nvfp4), got {data.dtype}")
    if (fmt == "nvfp4") != (global_scale is not None):
        raise ValueError(f"dequantize: global_scale is given with nvfp4 data, and only then (data is {fmt})")
    E, out, stored_in = data.shape
    inp = 2 * stored_in if data.dtype == torch.uint8 else stored_in
    result = torch.empty(E, out, inp, dtype=torch.float32, device=data.device)
    for e in range(E):
        if fmt == "mxfp4":
            result[e] = _dequantize_fp4(data[e], e8m0_values(scale[e]), out, inp)
        elif fmt == "nvfp4":
            result[e] = _dequantize_fp4(data[e], scale[e].float() * global_scale[e].float(), out, inp)
        else:
            result[e] = _dequantize_matrix(data[e], scale[e].float(), fmt, out, inp)
    return result


def unpack_nibbles(q: Tensor) -> Tensor:
    """``[out, in/2]`` bytes -> ``[out, in]`` codes (uint8 0..15): pack_int4's inverse."""
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], 2 * q.shape[1])


def _dequantize_fp4(q: Tensor, scale: Tensor, out: int, inp: int) -> Tensor:
    """E2M1 codes times the float32 scale of their group (``scale [out, in/g]``)."""
    return e2m1_values(unpack_nibbles(q)) * scale.repeat_interleave(inp // scale.shape[-1], dim=1)


def _dequantize_matrix(q: Tensor, scale: Tensor, fmt: str, out: int, inp: int) -> Tensor:
    if fmt == "fp8":
        if out % FP8_BLOCK == 0 and inp % FP8_BLOCK == 0:  # whole blocks: the scales broadcast, no copy of them
            blocks = q.float().reshape(out // FP8_BLOCK, FP8_BLOCK, inp // FP8_BLOCK, FP8_BLOCK)
            return blocks.mul_(scale[:, None, :, None]).reshape(out, inp)
        full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:out, :inp]
        return q.float() * full
    if fmt == "int8":
        return q.float() * scale.reshape(out, 1)
    values = unpack_nibbles(q).to(torch.int16) - 8
    return values.float() * scale.repeat_interleave(inp // scale.shape[-1], dim=1)


def nbytes(*tensors: Optional[Tensor]) -> int:
    """Bytes held by the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def storage_layout(expert_format: str, E: int, out: int, inp: int, group_size: Optional[int]
                   ) -> tuple[tuple, torch.dtype, tuple, torch.dtype]:
    """(data shape, data dtype, scale shape, scale dtype) of ``[E, out, in]`` weights in a format,
    as :func:`quantize` writes them."""
    stored_in = inp // 2 if _DTYPE_OF[expert_format] == torch.uint8 else inp
    group_size = FP4_GROUP.get(expert_format, group_size)
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
        if fmt.has_global_scale:
            total += num_experts * 4  # float32 [E]
    return total
