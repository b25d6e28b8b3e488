"""The avx2 path's decode GEMV for bf16 activations on int4 / int8 weights
(csrc/kernels/quant_gemv_int16.cpp: x as 16-bit block floating point per group of columns, integer
dot products with vpmaddwd): its float32 output, before quant_gemv_nt's rounding to bf16,
against float64 on every byte value; the bound on its rounding of values far below their
group's largest; its refusals (NaN, inf, groups too small for its exponents), after which the
float kernels give the result; and that quant_gemv_nt takes it for bf16 x on the avx2 path."""
import pytest
import torch

from kt_ops.cpu_isa import supported_cpu_isas
from quantized_samples import block_float_rounded, rounding_bound
from quantized_testing import python_dequantize, randn, raw_weight

pytestmark = pytest.mark.skipif("avx2" not in supported_cpu_isas(), reason="this CPU cannot run avx2")

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64

INT8_X_GROUP = 64  # kInt8XGroup: int8 rows' exponent groups (int4: its scale groups)

# int4 groups of 32 / 64 / 128; int8 rows of whole 64-column groups, and ones ending in 11 or
# 44 columns after them (taken by the float tail loop)
CASES = [("int4", 32, 544), ("int4", 64, 576), ("int4", 128, 640),
         ("int8", None, 384), ("int8", None, 139), ("int8", None, 300)]
CASE_IDS = ["int4-g32", "int4-g64", "int4-g128", "int8-384", "int8-139", "int8-300"]


def int16_gemv(x, data, scale):
    """(the kernel's float32 output, whether it ran)"""
    return torch.ops.kt._quant_gemv_int16(x, data, scale)


def float32_slack(x, w):
    """Float32 sums over groups and the tail: a few ulps of Σ |x|·|w|."""
    return 1e-6 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("fmt,group,cols", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scale_dtype", [bf16, f32], ids=["bf16-scales", "fp32-scales"])
def test_int16_gemv_matches_float64_on_every_byte(fmt, group, cols, rows, scale_dtype):
    """Every byte value over 96 rows; x bf16 values with magnitudes in [1, 2) and signs mixed,
    so that each is an integer in its group's 16-bit block format and the products and their
    group sums are exact: the only error left is float32's over the group sums."""
    data, scale = raw_weight(fmt, group, 96, cols, scale_dtype, seed=21)
    x = randn(rows, cols, seed=22)
    x = (x.sign() * (1 + x.abs().frac())).to(bf16).float()
    out, ran = int16_gemv(x, data, scale)
    assert ran
    w = python_dequantize(data, scale)
    want = x.double() @ w.double().t()
    assert ((out.double() - want).abs() <= float32_slack(x, w)).all()


@pytest.mark.parametrize("fmt,group,cols", CASES, ids=CASE_IDS)
def test_int16_gemv_rounds_small_values_within_its_bound(fmt, group, cols):
    """x spread over 2^-24 .. 1 within each group: values more than 2^7 below their group's
    largest are rounded to its step. Every output is the float64 product of x rounded so
    (block_float_rounded) up to float32's slack, and stays within rounding_bound of the exact
    one; some outputs do differ from the exact one by more than the slack."""
    data, scale = raw_weight(fmt, group, 96, cols, f32, seed=23)
    g = torch.Generator().manual_seed(24)
    x = randn(4, cols, seed=25) * torch.ldexp(torch.ones(4, cols), torch.randint(-24, 1, (4, cols), generator=g))
    x = x.to(bf16).float()
    out, ran = int16_gemv(x, data, scale)
    assert ran
    w = python_dequantize(data, scale)
    want = x.double() @ w.double().t()
    rounded = block_float_rounded(x, group or INT8_X_GROUP) @ w.double().t()
    assert ((out.double() - rounded).abs() <= float32_slack(x, w)).all()
    err = (out.double() - want).abs()
    bound = rounding_bound(x, w, group or INT8_X_GROUP) + float32_slack(x, w)
    assert (err <= bound).all(), (err / bound).max().item()
    assert (err > float32_slack(x, w)).any()  # some outputs did take a rounding


@pytest.mark.parametrize("fmt,group,cols", CASES[:1] + CASES[3:5], ids=CASE_IDS[:1] + CASE_IDS[3:5])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e-32], ids=["nan", "inf", "tiny-group"])
def test_int16_gemv_refuses_what_it_cannot_hold_and_the_float_kernels_answer(fmt, group, cols, bad):
    """A NaN or inf in x, or a group whose largest |x| is below 2^-101 (its 2^-e would leave
    float32's normal range): the kernel refuses the call, and quant_gemv_nt's float kernels
    give the result (non-finite where the product is, the rest against float64)."""
    data, scale = raw_weight(fmt, group, 40, cols, f32, seed=26)
    x = randn(3, cols, seed=27).to(bf16)
    if bad == 1e-32:
        x[1, :64] = bad  # the whole first group tiny (int4: two groups)
    else:
        x[1, 7] = bad
    assert not int16_gemv(x.float(), data, scale)[1]
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, "avx2")
    want = x.double() @ python_dequantize(data, scale).double().t()
    finite = want.isfinite()
    # Non-finite exactly where the product is (int4's float kernel, whose stored q + 8 meets -8·Σx,
    # makes an inf row's results NaN rather than ±inf).
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=2 ** -8, atol=1e-6 * want[finite].abs().max().item())


@pytest.mark.parametrize("fmt,group,cols", CASES, ids=CASE_IDS)
def test_int16_gemv_of_zero_rows_is_zero(fmt, group, cols):
    data, scale = raw_weight(fmt, group, 16, cols, f32, seed=28)
    x = torch.zeros(2, cols)
    x[1] = randn(cols, seed=29).to(bf16).float()
    out, ran = int16_gemv(x, data, scale)
    assert ran and (out[0] == 0).all() and (out[1] != 0).all()


@pytest.mark.parametrize("fmt,group,cols", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_quant_gemv_takes_the_int16_kernel_for_bf16_x_on_avx2(fmt, group, cols, rows):
    """quant_gemv_nt on bf16 x, avx2 path: exactly the kernel's float32 output rounded to bf16
    (so its tests above are the path's); float32 x keeps the float kernels."""
    data, scale = raw_weight(fmt, group, 40, cols, bf16, seed=30)
    x = randn(rows, cols, seed=31).to(bf16)
    out, ran = int16_gemv(x.float(), data, scale)
    assert ran
    assert torch.equal(torch.ops.kt._quant_gemv_nt(x, data, scale, "avx2"), out.to(bf16))
    fp32 = torch.ops.kt._quant_gemv_nt(x.float(), data, scale, "avx2")
    assert not torch.equal(fp32, out)  # a different summation order: not this kernel
    torch.testing.assert_close(fp32, out, rtol=1e-5, atol=1e-5 * out.abs().max().item())
