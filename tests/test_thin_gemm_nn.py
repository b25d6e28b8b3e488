"""thin_gemm_nn (csrc/kernels/thin_gemm_nn.h): backward's decode-sized input gradients d·w (+ addend)
streamed over bf16 or quantized weights. The AVX2 kernel and the reference loop against float64
on every byte value of each format (fp8 NaN codes and subnormals too), and that kt.moe's
backward routes blocks of at most 4 rows through it on the avx2 path and keeps the panel GEMMs
elsewhere."""
import pytest
import torch

from kt_ops.cpu_isa import supported_cpu_isas, use_cpu_isa
from kt_ops import quantization
from quantized_testing import every_byte, finite_fp8_codes, isa_param, python_dequantize, randn, raw_weight

f32, bf16 = torch.float32, torch.bfloat16
PATHS = [isa_param("portable"), isa_param("avx2")]  # the reference loop; the AVX2 kernel
# (format, group): bf16 dense weights, then every quantized format
WEIGHTS = [(None, None), ("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("mxfp4", 32),
           ("nvfp4", 16)]
WEIGHT_IDS = ["bf16", "fp8", "int8", "int4-g32", "int4-g64", "int4-g128", "mxfp4", "nvfp4"]


def fp4_weight(fmt, group, rows, cols, seed):
    """Every code byte, finite scale bytes (mxfp4 2^-27 .. 2^13; nvfp4 E4M3 up to 2^-1), and the
    Python dequantization (nvfp4's global scale 1, as the kernel test ops take it)."""
    data = every_byte(rows, cols // 2, seed)
    raw = every_byte(rows, cols // group, seed + 1)
    if fmt == "mxfp4":
        scale = (raw % 41 + 100).view(torch.float8_e8m0fnu)
        return data, scale, quantization.dequantize(data[None], scale[None])[0]
    scale = (raw % 0x70).view(torch.float8_e4m3fn)
    return data, scale, quantization.dequantize(data[None], scale[None], torch.ones(1))[0]


def weight(fmt, group, rows, cols, scale_dtype, seed):
    """(data, scale or None, the float64 values): every byte value of the format (fp8 without its
    NaN codes), or random bf16."""
    if fmt is None:
        data = (randn(rows, cols, seed=seed) * 0.05).to(bf16)
        return data, None, data.double()
    if fmt in ("mxfp4", "nvfp4"):
        data, scale, values = fp4_weight(fmt, group, rows, cols, seed)
        return data, scale, values.double()
    data, scale = raw_weight(fmt, group, rows, cols, scale_dtype, seed)
    if fmt == "fp8":
        data = finite_fp8_codes(rows, cols, seed).view(torch.float8_e4m3fn)
    return data, scale, python_dequantize(data, scale).double()


def shape_of(fmt, group):
    # 300 rows: three fp8 128-row bands and passes that end in a single row; 139 columns end in
    # a partial fp8 block and a tail shorter than a 16-column step. int4: whole groups.
    return (300, 139) if fmt in (None, "fp8", "int8") else (130, 4 * group)


def check_against_float64(got, want, abs_terms, dtype):
    """Each output within float32's accumulation of its terms; bf16 outputs also within their
    one rounding."""
    bound = 1e-5 * abs_terms + (2 ** -8 * want.abs() if dtype == bf16 else 0)
    assert got.dtype == dtype
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max()


# Dense weights come in the activations' dtype: bf16 d only for them.
CASES = [(f, g, dt) for (f, g) in WEIGHTS for dt in (f32, bf16) if f is not None or dt == bf16]
CASE_IDS = [f"{i}-{'fp32' if dt == f32 else 'bf16'}" for i, (f, g) in zip(WEIGHT_IDS, WEIGHTS)
            for dt in (f32, bf16) if f is not None or dt == bf16]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt,group,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("with_addend", [False, True], ids=["", "addend"])
def test_matches_float64_on_every_byte(isa, fmt, group, dtype, rows, with_addend):
    N, K = shape_of(fmt, group)
    data, scale, w = weight(fmt, group, N, K, bf16 if rows % 2 else f32, seed=40 + rows)
    d = randn(rows, N, seed=41, dtype=dtype)
    addend = randn(rows, K, seed=42, dtype=dtype) if with_addend else None
    got = torch.ops.kt._thin_gemm_nn(d, data, scale, isa, addend)
    want = d.double() @ w
    abs_terms = d.double().abs() @ w.abs()
    if with_addend:
        want, abs_terms = want + addend.double(), abs_terms + addend.double().abs()
    check_against_float64(got, want, abs_terms, dtype)
    if isa != "portable":  # the kernel against the reference loop: the same sums, other roundings
        reference = torch.ops.kt._thin_gemm_nn(d, data, scale, "portable", addend)
        torch.testing.assert_close(got.float(), reference.float(), rtol=1e-5 if dtype == f32 else 1e-2,
                                   atol=1e-5 * abs_terms.max().item())


@pytest.mark.parametrize("isa", PATHS)
def test_fp8_nan_codes_propagate(isa):
    """A NaN code (0x7f / 0xff) makes its column NaN in every output row, as the dequantized
    product does (0 · NaN included); the other columns stay exact. Codes in the 16-column steps
    and in the tail."""
    data, scale, _ = weight("fp8", None, 40, 139, f32, seed=50)
    raw = data.view(torch.uint8)
    raw[7, 100] = 0x7F
    raw[30, 3] = 0xFF
    raw[12, 137] = 0x7F  # the tail after the last 16-column step
    d = randn(3, 40, seed=51)
    d[1, 7] = 0.0
    got = torch.ops.kt._thin_gemm_nn(d, data, scale, isa, None)
    assert got.isnan().any(0).nonzero().flatten().tolist() == [3, 100, 137] and got.isnan()[:, [3, 100, 137]].all()
    w = python_dequantize(data, scale).double()
    finite = [k for k in range(139) if k not in (3, 100, 137)]
    want = d.double() @ w[:, finite]
    check_against_float64(got[:, finite], want, d.double().abs() @ w[:, finite].abs(), f32)


@pytest.mark.parametrize("isa", PATHS)
def test_fp8_subnormals_when_denormals_are_flushed(isa):
    """fp8 subnormal codes (exponent bits 0) keep their values with MXCSR's DAZ / FTZ set
    (torch.set_flush_denormal(True), which kt_ops.finetune sets): they decode through fp16 bit
    patterns, whose float32 values are normal."""
    raw = finite_fp8_codes(64, 256, seed=52) & 0x87  # sign and mantissa only: subnormals and zeros
    data = raw.view(torch.float8_e4m3fn)
    scale = torch.full((1, 2), 3.0)
    d = randn(2, 64, seed=53)
    w = python_dequantize(data, scale).double()
    assert (w.abs().max() < 2 ** -6 * 3.0) and (w != 0).any()
    assert torch.set_flush_denormal(True)
    try:
        got = torch.ops.kt._thin_gemm_nn(d, data, scale, isa, None)
    finally:
        torch.set_flush_denormal(False)
    check_against_float64(got, d.double() @ w, d.double().abs() @ w.abs(), f32)


@pytest.mark.parametrize("fmt,group", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("with_addend", [False, True], ids=["", "addend"])
def test_backward_routes_decode_blocks_through_it_on_avx2(fmt, group, with_addend):
    """d·w as kt.moe's backward computes it (base_gemm.h): on the avx2 path blocks of 1-4 rows take
    thin_gemm_nn's kernel (bit for bit its output), 5 rows the panel GEMMs; the portable path
    keeps the panels for every block. d in float32 for quantized weights (outputs not rounded
    to bf16, so the two routes' sums differ), bf16 for bf16 weights."""
    N, K = shape_of(fmt, group)
    data, scale, _ = weight(fmt, group, N, K, f32, seed=60)
    dtype = bf16 if fmt is None else f32
    panel = (lambda d, a: torch.ops.kt._panel_mm_nn(d, data, a)) if fmt is None else \
        (lambda d, a: torch.ops.kt._quant_mm_nn(d, data, scale, a))
    for isa in [isa for isa in ("avx2", "portable") if isa in supported_cpu_isas()]:
        for rows in (1, 4, 5):
            d = randn(rows, N, seed=61 + rows, dtype=dtype)
            addend = randn(rows, K, seed=62, dtype=dtype) if with_addend else None
            with use_cpu_isa(isa):
                thin = torch.ops.kt._thin_gemm_nn_taken(d, data, scale)
                got = torch.ops.kt._base_mm_nn(d, data, scale, addend)
                want = torch.ops.kt._thin_gemm_nn(d, data, scale, "avx2", addend) if thin else panel(d, addend)
            assert thin == (isa == "avx2" and rows <= 4), (isa, rows)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{isa}, {rows} rows")
            # the routes differ: a test that could tell them apart (mxfp4's power-of-two scales
            # make every product exact, and its sums can come out the same both ways)
            if thin and fmt not in (None, "mxfp4"):
                assert not torch.equal(got, panel(d, addend))


def test_refusals():
    data, scale, _ = weight("int8", None, 32, 64, f32, seed=70)
    with pytest.raises(RuntimeError, match="at most 4 rows of d, got 5"):
        torch.ops.kt._thin_gemm_nn(randn(5, 32, seed=71), data, scale, "avx2", None)
    with pytest.raises(RuntimeError, match=r"expected d \[M, 32\]"):
        torch.ops.kt._thin_gemm_nn(randn(2, 31, seed=71), data, scale, "avx2", None)
    with pytest.raises(RuntimeError, match=r"addend must be \[2, 64\]"):
        torch.ops.kt._thin_gemm_nn(randn(2, 32, seed=71), data, scale, "avx2", randn(2, 63, seed=72))
