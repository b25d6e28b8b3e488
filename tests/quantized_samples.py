"""Inputs of kt.moe with quantized base weights, and their float64 reference on the
dequantized weights (kt_ops.quantization): shared by the quantized-expert tests."""
from typing import Dict, Optional

import torch

from kt_ops import quantization
from moe_samples import make_moe_inputs

BASE = ("gate_proj", "up_proj", "down_proj")
SCALES = ("gate_scale", "up_scale", "down_scale")
GLOBAL_SCALES = ("gate_global_scale", "up_global_scale", "down_global_scale")  # nvfp4's
# (format, group_size): every format, int4 at each group size.
FORMATS = [("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
FORMAT_IDS = [f if g is None else f"{f}-g{g}" for f, g in FORMATS]
# The 4-bit float formats (fixed groups and scale dtypes).
FP4_FORMATS = [("mxfp4", None), ("nvfp4", None)]
FP4_FORMAT_IDS = ["mxfp4", "nvfp4"]


def quantized_inputs(expert_format: str, group_size: Optional[int], *, scale_dtype=None,
                     **make_kwargs) -> Dict[str, object]:
    """make_moe_inputs(...) with gate/up/down replaced by their quantized form plus scales."""
    kwargs = make_moe_inputs(**make_kwargs)
    if expert_format in quantization.FP4_FORMATS:
        scale_dtype = None  # the format's own
    for name, scale_name, global_name in zip(BASE, SCALES, GLOBAL_SCALES):
        data, scale, *global_scale = quantization.quantize(kwargs[name].detach(), expert_format, group_size,
                                                           scale_dtype=scale_dtype, name=name)
        kwargs[name], kwargs[scale_name] = data, scale
        if global_scale:
            kwargs[global_name] = global_scale[0]
    return kwargs


def dequantized_inputs(kwargs: Dict[str, object]) -> Dict[str, object]:
    """The same call with the base weights dequantized (float32 values, in the activations'
    dtype when that is float64 so that nothing is rounded) and no scales: what the reference
    computes, after moe_testing.to_float64 upcasts it."""
    out = {k: v for k, v in kwargs.items() if k not in SCALES + GLOBAL_SCALES}
    for name, scale_name, global_name in zip(BASE, SCALES, GLOBAL_SCALES):
        if kwargs.get(scale_name) is not None:
            out[name] = quantization.dequantize(kwargs[name], kwargs[scale_name], kwargs.get(global_name)).double()
    return out


def block_float_steps(x, group):
    """The avx2 decode kernel of bf16 x on int4 / int8 weights (quant_gemv_int16.cpp) holds x as
    16-bit block floating point per group of columns: x16 = round(x / 2^e), e chosen so that the
    group's largest |x| = f · 2^(e + 15), f in [0.5, 1). The steps 2^e, [M, groups] float64 (0 for
    a zero group)."""
    M, K = x.shape
    most = x[:, : K // group * group].double().abs().reshape(M, -1, group).amax(-1)
    return torch.where(most > 0, torch.ldexp(torch.ones_like(most), torch.frexp(most)[1] - 15), 0)


def block_float_rounded(x, group):
    """x [M, K] as that kernel holds it (float64): each value rounded half to even to a multiple
    of its group's step; columns after the last whole group as they are."""
    M, K = x.shape
    cols = K // group * group
    step = block_float_steps(x, group).repeat_interleave(group, 1)
    out = x.double().clone()
    safe = torch.where(step > 0, step, 1)
    out[:, :cols] = torch.round(out[:, :cols] / safe) * safe
    return out


def rounding_bound(x, w, group):
    """Per output [M, R] of that kernel: what rounding x to its groups' steps can change, Σ over
    groups of half a step times Σ|w| over the group's columns."""
    cols = x.shape[1] // group * group
    w_sums = w[:, :cols].double().abs().reshape(w.shape[0], -1, group).sum(-1)
    return 0.5 * block_float_steps(x, group) @ w_sums.t()
