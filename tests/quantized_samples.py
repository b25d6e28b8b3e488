"""Inputs of kt.moe with quantized base weights, and their float64 reference on the
dequantized weights (kt_ops.quantization): shared by the quantized-expert tests."""
from typing import Dict, Optional

import torch

from kt_ops import quantization
from moe_samples import make_moe_inputs

BASE = ("gate_proj", "up_proj", "down_proj")
SCALES = ("gate_scale", "up_scale", "down_scale")
# (format, group_size): every format, int4 at each group size.
FORMATS = [("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
FORMAT_IDS = [f if g is None else f"{f}-g{g}" for f, g in FORMATS]


def quantized_inputs(expert_format: str, group_size: Optional[int], *, scale_dtype=None,
                     **make_kwargs) -> Dict[str, object]:
    """make_moe_inputs(...) with gate/up/down replaced by their quantized form plus scales."""
    kwargs = make_moe_inputs(**make_kwargs)
    for name, scale_name in zip(BASE, SCALES):
        data, scale = quantization.quantize(kwargs[name].detach(), expert_format, group_size,
                                            scale_dtype=scale_dtype, name=name)
        kwargs[name], kwargs[scale_name] = data, scale
    return kwargs


def dequantized_inputs(kwargs: Dict[str, object]) -> Dict[str, object]:
    """The same call with the base weights dequantized (float32 values, in the activations'
    dtype when that is float64 so that nothing is rounded) and no scales: what the reference
    computes, after moe_testing.to_float64 upcasts it."""
    out = {k: v for k, v in kwargs.items() if k not in SCALES}
    for name, scale_name in zip(BASE, SCALES):
        if kwargs.get(scale_name) is not None:
            out[name] = quantization.dequantize(kwargs[name], kwargs[scale_name]).double()
    return out
