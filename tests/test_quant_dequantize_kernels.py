"""The dequantization kernels of every instruction-set path (torch.ops.kt._dequantize) on quantized
frozen experts: bit for bit the Python dequantization of every byte value, to float32 and to
bf16, whole or in column blocks."""
import pytest
import torch

from quantized_samples import FORMAT_IDS, FORMATS
from quantized_testing import ALL_ISAS, python_dequantize, raw_weight

f32, bf16 = torch.float32, torch.bfloat16


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
