"""kt.moe on quantized frozen experts (fp8 blocks, int8 channels, int4 groups; formats in
kt_ops.quantization): quantize/dequantize round trips, the dequantization and decode GEMV
kernels of every instruction-set path against the reference loop and float64, the op's
output and gradients against the float64 reference on the dequantized weights for every
format, dtype, mode and path, bad input, and opcheck."""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kt_ops
from kt_ops import quantization
from kt_ops.cpu_isa import ISAS, supported_cpu_isas
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference
from quantized_samples import (BASE, FORMAT_IDS, FORMATS, SCALES, dequantized_inputs, quantized_inputs,
                               rounding_bound)

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


def isa_param(isa):
    marks = [] if isa in supported_cpu_isas() else [pytest.mark.skip(reason=f"this CPU cannot run {isa}")]
    return pytest.param(isa, marks=marks, id=isa)


ALL_ISAS = [isa_param(isa) for isa in ISAS]


def randn(*shape, seed, dtype=f32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64).to(dtype)


# ---- quantize / dequantize --------------------------------------------------------------------

@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale_dtype", [f32, bf16], ids=["fp32-scales", "bf16-scales"])
def test_round_trip_within_the_formats_rounding_bound(fmt, group, scale_dtype):
    """|w - dequantize(quantize(w))| stays within half a quantization step (int) or half an
    fp8 ulp (3 mantissa bits) of each element; shapes cross fp8 blocks and int4 groups."""
    w = randn(3, 200, 384, seed=1) * torch.logspace(-3, 1, 384)  # columns of very different size
    data, scale = quantization.quantize(w, fmt, group, scale_dtype=scale_dtype)
    assert data.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}[fmt]
    assert scale.dtype == scale_dtype
    back = quantization.dequantize(data, scale)
    assert back.shape == w.shape and back.dtype == f32
    err = (back.double() - w.double()).abs()
    s = scale.double()
    if fmt == "fp8":
        step = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :384]
        bound = torch.maximum(w.double().abs() * 2.0 ** -4, step * 2.0 ** -10)  # normal / subnormal half ulp
    elif fmt == "int8":
        bound = s[:, :, None].expand_as(err) * 0.5
    else:
        bound = s.repeat_interleave(group, 2) * 0.5
    # A bf16 scale rounded below amax / qmax clamps the largest values by at most qmax·2^-8
    # steps, still within the bound.
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max().item()


@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_rejects_non_finite_weights(fmt, group, bad):
    w = randn(2, 8, 128, seed=2)
    w[1, 3, 5] = bad
    with pytest.raises(ValueError, match=r"gate_proj has NaN or inf values \(expert 1\)"):
        quantization.quantize(w, fmt, group, name="gate_proj")


@pytest.mark.parametrize("kwargs,match", [
    (dict(expert_format="int5"), "expert_format must be None or one of"),
    (dict(expert_format="int4", group_size=48), "group_size must be one of"),
    (dict(expert_format="int8", group_size=32), "group_size is for expert_format='int4' only"),
])
def test_format_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantization.quantize(randn(1, 4, 128, seed=0), **kwargs)


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="not a multiple of group_size=64"):
        quantization.quantize(randn(1, 4, 96, seed=0), "int4", 64)


def test_all_zero_blocks_get_scale_one():
    data, scale = quantization.quantize(torch.zeros(1, 130, 140), "fp8")
    assert (scale == 1).all() and (quantization.dequantize(data, scale) == 0).all()


