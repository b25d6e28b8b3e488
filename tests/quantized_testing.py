"""Helpers of the quantized-expert tests (tests/test_quant_*.py and the kernel tests that import
them): the instruction-set path parameters, raw quantized weights holding every byte value, the
Python dequantization to compare kernels with, the AMX switch, and the checks shared by several
files (the bf16 panel GEMMs against float64; kt.moe against the float64 reference)."""
import contextlib

import pytest
import torch

import kt_ops
from kt_ops import quantization
from kt_ops.cpu_isa import ISAS, supported_cpu_isas
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference
from quantized_samples import dequantized_inputs

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


def isa_param(isa):
    marks = [] if isa in supported_cpu_isas() else [pytest.mark.skip(reason=f"this CPU cannot run {isa}")]
    return pytest.param(isa, marks=marks, id=isa)


ALL_ISAS = [isa_param(isa) for isa in ISAS]


def randn(*shape, seed, dtype=f32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64).to(dtype)


def every_byte(rows, cols, seed):
    """[rows, cols] uint8 covering every byte value (shuffled), so every code is decoded."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows * cols // 256 + 1)[: rows * cols]
    return codes[torch.randperm(rows * cols, generator=g)].reshape(rows, cols)


def raw_weight(fmt, group, rows, cols, scale_dtype, seed):
    """One expert's quantized weight with every byte value and random positive/negative scales."""
    stored = every_byte(rows, cols // 2 if fmt == "int4" else cols, seed)
    data = {"fp8": stored.view(torch.float8_e4m3fn), "int8": stored.view(torch.int8), "int4": stored}[fmt]
    shape = {"fp8": (-(-rows // 128), -(-cols // 128)), "int8": (rows,), "int4": (rows, cols // (group or 1))}[fmt]
    scale = (randn(*shape, seed=seed + 1) * 0.01).to(scale_dtype)
    return data, scale


def python_dequantize(data, scale):
    return quantization.dequantize(data.unsqueeze(0), scale.unsqueeze(0))[0]


def finite_fp8_codes(rows, cols, seed):
    """Every fp8 byte value but the two NaN codes, subnormals (exponent bits 0) included."""
    raw = every_byte(rows, cols, seed)
    raw[(raw & 0x7F) == 0x7F] = 0x01  # the smallest subnormal instead of NaN
    return raw


@contextlib.contextmanager
def amx_enabled(enabled):
    """The AMX strips of amx_gemm.h on or off (on by default where the CPU has AMX and oneDNN's
    cap allows it), restored afterwards."""
    before = torch.ops.kt._amx_available()
    torch.ops.kt._set_amx(enabled)
    try:
        yield
    finally:
        torch.ops.kt._set_amx(before)


AMX = torch.ops.kt._amx_supported() and "avx512_bf16" in supported_cpu_isas()  # the strips' only path
AMX_SETTINGS = [pytest.param(False, id="onednn"),
                pytest.param(True, id="amx", marks=[] if AMX else [pytest.mark.skip(reason="this CPU has no AMX-BF16")])]


def check_bf16_panel_gemms(rows, cols, fmt, group, isa, seed, M=37):
    """x·wᵀ, d·w + addend and d·w on a [rows, cols] weight with bf16 activations (M rows), each
    against float64 on the bf16-rounded dequantized weights (the weights a bf16 expert holds):
    one bf16 rounding of each output, within 2^-8 of the exact value elementwise."""
    w = randn(1, rows, cols, seed=seed) * 0.05
    data, scale = quantization.quantize(w, fmt, group)
    deq = quantization.dequantize(data, scale)[0].to(bf16).double()
    x, d = randn(M, cols, seed=seed + 1, dtype=bf16), randn(M, rows, seed=seed + 2, dtype=bf16)
    add = randn(M, cols, seed=seed + 3, dtype=bf16)
    with kt_ops.use_cpu_isa(isa):
        nt = torch.ops.kt._quant_mm_nt(x, data[0], scale[0])
        nn_ = torch.ops.kt._quant_mm_nn(d, data[0], scale[0], add)
        nn_plain = torch.ops.kt._quant_mm_nn(d, data[0], scale[0], None)
    for got, want in ((nt, x.double() @ deq.t()), (nn_, d.double() @ deq + add.double()), (nn_plain, d.double() @ deq)):
        assert got.dtype == bf16
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-3)


def check_against_reference(kwargs, dtype):
    grad_out = grad_output_for(kwargs)
    out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(dequantized_inputs(kwargs), grad_out)
    assert out.dtype == dtype
    err = rel_err(out, ref_out)
    assert err < TOLERANCE[dtype], f"output: relative error {err:.3g}"
    for name, g in grads.items():
        err = rel_err(g, ref_grads[name])
        assert err < TOLERANCE[dtype], f"d{name}: relative error {err:.3g}"
    return grads
