"""The avx512_bf16 path's decode GEMV for bf16 activations on int4 weights through AVX512-VNNI
(csrc/kernels/quant_gemv_int4_vnni.cpp: x as 16-bit block floating point per 32 columns, vpdpwssd
on the nibbles): its float32 output, before quant_gemv_nt's rounding to bf16, against float64 on
every byte value; the bound on its rounding of values far below their group's largest; its
refusals (NaN, inf, groups too small for their exponents), after which the other kernels give
the result; and that quant_gemv_nt takes it for bf16 x on the avx512_bf16 path. Every test id
names avx512, so that CPUs without it run them on the emulated build (test_avx512_emulation.py)."""
import pytest
import torch

from kt_ops.cpu_isa import supported_cpu_isas
from quantized_samples import block_float_rounded, rounding_bound
from quantized_testing import python_dequantize, randn, raw_weight

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64

X_GROUP = 32  # kXGroup: columns per exponent of x, whatever the scale groups


def has_vnni():
    if "avx512" not in supported_cpu_isas():
        return False
    data, scale = raw_weight("int4", 32, 1, 128, f32, seed=0)
    try:
        torch.ops.kt._quant_gemv_int4_vnni(torch.zeros(1, 128, dtype=bf16), data, scale)
    except RuntimeError as e:
        if "no AVX512-VNNI" in str(e):
            return False
        raise
    return True


pytestmark = pytest.mark.skipif(not has_vnni(), reason="this CPU cannot run avx512 with AVX512-VNNI")

# groups of 32 / 64 / 128 on whole 128-column steps
CASES = [(32, 512), (64, 768), (128, 640)]
CASE_IDS = ["g32", "g64", "g128"]


def vnni_gemv(x, data, scale):
    """(the kernel's float32 output, whether it ran)"""
    return torch.ops.kt._quant_gemv_int4_vnni(x, data, scale)


def float32_slack(x, w):
    """Float32 conversions and sums over the sum lanes: a few ulps of Σ |x|·|w|."""
    return 1e-6 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("group,cols", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scale_dtype", [bf16, f32], ids=["bf16-scales", "fp32-scales"])
def test_avx512_int4_vnni_gemv_matches_float64_on_every_byte(group, cols, rows, scale_dtype):
    """Every byte value over 96 rows; x bf16 values with magnitudes in [1, 2) and signs mixed,
    so that each is an integer in its group's 16-bit block format and the products and their
    lane sums are exact: the only error left is float32's."""
    data, scale = raw_weight("int4", group, 96, cols, scale_dtype, seed=21)
    x = randn(rows, cols, seed=22)
    x = (x.sign() * (1 + x.abs().frac())).to(bf16)
    out, ran = vnni_gemv(x, data, scale)
    assert ran and out.dtype == f32
    w = python_dequantize(data, scale)
    want = x.double() @ w.double().t()
    assert ((out.double() - want).abs() <= float32_slack(x, w)).all()


@pytest.mark.parametrize("group,cols", CASES, ids=CASE_IDS)
def test_avx512_int4_vnni_gemv_rounds_small_values_within_its_bound(group, cols):
    """x spread over 2^-24 .. 1 within each group: values more than 2^7 below their 32-column
    group's largest are rounded to its step. Every output is the float64 product of x rounded so
    (block_float_rounded) up to float32's slack, and stays within rounding_bound of the exact
    one; some outputs do differ from the exact one by more than the slack."""
    data, scale = raw_weight("int4", group, 96, cols, f32, seed=23)
    g = torch.Generator().manual_seed(24)
    x = randn(4, cols, seed=25) * torch.ldexp(torch.ones(4, cols), torch.randint(-24, 1, (4, cols), generator=g))
    x = x.to(bf16)
    out, ran = vnni_gemv(x, data, scale)
    assert ran
    w = python_dequantize(data, scale)
    want = x.double() @ w.double().t()
    rounded = block_float_rounded(x.float(), X_GROUP) @ w.double().t()
    assert ((out.double() - rounded).abs() <= float32_slack(x, w)).all()
    err = (out.double() - want).abs()
    bound = rounding_bound(x.float(), w, X_GROUP) + float32_slack(x, w)
    assert (err <= bound).all(), (err / bound).max().item()
    assert (err > float32_slack(x, w)).any()  # some outputs did take a rounding


BAD = pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e-32], ids=["nan", "inf", "tiny-group"])
NEEDS_BF16_PATH = pytest.mark.skipif("avx512_bf16" not in supported_cpu_isas(), reason="this CPU cannot run avx512_bf16")


def x_with(bad):
    """An int4 weight and bf16 x [3, 512] whose row 1 holds a NaN or an inf, or whose first
    32-column group there has its largest |x| below 2^-101 (its 2^-e would leave float32's
    normal range)."""
    data, scale = raw_weight("int4", 32, 40, 512, f32, seed=26)
    x = randn(3, 512, seed=27).to(bf16)
    if bad == 1e-32:
        x[1, :32] = bad
    else:
        x[1, 7] = bad
    return x, data, scale


@BAD
def test_avx512_int4_vnni_gemv_refuses_what_it_cannot_hold(bad):
    x, data, scale = x_with(bad)
    assert not vnni_gemv(x, data, scale)[1]
    assert vnni_gemv(x[[0, 2]], data, scale)[1]  # the same x without that row: taken


@NEEDS_BF16_PATH
@BAD
def test_avx512_bf16_quant_gemv_answers_what_the_vnni_kernel_refuses(bad):
    """After the kernel's refusal, quant_gemv_nt's other kernels give the result (the bf16 one;
    the reference loop for an inf): non-finite exactly where the product is, the rest against
    float64."""
    x, data, scale = x_with(bad)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, "avx512_bf16")
    want = x.double() @ python_dequantize(data, scale).double().t()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=2 ** -8, atol=1e-6 * want[finite].abs().max().item())


def test_avx512_int4_vnni_gemv_of_zero_rows_is_zero():
    data, scale = raw_weight("int4", 32, 16, 256, f32, seed=28)
    x = torch.zeros(2, 256, dtype=bf16)
    x[1] = randn(256, seed=29).to(bf16)
    out, ran = vnni_gemv(x, data, scale)
    assert ran and (out[0] == 0).all() and (out[1] != 0).all()


def test_avx512_int4_vnni_gemv_takes_whole_128_column_steps_only():
    data, scale = raw_weight("int4", 32, 16, 544, f32, seed=28)
    with pytest.raises(RuntimeError, match="whole 128-column steps"):
        vnni_gemv(torch.zeros(1, 544, dtype=bf16), data, scale)


@NEEDS_BF16_PATH
@pytest.mark.parametrize("group,cols", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_avx512_bf16_quant_gemv_takes_the_vnni_kernel_for_bf16_x_on_int4(group, cols, rows):
    """quant_gemv_nt on bf16 x, avx512_bf16 path, int4 weights of whole 128-column steps:
    exactly the kernel's float32 output rounded to bf16 (so its tests above are the path's)."""
    data, scale = raw_weight("int4", group, 40, cols, bf16, seed=30)
    x = randn(rows, cols, seed=31).to(bf16)
    out, ran = vnni_gemv(x, data, scale)
    assert ran
    assert torch.equal(torch.ops.kt._quant_gemv_nt(x, data, scale, "avx512_bf16"), out.to(bf16))