# ---- kernels ----------------------------------------------------------------------------------

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


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale_dtype", [f32, bf16], ids=["fp32-scales", "bf16-scales"])
def test_dequantize_kernel_equals_the_python_dequantize_on_every_byte(isa, fmt, group, scale_dtype):
    """Bit for bit, NaN codes included (fp8 0x7f / 0xff); fp8/int8 rows of 139 columns end in a
    partial vector and a partial block, and 130 rows span two fp8 block rows."""
    cols = 139 if fmt != "int4" else 2 * 128
    data, scale = raw_weight(fmt, group, 130, cols, scale_dtype, seed=3)
    got = torch.ops.kt._dequantize(data, scale, isa)
    want = python_dequantize(data, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if fmt == "fp8":
        assert got.isnan().any()  # the NaN codes were decoded as NaN


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale_dtype", [f32, bf16], ids=["fp32-scales", "bf16-scales"])
def test_dequantize_kernel_to_bf16_and_column_blocks(isa, fmt, group, scale_dtype):
    """bf16 output (the native bf16 panels) = the float32 dequantization rounded to nearest
    even, bit for bit; a block of columns [128, 256) and the tail [256, end) equal those columns
    of the whole dequantization, in both dtypes."""
    cols = 300 if fmt != "int4" else 3 * 128
    data, scale = raw_weight(fmt, group, 130, cols, scale_dtype, seed=4)
    want = python_dequantize(data, scale)
    got = torch.ops.kt._dequantize(data, scale, isa, bf16)
    torch.testing.assert_close(got, want.to(bf16), rtol=0, atol=0, equal_nan=True)
    for dtype in (f32, bf16):
        block = torch.ops.kt._dequantize(data, scale, isa, dtype, 128, 128)
        tail = torch.ops.kt._dequantize(data, scale, isa, dtype, 256)
        torch.testing.assert_close(block, want[:, 128:256].to(dtype), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(tail, want[:, 256:].to(dtype), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="col0"):
        torch.ops.kt._dequantize(data, scale, isa, f32, 64)


# Every format on 384 columns; fp8 and int8 also on 139 and 300 (int4 rows are whole groups):
# 300 = 4 x 64 + 32 + 12 columns, so the AVX-512 kernels' 64-column steps end in one 32-column
# step and a tail.
GEMV_SHAPES = [(f, g, 384) for f, g in FORMATS] + [("fp8", None, 139), ("int8", None, 139),
                                                     ("fp8", None, 300), ("int8", None, 300)]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group,cols", GEMV_SHAPES, ids=[f"{i}-cols{c}" for i, (_, _, c) in
                                                             zip(FORMAT_IDS + ["fp8", "int8"] * 2, GEMV_SHAPES)])
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_decode_gemv_matches_float64(isa, fmt, group, cols, dtype, rows):
    """The decode GEMV of each path against float64 and against the reference loop: every x
    row count the kernels specialise (and 5: two passes); 139 columns (fp8, int8) end in a
    partial 128-column block and a tail shorter than a vector step."""
    w = randn(1, 72, cols, seed=4) * 0.05
    data, scale = quantization.quantize(w, fmt, group, scale_dtype=bf16 if rows % 2 else f32)
    x = randn(rows, cols, seed=5, dtype=dtype)
    got = torch.ops.kt._quant_gemv_nt(x, data[0], scale[0], isa)
    want = x.double() @ quantization.dequantize(data, scale)[0].double().t()
    assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype]
    reference = torch.ops.kt._quant_gemv_nt(x, data[0], scale[0], "portable")
    torch.testing.assert_close(got.float(), reference.float(), rtol=1e-5 if dtype == f32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_decode_gemv_propagates_fp8_nan_codes(isa):
    """A NaN code in an fp8 weight (0x7f or 0xff: never written by quantize, possible in a
    checkpoint) makes exactly the outputs of its row NaN, as in the dequantized product."""
    data, scale = quantization.quantize(randn(1, 40, 256, seed=6) * 0.05, "fp8")
    raw = data.view(torch.uint8)
    raw[0, 7, 100] = 0x7F
    raw[0, 30, 3] = 0xFF
    x = randn(3, 256, seed=7)
    got = torch.ops.kt._quant_gemv_nt(x, data[0], scale[0], isa)
    nan_rows = got.isnan().any(0).nonzero().flatten().tolist()
    assert nan_rows == [7, 30] and got.isnan()[:, [7, 30]].all()
    want = x.double() @ quantization.dequantize(data, scale)[0].double().t()
    finite = [r for r in range(40) if r not in (7, 30)]
    assert rel_err(got[:, finite], want[:, finite]) < 1e-5


def finite_fp8_codes(rows, cols, seed):
    """Every fp8 byte value but the two NaN codes, subnormals (exponent bits 0) included."""
    raw = every_byte(rows, cols, seed)
    raw[(raw & 0x7F) == 0x7F] = 0x01  # the smallest subnormal instead of NaN
    return raw


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_decode_gemv_on_every_byte_across_fp8_bands(isa, fmt, group, rows):
    """Every byte value of each format over 300 rows (three fp8 128-row bands, each with its own
    block scales) and 512 columns, against float64 on the dequantized weights: every fp8 code
    (subnormals included) goes through the bit-pattern decode, every int4 nibble through the
    group-sum correction."""
    data, scale = raw_weight(fmt, group, 300, 512, f32, seed=11)
    if fmt == "fp8":
        data = finite_fp8_codes(300, 512, seed=11).view(torch.float8_e4m3fn)
    x = randn(rows, 512, seed=12)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa)
    want = x.double() @ python_dequantize(data, scale).double().t()
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("isa", ALL_ISAS)
# 512 columns of 128-column steps, then a last 0 / 32 / 64 / 96 columns of 32-column steps
@pytest.mark.parametrize("group,cols", [(32, 544), (32, 608), (64, 576), (128, 640)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scale_dtype", [bf16, torch.float32], ids=["bf16-scales", "fp32-scales"])
def test_decode_gemv_int4_on_bf16_activations_every_byte(isa, group, cols, rows, scale_dtype):
    """bf16 x on int4 weights (on avx512_bf16: each 128 columns' nibbles masked into bf16
    128 + q, vdpbf16ps on x reordered into its column classes mod 4, the bias taken out through
    x's sums; a last K % 128 columns looked up as bf16 q - 8 against x as it is; rows of whole
    128-column steps on AVX512-VNNI integer dot products instead): every byte value over 96
    rows, against float64 on the dequantized weights; the error is the output's one bf16
    rounding and float32 sums (on avx2 and on the VNNI kernel also the integer kernels' rounding
    of x values far below their group's largest, within its bound: test_quant_gemv_int16.py,
    test_quant_gemv_int4_vnni.py)."""
    data, scale = raw_weight("int4", group, 96, cols, scale_dtype, seed=13)
    x = randn(rows, cols, seed=14, dtype=bf16)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa)
    w = python_dequantize(data, scale)
    want = x.double() @ w.double().t()
    assert got.dtype == bf16
    atol = 1e-6 * want.abs().max().item()
    if isa == "avx2":
        atol = atol + rounding_bound(x.float(), w, group)
    elif isa == "avx512_bf16" and cols % 128 == 0:  # the VNNI kernel: x in 32-column groups
        atol = atol + rounding_bound(x.float(), w, 32)
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + atol).all()


