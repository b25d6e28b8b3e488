"""kt.moe on quantized frozen experts: output and gradients against the float64 reference on the
dequantized weights for every format, dtype, mode and instruction-set path; several weight panels
and partial fp8 blocks; bf16 and float32 scales alike; quantized and dense projections mixed."""
import pytest
import torch

import kt_ops
from kt_ops import quantization
from quantized_samples import FORMAT_IDS, FORMATS, FP4_FORMAT_IDS, FP4_FORMATS, SCALES, quantized_inputs
from quantized_testing import ALL_ISAS, check_against_reference

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("mode", ["inference", "lora"])
@pytest.mark.parametrize("T", [2, 48], ids=["decode", "gemm"])
def test_moe_matches_float64_on_the_dequantized_weights(isa, fmt, group, dtype, mode, T):
    """Output and every gradient (hidden states, routing weights, the six LoRA tensors) of
    kt.moe on quantized experts against float64 on the dequantized ones. T = 2: every expert
    block is decode-sized (the quantized GEMV); T = 48: GEMMs on dequantized panels."""
    kwargs = quantized_inputs(fmt, group, T_shape=(T,), H=256, I=128, E=4, K=2, r=0 if mode == "inference" else 4,
                              dtype=dtype, mode=mode, seed=10)
    with kt_ops.use_cpu_isa(isa):
        grads = check_against_reference(kwargs, dtype)
    if mode == "lora":
        assert set(grads) == {"hidden_states", "topk_weights", "gate_lora_a", "gate_lora_b", "up_lora_a",
                              "up_lora_b", "down_lora_a", "down_lora_b"}


@pytest.mark.parametrize("fmt,group", [("fp8", None), ("int8", None), ("int4", 64)], ids=["fp8", "int8", "int4-g64"])
def test_moe_with_several_weight_panels_and_partial_fp8_blocks(fmt, group):
    """H = 2112 (16.5 fp8 blocks; gate/up panels of 48 rows, down in two panels), bf16, LoRA."""
    kwargs = quantized_inputs(fmt, group, T_shape=(24,), H=2112, I=128, E=3, K=2, r=4, dtype=bf16, mode="lora",
                              seed=11)
    check_against_reference(kwargs, bf16)


@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
def test_bf16_and_fp32_scales_give_the_same_result(fmt, group):
    """The kernels read bf16 scales as they are: the same values as float32 give the same output."""
    kwargs = quantized_inputs(fmt, group, T_shape=(20,), H=256, I=128, E=4, K=2, dtype=f32, seed=12,
                              scale_dtype=bf16)
    out_bf16_scales = kt_ops.moe(**kwargs)
    for s in SCALES:
        kwargs[s] = kwargs[s].float()
    torch.testing.assert_close(kt_ops.moe(**kwargs), out_bf16_scales, rtol=0, atol=0)


def test_quantized_and_dense_projections_mix():
    """Each projection's format is its own: a dense down_proj beside quantized gate/up."""
    kwargs = quantized_inputs("int8", None, T_shape=(20,), H=128, I=64, E=4, K=2, r=4, dtype=f32, mode="lora", seed=13)
    kwargs["down_proj"] = quantization.dequantize(kwargs["down_proj"], kwargs.pop("down_scale"))
    check_against_reference({**kwargs, "down_scale": None}, f32)


@pytest.mark.parametrize("fmt,group", FORMATS + FP4_FORMATS, ids=FORMAT_IDS + FP4_FORMAT_IDS)
@pytest.mark.parametrize("T", [2, 48], ids=["decode", "gemm"])
def test_moe_with_empty_slots(fmt, group, T):
    """Empty slots (id -1, as a sharded layer's owner receives them) on quantized experts: output
    and gradients against float64 on the dequantized weights, decode GEMVs and panel GEMMs."""
    kwargs = quantized_inputs(fmt, group, T_shape=(T,), H=256, I=128, E=4, K=2, r=4, dtype=f32, mode="lora",
                              seed=11, empty_slots=True)
    assert (kwargs["topk_ids"] < 0).any()
    check_against_reference(kwargs, f32)
