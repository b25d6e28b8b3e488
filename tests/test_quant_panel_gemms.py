"""The GEMMs on dequantized panels of every instruction-set path (torch.ops.kt._quant_mm_nt /
_quant_mm_nn) on quantized frozen experts against float64, the route each path takes for each
activation dtype (float panels, oneDNN's bf16 panels, AMX strips), and avx512_bf16's plain-layout
bf16 panels over several panels."""
import pytest
import torch

import kt_ops
from kt_ops import quantization
from moe_testing import TOLERANCE, rel_err
from quantized_samples import FORMAT_IDS, FORMATS
from quantized_testing import ALL_ISAS, AMX_SETTINGS, amx_enabled, check_bf16_panel_gemms, isa_param, randn

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
def test_panel_gemms_match_float64(isa, fmt, group, dtype):
    """x·wᵀ and d·w (+ addend) over a weight of 600 rows x 384 columns: 341-row panels of
    the [600, 384] weight, so the second panel is partial."""
    w = randn(1, 600, 384, seed=6) * 0.05
    data, scale = quantization.quantize(w, fmt, group)
    deq = quantization.dequantize(data, scale)[0].double()
    x, d, add = randn(37, 384, seed=7, dtype=dtype), randn(37, 600, seed=8, dtype=dtype), randn(37, 384, seed=9, dtype=dtype)
    with kt_ops.use_cpu_isa(isa):
        nt = torch.ops.kt._quant_mm_nt(x, data[0], scale[0])
        nn_ = torch.ops.kt._quant_mm_nn(d, data[0], scale[0], add)
    assert nt.dtype == dtype and nn_.dtype == dtype
    assert rel_err(nt, x.double() @ deq.t()) < TOLERANCE[dtype]
    assert rel_err(nn_, d.double() @ deq + add.double()) < TOLERANCE[dtype]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("amx", AMX_SETTINGS)
def test_quantized_gemm_route_of_each_path(isa, amx):
    """bf16 activations on avx512_bf16 take bf16 weights: AMX strips where the CPU has AMX and
    they are on, else panels for oneDNN's bf16 GEMMs (float32 panels would run at float32 GEMM
    speed, 2-3x slower there); everything else float panels."""
    bf16_route = "bf16_strips_amx" if amx else "bf16_panels_onednn"
    with kt_ops.use_cpu_isa(isa), amx_enabled(amx):
        assert torch.ops.kt._amx_available() == amx
        assert torch.ops.kt._quant_gemm_path(bf16) == (bf16_route if isa == "avx512_bf16" else "fp32_panels_mkl")
        assert torch.ops.kt._quant_gemm_path(f32) == "fp32_panels_mkl"
        assert torch.ops.kt._quant_gemm_path(f64) == "fp64_panels_mkl"


@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
@pytest.mark.parametrize("fmt,group,cols", [("fp8", None, 1100), ("int8", None, 1100), ("int4", 32, 1024)],
                         ids=["fp8", "int8", "int4-g32"])
def test_bf16_panels_over_several_panels(isa, fmt, group, cols):
    """The plain-layout bf16 panels of avx512_bf16 (1 Mi values each), which shapes without a
    packed layout take (1500 rows: no multiple of 16), on a [1500, cols] weight: x·wᵀ in two row
    panels of 752 rows (the second partial), d·w + addend in two column panels of 640 or 512
    (fp8/int8's second ending mid-block at column 1100)."""
    with amx_enabled(False):
        check_bf16_panel_gemms(1500, cols, fmt, group, isa, seed=16)