@pytest.mark.parametrize("isa", ALL_ISAS)
# 384: three 128-column blocks of whole 64-column steps; 139 = 2 steps + 11 columns, 200 = 3 + 8
# (a block of one step and a partial one), 300 = 4 + 44
@pytest.mark.parametrize("cols", [384, 139, 200, 300])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scale_dtype", [bf16, f32], ids=["bf16-scales", "fp32-scales"])
def test_decode_gemv_fp8_on_bf16_activations_every_code(isa, cols, rows, scale_dtype):
    """bf16 x on fp8 weights (on avx512_bf16 with VBMI: each code looked up as its exact bf16
    value, vdpbf16ps on x reordered to the lookups' order, each 128-column block's sum scaled
    once): every finite code, subnormals included, over 300 rows (three 128-row bands, each with
    its own block scales), against float64 on the dequantized weights within the output's bf16
    rounding and float32 sums; NaN codes put in two rows make exactly those rows NaN."""
    data = finite_fp8_codes(300, cols, seed=15)
    data[17, cols - 1] = 0x7F  # in a row's last (partial) step
    data[260, 5] = 0xFF
    data = data.view(torch.float8_e4m3fn)
    _, scale = raw_weight("fp8", None, 300, cols, scale_dtype, seed=15)
    x = randn(rows, cols, seed=16, dtype=bf16)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa)
    w = python_dequantize(data, scale).double()
    assert got.dtype == bf16
    nan_rows = got.isnan().any(0).nonzero().flatten().tolist()
    assert nan_rows == [17, 260] and got.isnan()[:, nan_rows].all()
    finite = [r for r in range(300) if r not in nan_rows]
    want = x.double() @ w[finite].t()
    magnitude = x.double().abs() @ w[finite].abs().t()
    err = (got[:, finite].double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 2**-20 * magnitude).all(), (err / magnitude).max().item()


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
def test_decode_gemv_on_bf16_activations_propagates_inf_and_nan(isa, fmt, group):
    """An inf or NaN in bf16 x gives inf / NaN exactly where x·wᵀ on the dequantized weights
    in float64 has them (the kernels on bf16 pairs have no special case for them)."""
    data, scale = quantization.quantize(randn(1, 70, 256, seed=17) * 0.05, fmt, group)
    w = quantization.dequantize(data, scale)[0].double()
    x = randn(4, 256, seed=18, dtype=bf16)
    x[1, 9], x[2, 130], x[3, 255] = float("inf"), float("-inf"), float("nan")
    got = torch.ops.kt._quant_gemv_nt(x, data[0], scale[0], isa)
    want = x.double() @ w.t()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()].sign(), want[want.isinf()].sign().to(bf16))
    assert rel_err(got[0], want[0]) < TOLERANCE[bf16]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("flush_denormal", [False, True], ids=["daz-off", "daz-on"])
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
def test_decode_gemv_keeps_fp8_subnormals_when_denormals_are_flushed(isa, flush_denormal, dtype):
    """fp8 subnormal weights (the only values of this weight) count as themselves whether or
    not torch.set_flush_denormal (MXCSR's DAZ / FTZ, which kt_ops.finetune sets) is on: the
    fp8 GEMV on float32 x decodes them to float32 denormals and reads them with DAZ cleared for
    the call; on bf16 x (avx512_bf16) they are normal bf16 values. The caller's flush setting is
    the same afterwards."""
    raw = torch.tensor([0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x81, 0x85, 0x00], dtype=torch.uint8)
    data = raw.repeat(64, 52)[:, :512].contiguous().view(torch.float8_e4m3fn)  # [64, 512]
    scale = torch.full((1, 4), 0.5)
    x = randn(2, 512, seed=13, dtype=dtype)
    assert torch.set_flush_denormal(flush_denormal)  # supported on every x86-64 CPU
    try:
        got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa)
        # A float32 denormal times 2^30 is a normal number, zero only while DAZ is (still) on.
        assert (torch.tensor([1e-40]) * 2.0**30 == 0).item() == flush_denormal
    finally:
        torch.set_flush_denormal(False)
    want = x.double() @ python_dequantize(data, scale).double().t()
    assert want.abs().min() > 0 and rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("big", [1e6, float("inf"), float("nan")], ids=["large", "inf", "nan"])
