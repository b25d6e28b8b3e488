"""AMX strips (amx_gemm.h; CPUs with AMX-BF16) on quantized frozen experts: x·wᵀ and d·w on AMX tiles
against float64 for every format and x row count, and kt.moe's LoRA forward and backward through
the AMX strips or oneDNN's panels against the float64 reference."""
import pytest
import torch

import kt_ops
from quantized_samples import FORMAT_IDS, FORMATS, quantized_inputs
from quantized_testing import AMX, AMX_SETTINGS, amx_enabled, check_against_reference, check_bf16_panel_gemms

bf16 = torch.bfloat16


AMX_ONLY = [pytest.param("avx512_bf16", marks=[] if AMX else [pytest.mark.skip(reason="this CPU has no AMX-BF16")])]


AMX_STRIP_CASES = [pytest.param(fmt, group, rows, cols, id=f"{name}-{rows}x{cols}")
                   for fmt, group, name in [("fp8", None, "fp8"), ("int8", None, "int8"), ("int4", 32, "int4-g32"),
                                            ("int4", 64, "int4-g64"), ("int4", 128, "int4-g128")]
                   for rows, cols in [(704, 1024), (96, 384), (64, 160)]
                   if group is None or cols % group == 0]


@pytest.mark.parametrize("isa", AMX_ONLY)
@pytest.mark.parametrize("fmt,group,rows,cols", AMX_STRIP_CASES)
@pytest.mark.parametrize("M", [1, 16, 17, 33, 64, 100])
def test_amx_strips_match_float64(isa, fmt, group, rows, cols, M):
    """x·wᵀ (strips of 32 weight rows) and d·w with and without an addend (chunks of 128 weight
    columns, or strips of 32 where the columns are no multiple of 128: 160 columns put fp8's
    block boundary at 128 inside the strips' walk) on AMX tiles, for x row counts that fill one
    16-row tile, part of one, an odd number of them and several pairs."""
    with kt_ops.use_cpu_isa(isa), amx_enabled(True):
        assert torch.ops.kt._quant_gemm_path(bf16) == "bf16_strips_amx"
        check_bf16_panel_gemms(rows, cols, fmt, group, isa, seed=23, M=M)


@pytest.mark.parametrize("isa", AMX_ONLY)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("amx", AMX_SETTINGS)
def test_moe_lora_on_amx_strips_and_onednn_panels(isa, fmt, group, amx):
    """kt.moe's LoRA forward and backward (gate|up x·wᵀ, down's d·w, dx = [dg | du]·[Wg; Wu] on
    two stacked weights) with bf16 activations on an AMX CPU, through either route: output and
    every gradient against float64 on the dequantized weights."""
    kwargs = quantized_inputs(fmt, group, T_shape=(48,), H=256, I=128, E=4, K=2, r=4, dtype=bf16, mode="lora",
                              seed=24)
    with kt_ops.use_cpu_isa(isa), amx_enabled(amx):
        check_against_reference(kwargs, bf16)
