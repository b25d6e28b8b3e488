"""Panels in oneDNN's packed layout (avx512_bf16, bf16 activations) for quantized frozen experts:
the layout probed per shape, the AVX512-BF16 dequantization kernels into it and into every layout
of its family against the reference loop and the dequantized weights, and the GEMMs over several
packed panels."""
import pytest
import torch

import kt_ops
from kt_ops.cpu_isa import supported_cpu_isas
from quantized_samples import FORMAT_IDS, FORMATS
from quantized_testing import amx_enabled, check_bf16_panel_gemms, isa_param, python_dequantize, raw_weight

f32, bf16 = torch.float32, torch.bfloat16


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
