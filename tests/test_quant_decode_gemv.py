"""The decode GEMV of every instruction-set path (torch.ops.kt._quant_gemv_nt) on quantized frozen
experts, against float64 on the dequantized weights and against the reference loop: every row
count the kernels specialise, every byte value, bf16 activations, NaN / inf codes and inputs,
fp8 subnormals under flushed denormals, and fp8 bands whose scaled x would overflow."""
import pytest
import torch

from kt_ops import quantization
from moe_testing import TOLERANCE, rel_err
from quantized_samples import FORMAT_IDS, FORMATS, rounding_bound
from quantized_testing import ALL_ISAS, finite_fp8_codes, python_dequantize, randn, raw_weight

f32, bf16 = torch.float32, torch.bfloat16


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