def test_decode_gemv_fp8_bands_whose_scaled_x_would_overflow(isa, big):
    """The fp8 GEMV carries 2^120 in x · scale; a band where |x · scale| >= 2^7 (here one x
    entry of 1e6 against block scales of ~4e-4, or inf / NaN) takes the fp16-pattern path
    instead, with the same results: finite ones against float64, inf / NaN where the product
    has them."""
    w = randn(1, 260, 384, seed=14) * 0.05
    data, scale = quantization.quantize(w, "fp8")
    x = randn(3, 384, seed=15)
    x[1, 200] = big
    assert not (big * scale[0, :, 1] < 2**7).any()  # every band's x · scale leaves the fast path
    got = torch.ops.kt._quant_gemv_nt(x, data[0], scale[0], isa)
    want = x.double() @ quantization.dequantize(data, scale)[0].double().t()
    finite = want.isfinite()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert rel_err(got[finite], want[finite]) < 1e-5


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


# ---- panels in oneDNN's packed layout (avx512_bf16, bf16 activations) -------------------------

def packed_bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.onednn_bf16
@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
def test_packed_layout_is_probed_per_shape(isa):
    """oneDNN's layout of a packed [out, in] bf16 weight is found by probing (blocks of 16-64
    output rows, input pairs); shapes the kernels do not tile have none, and neither has any
    other path (no native bf16 GEMMs there)."""
    with kt_ops.use_cpu_isa(isa):
        out_block, in_block = torch.ops.kt._packed_layout(256, 2048)
        assert out_block in (16, 32, 64) and in_block % 32 == 0 and 2048 % in_block == 0
        assert torch.ops.kt._packed_layout(100, 2048) == []  # rows not a multiple of 16
        assert torch.ops.kt._packed_layout(256, 1100) == []  # columns not a multiple of 32
    with kt_ops.use_cpu_isa("avx2" if "avx2" in supported_cpu_isas() else "portable"):
        assert torch.ops.kt._packed_layout(256, 2048) == []


