"""The format code of quantized frozen experts (fp8 blocks, int8 channels, int4 groups; formats in
kt_ops.quantization): quantize/dequantize round trips within each format's rounding bound, and
quantize's checks of its weights and format arguments."""
import pytest
import torch

from kt_ops import quantization
from quantized_samples import FORMAT_IDS, FORMATS
from quantized_testing import randn

f32, bf16 = torch.float32, torch.bfloat16


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


def test_expert_format_parses_once_and_passes_down_as_is():
    """One parse with one message per mistake; a parsed value parses to itself, so the entry
    points hand it down (from_pretrained -> patch_model -> KTMoE) without checking it again."""
    ExpertFormat = quantization.ExpertFormat
    assert ExpertFormat.parse(None) == ExpertFormat(None, None) and not ExpertFormat.parse(None).quantized
    assert ExpertFormat.parse("fp8") == ExpertFormat("fp8", None)
    assert ExpertFormat.parse("int4") == ExpertFormat("int4", 32)
    assert ExpertFormat.parse("int4", default_group_size=128) == ExpertFormat("int4", 128)  # a checkpoint's own
    parsed = ExpertFormat.parse("int4", 64, "patch_model")
    assert ExpertFormat.parse(parsed, where="KTMoE") is parsed and ExpertFormat.parse(parsed, 64) is parsed
    with pytest.raises(ValueError, match=r"KTMoE: group_size=32 given beside expert_format='int4' \(group_size=64\)"):
        ExpertFormat.parse(parsed, 32, "KTMoE")
    for bad, match in ((("int5",), "where: expert_format must be None or one of"),
                       (("int4", 48), "where: group_size must be one of"),
                       (("int8", 32), "where: group_size is for expert_format='int4' only")):
        with pytest.raises(ValueError, match=match):
            ExpertFormat.parse(*bad, where="where")
    assert parsed.size_problem(128, 64) is None
    assert "int4 groups of 64 must divide hidden size 128 and intermediate size 96" in parsed.size_problem(128, 96)
    assert ExpertFormat.parse("fp8").size_problem(100, 7) is None
    with pytest.raises(ValueError, match=r"x: train_base=True cannot train quantized experts \(expert_format='fp8'\)"):
        ExpertFormat.parse("fp8").check_trainable(True, "x")
    ExpertFormat.parse(None).check_trainable(True, "x")  # float experts may train
