"""A merged float32 weight written back in the format its checkpoint stores it in.

The inverse of :class:`~kt_ops.hf.checkpoint_formats.StoredMatrix`'s reading, for the stored
forms a merge writes "same" (see :mod:`kt_ops.hf.merge`): float tensors are cast to their
dtype; FP8 (``X.weight`` float8_e4m3fn with one scale per 128x128 block, per output row or for
the tensor) and INT8 get new scales of the same shape and dtype; compressed-tensors'
pack-quantized INT4 and GPTQ's INT4 get new group scales and 4-bit values, packed as stored
(GPTQ's ``qzeros`` and ``g_idx`` stay as they are: symmetric weights, groups in order); FP4
(gpt-oss's fused MXFP4 experts, DeepSeek-V4's, compressed-tensors' and ModelOpt's NVFP4) is
quantized by kt_ops.quantization's own mxfp4 / nvfp4 rules and stored in the checkpoint's
layout. All are symmetric: scale = amax / qmax (448, 127, 7), rounded to the stored scale's
dtype first so that the values are quantized with the scale a reader will use (E8M0 rounded
up to a power of two): kt_ops.quantization's own rules (``_quantize_matrix``, ``_safe_scale``),
here with the checkpoint's scale shapes and dtypes.

:func:`encode_like` returns only the tensors that change, by role, in their stored dtypes and
shapes. The reference for each is :func:`~kt_ops.hf.checkpoint_formats.StoredMatrix.to_float`:
the tests decode what is written and compare.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kt_ops import quantization

_E4M3_MAX = 448.0


def _rounding_dtype(scale_like: Tensor) -> torch.dtype:
    """The dtype a checkpoint's scales are rounded to (its uint8 scales are E8M0 bytes)."""
    return torch.float8_e8m0fnu if scale_like.dtype == torch.uint8 else scale_like.dtype


def _stored(scale: Tensor, scale_like: Tensor) -> Tensor:
    """Float32 scales already rounded to ``_rounding_dtype(scale_like)``, stored as ``scale_like``
    is (dtype and shape)."""
    stored = scale.to(_rounding_dtype(scale_like))
    if scale_like.dtype == torch.uint8:
        stored = stored.view(torch.uint8)
    return stored.reshape(scale_like.shape)


def _fp8(w: Tensor, scale_like: Tensor) -> dict[str, Tensor]:
    """FP8 values and scales shaped like ``scale_like``: a 128x128 block grid, one per output
    row (``[out, 1]`` / ``[out]``) or one for the tensor."""
    out, inp = w.shape
    dtype = _rounding_dtype(scale_like)
    if tuple(scale_like.shape) == quantization.fp8_scale_grid(out, inp):
        values, scale = quantization._quantize_matrix(w, "fp8", None, dtype)
        return {"value": values, "value_scale": _stored(scale, scale_like)}
    if scale_like.numel() == out and out > 1 or tuple(scale_like.shape) in ((out, 1), (out,)):
        scale = quantization._safe_scale(w.abs().amax(dim=1), "fp8", dtype)
        full = scale.reshape(out, 1)
    elif scale_like.numel() == 1:
        scale = quantization._safe_scale(w.abs().amax().reshape(1), "fp8", dtype)
        full = scale.reshape(1, 1)
    else:
        raise ValueError(f"FP8 scales of shape {tuple(scale_like.shape)} for a [{out}, {inp}] weight")
    values = (w / full).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return {"value": values, "value_scale": _stored(scale, scale_like)}


def _int8(w: Tensor, scale_like: Tensor) -> dict[str, Tensor]:
    """INT8 values with one scale per output row, or one for the tensor, shaped like ``scale_like``."""
    dtype = _rounding_dtype(scale_like)
    if scale_like.numel() != 1:
        values, scale = quantization._quantize_matrix(w, "int8", None, dtype)
    else:
        scale = quantization._safe_scale(w.abs().amax().reshape(1), "int8", dtype)
        values = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return {"value": values, "value_scale": _stored(scale, scale_like)}


def _int4_codes(w: Tensor, groups: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(the 4-bit codes q + 8 of ``w [out, in]`` as kt's bytes ``[out, in/2]`` (column 2j in the
    low nibble of byte j), the scales ``[out, groups]`` in ``scale_dtype``)."""
    codes, scale = quantization._quantize_matrix(w, "int4", w.shape[1] // groups, scale_dtype)
    return codes.contiguous(), scale.to(scale_dtype)


def _compressed_int4(w: Tensor, scale_like: Tensor) -> dict[str, Tensor]:
    """compressed-tensors' pack-quantized INT4: ``weight_packed`` int32 ``[out, in/8]`` whose
    little-endian bytes are kt's int4 bytes, ``weight_scale [out, in/g]``."""
    codes, scale = _int4_codes(w, scale_like.shape[1], scale_like.dtype)
    return {"packed": codes.view(torch.int32), "group_scale": scale}