@pytest.mark.onednn_bf16
@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale_dtype", [f32, bf16], ids=["fp32-scales", "bf16-scales"])
def test_packed_dequantization_equals_the_reference_and_the_dequantized_weights(isa, fmt, group, scale_dtype):
    """Into oneDNN's packed layout, on every byte value (fp8 NaN codes included): the AVX512-BF16
    kernels (16x32 tiles through a transpose; row pairs interleaved for wᵀ) give the reference
    loop's bits, and oneDNN reads them back (to_dense) as the bf16-rounded dequantized weights:
    rows [64, 192) of a [256, 384] weight, and its columns [128, 384) as wᵀ's rows, which
    cross fp8 blocks and int4 groups."""
    data, scale = raw_weight(fmt, group, 256, 384, scale_dtype, seed=21)
    want = python_dequantize(data, scale).to(bf16)
    with kt_ops.use_cpu_isa(isa):
        for transposed, start, count, expect in ((False, 64, 128, want[64:192]), (True, 128, 256, want[:, 128:].t())):
            got = torch.ops.kt._dequantize_packed(data, scale, transposed, start, count, isa)
            ref = torch.ops.kt._dequantize_packed(data, scale, transposed, start, count, "portable")
            assert torch.equal(packed_bits(got), packed_bits(ref)), f"transposed={transposed}"
            torch.testing.assert_close(got, expect, rtol=0, atol=0, equal_nan=True)
    if fmt == "fp8":
        assert got.isnan().any()


