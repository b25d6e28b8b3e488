"""opcheck (schema, autograd registration, fake kernels, AOTAutograd with dynamic shapes) on
kt.moe, kt.moe_forward and kt.moe_backward with quantized experts and LoRA."""
import pytest
import torch

from quantized_samples import BASE, GLOBAL_SCALES, SCALES, quantized_inputs

f32, bf16 = torch.float32, torch.bfloat16


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def positional_with_scales(kwargs):
    names = ("hidden_states", "topk_ids", "topk_weights", *BASE, "gate_lora_a", "gate_lora_b", "up_lora_a",
             "up_lora_b", "down_lora_a", "down_lora_b")
    scales = tuple(kwargs[s] for s in SCALES)
    if kwargs.get(GLOBAL_SCALES[0]) is not None:  # nvfp4: the gating and bias defaults, then the global scales
        scales += (None, "silu", None, None, None, None) + tuple(kwargs[s] for s in GLOBAL_SCALES)
    return tuple(kwargs.get(n) for n in names) + (float(kwargs.get("lora_scale", 1.0)),), scales


@pytest.mark.parametrize("fmt,group", [("fp8", None), ("int8", None), ("int4", 32), ("mxfp4", None), ("nvfp4", None)],
                         ids=["fp8", "int8", "int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
def test_opcheck(fmt, group, dtype):
    """opcheck (schema, autograd registration, fake kernels, AOTAutograd with dynamic shapes)
    on kt.moe, kt.moe_forward and kt.moe_backward with quantized experts and LoRA."""
    kwargs = quantized_inputs(fmt, group, T_shape=(6,), H=128, I=64, E=3, K=2, r=2, dtype=dtype, mode="lora", seed=17)
    args, scales = positional_with_scales(kwargs)
    # test_schema's mutation check compares every input before and after the call with
    # arithmetic that torch does not implement for float8 tensors ("mul_cpu_reduced_float" not
    # implemented for 'Float8_e4m3fn'); the schema is the same for every format and int8 / int4
    # run it.
    # The same holds for nvfp4's float8_e4m3fn scales and mxfp4's float8_e8m0fnu ones.
    utils = OPCHECK_UTILS if fmt in ("int8", "int4") else tuple(u for u in OPCHECK_UTILS if u != "test_schema")
    torch.library.opcheck(torch.ops.kt.moe, args + scales, test_utils=utils)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.kt.moe_forward, detached + (True,) + scales, test_utils=utils)
    _, act = torch.ops.kt.moe_forward(*detached, True, *scales)
    mask = [True, True, False, False, False] + [True] * 6
    grad_out = torch.randn(detached[0].shape).to(dtype)
    torch.library.opcheck(torch.ops.kt.moe_backward, (grad_out, *detached[:3], act, *detached[3:], mask) + scales,
                          test_utils=utils)