def _gptq(w: Tensor, scales_like: Tensor) -> dict[str, Tensor]:
    """GPTQ's INT4: ``qweight`` int32 ``[in/8, out]`` (eight input rows of one output column per
    word, row 8k + j at bits 4j: kt's bytes of a row, transposed by 4-byte words),
    ``scales [in/g, out]``."""
    out, inp = w.shape
    codes, scale = _int4_codes(w, scales_like.shape[0], scales_like.dtype)
    words = inp // 8
    qweight = codes.reshape(out, words, 4).transpose(0, 1).contiguous().view(torch.int32).reshape(words, out)
    return {"qweight": qweight, "gptq_scales": scale.t().contiguous()}


def _mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """kt's mxfp4 of ``w [out, in]``: (bytes [out, in/2], E8M0 scale bytes [out, in/32] uint8)."""
    data, scale = quantization._quantize_mxfp4(w)
    return data, scale.view(torch.uint8)


def _gpt_oss_mxfp4(w: Tensor) -> dict[str, Tensor]:
    """gpt-oss's fused MXFP4 experts (``w [E, out, in]``): ``_blocks [E, out, in/32, 16]``
    (kt's bytes, 16 per block of 32 columns) and ``_scales [E, out, in/32]`` uint8, one
    expert at a time."""
    E, out, inp = w.shape
    blocks = torch.empty(E, out, inp // 32, 16, dtype=torch.uint8)
    scales = torch.empty(E, out, inp // 32, dtype=torch.uint8)
    for e in range(E):
        data, scale = _mxfp4(w[e])
        blocks[e], scales[e] = data.reshape(out, inp // 32, 16), scale
    return {"mx_blocks": blocks, "mx_scales": scales}


def _nvfp4(w: Tensor, parts: dict[str, Tensor]) -> dict[str, Tensor]:
    """NVFP4 with a new global scale (amax / (448 * 6)) stored as the checkpoint stores it:
    ModelOpt's ``weight_scale_2`` (the multiplier) or compressed-tensors' ``weight_global_scale``
    (its reciprocal: the values are quantized under the reciprocal of what is stored, which is
    what a reader multiplies by)."""
    amax = w.abs().amax()
    multiplier = amax / (quantization.E4M3_MAX * 6.0) if amax > 0 else torch.ones(())
    if "global_scale_inv" in parts:
        stored = torch.reciprocal(multiplier.float()).reshape(parts["global_scale_inv"].shape)
        data, scale, _ = quantization._quantize_nvfp4(w, torch.reciprocal(stored.reshape(())))
        new = {"global_scale_inv": stored}
    else:
        stored = multiplier.float().reshape(parts["global_scale"].shape)
        data, scale, _ = quantization._quantize_nvfp4(w, stored.reshape(()))
        new = {"global_scale": stored}
    values_role = "fp4_packed" if "fp4_packed" in parts else "value"
    return {values_role: data, "fp4_scale": scale, **new}


def check_writable(parts: dict, name: str) -> None:
    """ValueError naming the weight for a stored form :func:`encode_like` does not write: at
    planning time, before anything is written."""
    roles = set(parts)
    if (roles <= {"value", "value_scale"} or roles & {"qweight", "packed", "mx_blocks", "fp4_scale"}):
        return
    raise ValueError(f"merge: {name} is stored as {sorted(roles)}; a merge writes float, FP8, INT8, INT4 and FP4 "
                     "weights in their own format")


def encode_like(parts: dict[str, Tensor], merged: Tensor, name: str) -> dict[str, Tensor]:
    """``merged`` (float32, the weight's logical shape) stored as ``parts`` (the weight's
    stored tensors by role, see :meth:`CheckpointQuantization.split_role`) are: the tensors
    that change, by role, each in its stored dtype and shape. ValueError naming the weight
    for a stored form a merge does not write (FP4)."""
    if "qweight" in parts:
        return _gptq(merged, parts["gptq_scales"])
    if "packed" in parts:
        return _compressed_int4(merged, parts["group_scale"])
    if "mx_blocks" in parts:
        return _gpt_oss_mxfp4(merged)
    if "fp4_scale" in parts:
        return _nvfp4(merged, parts)
    check_writable(parts, name)
    value = parts["value"]
    if value.dtype == torch.float8_e4m3fn:
        return _fp8(merged, parts["value_scale"])
    if value.dtype == torch.int8 and value.shape == merged.shape:
        return _int8(merged, parts["value_scale"])
    if value.dtype == torch.int8 and parts["value_scale"].dtype in (torch.uint8, torch.float8_e8m0fnu):
        data, scale = _mxfp4(merged)  # DeepSeek-V4's FP4 experts: E2M1 pairs in int8, E8M0 scales
        return {"value": data.view(torch.int8), "value_scale": scale.view(parts["value_scale"].dtype)}
    if value.dtype.is_floating_point and "value_scale" not in parts:
        return {"value": merged.to(value.dtype)}
    raise ValueError(f"merge: {name} is stored as {value.dtype} {tuple(value.shape)} with {sorted(parts)}; a merge "
                     "writes float, FP8, INT8, INT4 and FP4 weights in their own format")


# ---------------------------------------------------------------------------------------------
# Writing a weight in another format than the base's (output_format "bf16", "fp8", "int8", "int4")

CONVERSIONS = ("bf16", "fp8", "int8", "int4")


def _prefix(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def converted_layout(kind: str, name: str, shape: tuple, group_size: int) -> list[tuple[str, str, tuple]]:
    """``[(key, safetensors dtype, shape)]`` of the tensors weight ``name`` (logical ``shape``
    ``[out, in]``) is written as in ``kind``: bf16 ``X.weight``; FP8 as DeepSeek-V3 stores it
    (``X.weight`` float8_e4m3fn, ``X.weight_scale_inv`` float32 per 128x128 block, which
    transformers' FP8 loader reads); INT8 and INT4 as compressed-tensors stores them
    (``X.weight`` int8 with ``X.weight_scale [out, 1]``; ``X.weight_packed`` int32
    ``[out, in/8]``, ``X.weight_scale`` bf16 ``[out, in/g]``, ``X.weight_shape``)."""
    out, inp = shape
    p = _prefix(name)
    if kind == "bf16":
        return [(name, "BF16", (out, inp))]
    if kind == "fp8":
        return [(name, "F8_E4M3", (out, inp)), (p + ".weight_scale_inv", "F32", quantization.fp8_scale_grid(out, inp))]
    if kind == "int8":
        return [(name, "I8", (out, inp)), (p + ".weight_scale", "F32", (out, 1))]
    if kind == "int4":
        return [(p + ".weight_packed", "I32", (out, inp // 8)), (p + ".weight_scale", "BF16", (out, inp // group_size)),
                (p + ".weight_shape", "I64", (2,))]
    raise ValueError(f"unknown output kind {kind!r}")


def encode_as(kind: str, merged: Tensor, name: str, group_size: int) -> dict[str, Tensor]:
    """``merged`` (float32 ``[out, in]``) as the tensors :func:`converted_layout` names."""
    out, inp = merged.shape
    p = _prefix(name)
    if kind == "bf16":
        return {name: merged.to(torch.bfloat16)}
    if kind == "fp8":
        t = _fp8(merged, torch.empty(quantization.fp8_scale_grid(out, inp)))
        return {name: t["value"], p + ".weight_scale_inv": t["value_scale"]}
    if kind == "int8":
        t = _int8(merged, torch.empty(out, 1))
        return {name: t["value"], p + ".weight_scale": t["value_scale"]}
    if kind == "int4":
        t = _compressed_int4(merged, torch.empty(out, inp // group_size, dtype=torch.bfloat16))
        return {p + ".weight_packed": t["packed"], p + ".weight_scale": t["group_scale"],
                p + ".weight_shape": torch.tensor([out, inp], dtype=torch.int64)}
    raise ValueError(f"unknown output kind {kind!r}")


def quantization_config(kind: str, group_size: int, not_converted: list[str]) -> dict:
    """The ``quantization_config`` of a checkpoint whose linear weights and routed experts are
    written in ``kind`` ("fp8", "int8", "int4"), the modules ``not_converted`` left float."""
    if kind == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [quantization.FP8_BLOCK] * 2, "modules_to_not_convert": not_converted}
    bits, strategy, fmt = {"int8": (8, "channel", "int-quantized"), "int4": (4, "group", "pack-quantized")}[kind]
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": group_size if kind == "int4" else None, "block_structure": None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": fmt}},
            "ignore": not_converted, "kv_cache_scheme": None}