def layout_order(dense, out_block, in_block):
    """A [out, in] matrix's values in the packed family's order (packed_layout.h): blocks of
    out_block rows by in_block columns, column pairs, rows side by side."""
    out, inp = dense.shape
    o = torch.arange(out).view(-1, 1)
    i = torch.arange(inp).view(1, -1)
    offset = ((o // out_block) * (inp * out_block) + (i // in_block) * (in_block * out_block)
              + ((i % in_block) // 2) * (out_block * 2) + (o % out_block) * 2 + (i % 2))
    flat = torch.empty(out * inp, dtype=dense.dtype)
    flat[offset.reshape(-1)] = dense.reshape(-1)
    assert offset.unique().numel() == out * inp  # a permutation
    return flat


@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale_dtype", [f32, bf16], ids=["fp32-scales", "bf16-scales"])
def test_packed_dequantization_kernels_on_every_layout_of_the_family(isa, fmt, group, scale_dtype):
    """The same kernels into a plain buffer in each layout the probe may find (blocks of 64, 32
    or 16 rows; all the columns or 32-128 of them), without oneDNN, so that they are checked on
    every layout and on CPUs whose oneDNN cannot pack bf16: the AVX512-BF16 kernels give the
    reference loop's bits, and those are the bf16-rounded dequantized weights in layout order."""
    data, scale = raw_weight(fmt, group, 256, 384, scale_dtype, seed=23)
    want = python_dequantize(data, scale).to(bf16)
    cases = [(False, 64, 128, want[64:192], [(64, 384), (32, 128), (16, 32), (64, 64)]),
             (True, 128, 256, want[:, 128:].t(), [(64, 256), (32, 128), (16, 32)])]
    for transposed, start, count, expect, layouts in cases:
        for out_block, in_block in layouts:
            what = f"transposed={transposed} blocks {out_block}x{in_block}"
            got = torch.ops.kt._dequantize_into_layout(data, scale, transposed, start, count, out_block, in_block, isa)
            ref = torch.ops.kt._dequantize_into_layout(data, scale, transposed, start, count, out_block, in_block,
                                                      "portable")
            assert torch.equal(packed_bits(got), packed_bits(ref)), what
            torch.testing.assert_close(got, layout_order(expect, out_block, in_block), rtol=0, atol=0,
                                       equal_nan=True, msg=what)
    if fmt == "fp8":
        assert got.isnan().any()


def test_dequantize_into_layout_refuses_blocks_that_do_not_tile():
    data, scale = raw_weight("int8", None, 64, 128, f32, seed=1)
    with pytest.raises(ValueError, match="out_block must be a multiple of 16 dividing 64 and in_block one of 32"):
        torch.ops.kt._dequantize_into_layout(data, scale, False, 0, 64, 48, 32, "portable")


@pytest.mark.onednn_bf16
@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
@pytest.mark.parametrize("fmt,group", [("fp8", None), ("int8", None), ("int4", 32), ("int4", 128)],
                         ids=["fp8", "int8", "int4-g32", "int4-g128"])
def test_packed_panels_over_several_panels(isa, fmt, group):
    """x·wᵀ, d·w and d·w + addend on a [704, 1024] weight, where the packed panels are taken:
    x·wᵀ in row panels of 384 and 320 (512 Ki values at most), d·w in two column panels of 512
    (wᵀ's rows), the addend added inside oneDNN's GEMM before its one rounding; each against
    float64 on the bf16-rounded dequantized weights."""
    with kt_ops.use_cpu_isa(isa):
        assert torch.ops.kt._packed_layout(384, 1024) and torch.ops.kt._packed_layout(320, 1024)
        assert torch.ops.kt._packed_layout(512, 704)
    with amx_enabled(False):
        check_bf16_panel_gemms(704, 1024, fmt, group, isa, seed=22)


# ---- AMX strips (amx_gemm.h; CPUs with AMX-BF16) ----------------------------------------------

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


# ---- kt.moe -----------------------------------------------------------------------------------

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


# ---- bad input ----------------------------------------------------------------------------------

def int4_inputs():
    return quantized_inputs("int4", 32, T_shape=(4,), H=64, I=32, E=3, K=2, r=2, dtype=f32, seed=14)


def drop(name):
    def mutate(kw):
        kw[name] = None
    return mutate


def replace(name, make):
    def mutate(kw):
        kw[name] = make(kw)
    return mutate


BAD = [
    ("missing-scale", drop("up_scale"), ValueError, "up_proj is quantized \\(int4, Byte\\) so up_scale must be given"),
    ("scale-for-dense", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64)), ValueError,
     "gate_scale was given but gate_proj is Float"),
    ("wrong-int4-shape", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64, dtype=torch.uint8)), ValueError,
     r"gate_proj \(int4\) must have shape \[3, 32, 32\] \(two int4 values per byte\)"),
    ("bad-group", replace("gate_scale", lambda kw: torch.ones(3, 32, 4)), ValueError,
     "gate_scale has 4 groups per row of 64 values: group_size must be 32, 64 or 128"),
    ("int-scale", replace("down_scale", lambda kw: kw["down_scale"].to(torch.int32)), TypeError,
     "down_scale must be float32 or bfloat16"),
    ("fp16-weight", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64, dtype=torch.float16)), TypeError,
     "gate_proj must have the dtype of hidden_states \\(Float\\) or be quantized"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_bad_quantized_input_raises(case, fake):
    _, mutate, exc, match = case
    kwargs = int4_inputs()
    mutate(kwargs)
    if case[0] == "scale-for-dense":
        kwargs["up_scale"] = kwargs["down_scale"] = None
        kwargs["up_proj"] = torch.zeros(3, 32, 64)
        kwargs["down_proj"] = torch.zeros(3, 64, 32)
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc, match=match):
            kt_ops.moe(**kwargs)
    else:
        with pytest.raises(exc, match=match):
            kt_ops.moe(**kwargs)


def test_fp8_scale_shape_is_checked():
    kwargs = quantized_inputs("fp8", None, T_shape=(4,), H=200, I=130, E=2, K=1, dtype=f32, seed=15)
    kwargs["gate_scale"] = torch.ones(2, 1, 2)
    with pytest.raises(ValueError, match=r"gate_scale must have shape \[E, ceil\(out/128\), ceil\(in/128\)\] = \[2, 2, 2\]"):
        kt_ops.moe(**kwargs)


@pytest.mark.parametrize("what", ["weight", "scale"])
def test_quantized_weights_cannot_require_grad(what):
    kwargs = quantized_inputs("fp8", None, T_shape=(4,), H=128, I=64, E=2, K=1, dtype=f32, seed=16)
    kwargs["gate_proj" if what == "weight" else "gate_scale"].requires_grad_(True)
    kwargs["hidden_states"].requires_grad_(True)
    with pytest.raises(ValueError, match="gate_proj is quantized .* cannot require grad"):
        kt_ops.moe(**kwargs)


def test_backward_refuses_a_quantized_weight_gradient():
    kwargs = int4_inputs()
    args = [kwargs.get(n) for n in ("hidden_states", "topk_ids", "topk_weights", *BASE, "gate_lora_a", "gate_lora_b",
                                    "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")]
    scales = [kwargs[s] for s in SCALES]
    _, act = torch.ops.kt.moe_forward(*args, kwargs["lora_scale"], True, *scales)
    mask = [True, True, False, True, False] + [True] * 6
    with pytest.raises(ValueError, match=r"output_mask\[3\] asks for the gradient of up_proj, which is quantized \(int4\)"):
        torch.ops.kt.moe_backward(torch.ones_like(args[0]), *args[:3], act, *args[3:], kwargs["lora_scale"], mask,
                                  *scales)


# ---- opcheck ------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def positional_with_scales(kwargs):
    names = ("hidden_states", "topk_ids", "topk_weights", *BASE, "gate_lora_a", "gate_lora_b", "up_lora_a",
             "up_lora_b", "down_lora_a", "down_lora_b")
    return tuple(kwargs.get(n) for n in names) + (float(kwargs.get("lora_scale", 1.0)),), tuple(kwargs[s] for s in SCALES)


@pytest.mark.parametrize("fmt,group", [("fp8", None), ("int8", None), ("int4", 32)], ids=["fp8", "int8", "int4"])
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
    utils = OPCHECK_UTILS if fmt != "fp8" else tuple(u for u in OPCHECK_UTILS if u != "test_schema")
    torch.library.opcheck(torch.ops.kt.moe, args + scales, test_utils=utils)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.kt.moe_forward, detached + (True,) + scales, test_utils=utils)
    _, act = torch.ops.kt.moe_forward(*detached, True, *scales)
    mask = [True, True, False, False, False] + [True] * 6
    grad_out = torch.randn(detached[0].shape).to(dtype)
    torch.library.opcheck(torch.ops.kt.moe_backward, (grad_out, *detached[:3], act, *detached[3:], mask) + scales,
                          test_utils=utils)
