"""The 4-bit float formats (mxfp4, nvfp4; kt_ops.quantization): quantize with each format's own
rounding and scale rule, exact round trips on the values the formats represent, the kernels of
every instruction-set path bit for bit against the Python dequantization over every code and
scale byte, the decode GEMV and the packed panels, and kt.moe's output and gradients against
float64 on the dequantized weights (fp32 1e-5, bf16 1e-2), rows with extreme scales included."""
import pytest
import torch

import kt_ops
from kt_ops import quantization
from kt_ops.reference import moe_reference
from moe_testing import rel_err, to_float64
from quantized_samples import FP4_FORMAT_IDS, FP4_FORMATS, GLOBAL_SCALES, dequantized_inputs, quantized_inputs
from quantized_testing import ALL_ISAS, check_against_reference, every_byte, isa_param, randn

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
FP4 = pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_reference(code: int) -> float:
    """An E2M1 code's value from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5  # subnormal: 0 or 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def test_e2m1_table_is_the_format():
    assert [e2m1_reference(c) for c in range(8)] == list(E2M1)
    codes = torch.arange(16, dtype=torch.uint8)
    values = quantization.e2m1_values(codes)
    assert values.tolist() == [e2m1_reference(c) for c in range(16)]
    assert torch.signbit(values[8])  # code 8 is -0


def test_e2m1_rounding_is_to_nearest_with_ties_to_the_even_code():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e9, -0.0, -6.0, -2.6])
    got = quantization.e2m1_values(quantization.e2m1_codes(x))
    want = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -6.0, -3.0])
    assert torch.equal(got, want)
    assert torch.signbit(got[12])


def fp4_matrix_on_the_grid(fmt, rows, cols, seed):
    """``[rows, cols]`` float32 weights that the format represents exactly, with the bytes
    and scales quantize must find: random codes, each group holding a ±6 (so the group's scale
    is the one its largest magnitude gives), scales spanning the format's range (mxfp4 2^-127
    .. 2^120; nvfp4 E4M3 subnormals to 448 with one group at 448, times a power-of-two global
    scale)."""
    g = torch.Generator().manual_seed(seed)
    group = quantization.FP4_GROUP[fmt]
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    codes[:, ::group] = torch.where(torch.rand(rows, cols // group, generator=g) < 0.5, 7, 15).to(torch.uint8)
    if fmt == "mxfp4":
        scale_bytes = torch.randint(0, 248, (rows, cols // group), generator=g, dtype=torch.uint8)
        scale_bytes[0, :4] = torch.tensor([0, 1, 126, 247], dtype=torch.uint8)  # 2^-127 (subnormal), 2^-126, ...
        scale = scale_bytes.view(torch.float8_e8m0fnu)
        weight = quantization.dequantize(quantization.pack_int4(codes)[None], scale[None])[0]
        return weight, codes, scale, None
    magnitudes = torch.randint(1, 0x7F, (rows, cols // group), generator=g, dtype=torch.uint8)  # no NaN, no 0
    magnitudes[0, :3] = torch.tensor([0x01, 0x08, 0x7E], dtype=torch.uint8)  # 2^-9 (subnormal), 2^-6, 448
    scale = magnitudes.view(torch.float8_e4m3fn)
    # a power of two: quantize's global amax / (448 · 6) then gives it back exactly
    global_scale = torch.tensor([2.0 ** -7], dtype=f32)
    weight = quantization.dequantize(quantization.pack_int4(codes)[None], scale[None], global_scale)[0]
    return weight, codes, scale, global_scale


@FP4
def test_quantize_then_dequantize_is_exact_on_the_formats_values(fmt):
    """Weights the format represents come back bit for bit, and their stored bytes, scales and
    global scale are the ones they were made from (±0 and ±6 among the codes)."""
    weight, codes, scale, global_scale = fp4_matrix_on_the_grid(fmt, 24, 256, seed=1)
    data, got_scale, *got_global = quantization.quantize(weight[None], fmt)
    assert torch.equal(data[0], quantization.pack_int4(codes))
    assert torch.equal(got_scale[0].view(torch.uint8), scale.view(torch.uint8))
    if fmt == "nvfp4":
        assert torch.equal(got_global[0], global_scale)
    back = quantization.dequantize(data, got_scale, *got_global)[0]
    assert torch.equal(back, weight)
    assert (back == 0).any() and (back.abs() == back.abs().amax()).any()


def test_mxfp4_scale_is_the_ocp_rule():
    """OCP MX: 2^(floor(log2(amax)) - 2), so the block's largest magnitude lands in [4, 8)
    (6 and above saturate to 6); an all-zero block gets 2^0."""
    w = torch.zeros(1, 3, 64)
    w[0, 0, :32] = torch.linspace(-1, 1, 32) * 0.3   # amax 0.3: 2^(-2 - 2)
    w[0, 0, 5] = 7.9                                 # amax 7.9: 2^(2 - 2)
    w[0, 1, :32] = 1e-3
    data, scale = quantization.quantize(w, "mxfp4")
    exps = scale.view(torch.uint8).int()[0] - 127
    assert exps[0].tolist() == [0, 0] and exps[1].tolist() == [-12, 0] and exps[2].tolist() == [0, 0]
    assert quantization.dequantize(data, scale)[0, 0, 5] == 6.0


def test_nvfp4_scales_follow_the_format():
    """global = amax / (448 · 6); each 16 columns' E4M3 scale = its amax / 6 / global, rounded."""
    w = randn(1, 8, 64, seed=3)
    data, scale, global_scale = quantization.quantize(w, "nvfp4")
    assert torch.equal(global_scale, (w.abs().amax() / 2688).reshape(1))
    block_amax = w[0].abs().reshape(8, 4, 16).amax(-1)
    assert torch.equal(scale[0].float(), (block_amax / 6 / global_scale).to(torch.float8_e4m3fn).float())
    assert scale[0].float().amax() == 448


@FP4
def test_quantize_rounds_to_the_nearest_value_of_the_group(fmt):
    """Each weight over its group's scale goes to the nearest E2M1 value (a value above 6
    saturates to 6): no value of the grid is closer."""
    w = randn(2, 16, 128, seed=4)
    res = quantization.quantize(w, fmt)
    group = quantization.FP4_GROUP[fmt]
    scale = quantization.e8m0_values(res[1]) if fmt == "mxfp4" else res[1].float() * res[2][:, None, None]
    scaled = (w / scale.repeat_interleave(group, -1)).double()  # what quantize rounds, in float32
    values = torch.stack([quantization.e2m1_values(quantization.unpack_nibbles(d)) for d in res[0]]).double()
    grid = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=f64)
    nearest = (grid - scaled[..., None]).abs().amin(-1)
    assert ((values - scaled).abs() <= nearest).all()
    assert rel_err(quantization.dequantize(*res), w) < 0.15


@FP4
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_refuses_non_finite_weights(fmt, bad):
    w = torch.randn(2, 4, 64)
    w[1, 2, 3] = bad
    with pytest.raises(ValueError, match="down_proj has NaN or inf values \\(expert 1\\)"):
        quantization.quantize(w, fmt, name="down_proj")


def test_format_arguments_are_checked():
    with pytest.raises(ValueError, match="mxfp4 scales groups of 32 columns; group_size=16 cannot be chosen"):
        quantization.ExpertFormat.parse("mxfp4", 16)
    assert quantization.ExpertFormat.parse("nvfp4", 16).group_size == 16
    with pytest.raises(ValueError, match="a multiple of 32"):
        quantization.quantize(torch.randn(1, 4, 48), "nvfp4")
    with pytest.raises(ValueError, match="mxfp4's scales are torch.float8_e8m0fnu"):
        quantization.quantize(torch.randn(1, 4, 64), "mxfp4", scale_dtype=f32)
    with pytest.raises(ValueError, match="global_scale is given with nvfp4 data, and only then"):
        quantization.dequantize(*quantization.quantize(torch.randn(1, 4, 64), "nvfp4")[:2])
    assert quantization.ExpertFormat.parse("mxfp4").size_problem(2048, 48) is not None


@pytest.mark.parametrize("fmt,max_ratio", [("mxfp4", 0.27), ("nvfp4", 0.29)])
def test_expert_bytes_against_bf16(fmt, max_ratio):
    """Qwen3-30B-A3B's expert shape: mxfp4 17/64 of bf16's bytes, nvfp4 9/32 (plus E floats)."""
    ratio = quantization.expert_set_nbytes(128, 2048, 768, fmt) / quantization.expert_set_nbytes(128, 2048, 768)
    assert ratio <= max_ratio
    layer = kt_ops.KTMoE(256, 64, 4, 2, lora_rank=0, dtype=bf16, expert_format=fmt)
    assert layer.expert_nbytes() == quantization.expert_set_nbytes(4, 256, 64, fmt)


# ---- kernels ------------------------------------------------------------------------------------


def raw_fp4(fmt, rows, cols, seed):
    """One expert's fp4 weight with every code byte and every scale byte (mxfp4: 2^-127 .. 2^127
    and NaN; nvfp4: every E4M3 byte, negative, subnormal and NaN ones included)."""
    group = quantization.FP4_GROUP[fmt]
    data = every_byte(rows, cols // 2, seed)
    scale_bytes = every_byte(rows, cols // group, seed + 1)
    return data, scale_bytes.view(torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn)


def fp4_dequantize(data, scale):
    """The Python dequantization of one expert, nvfp4 with global scale 1 (the kernel test ops')."""
    glob = torch.ones(1) if scale.dtype == torch.float8_e4m3fn else None
    return quantization.dequantize(data[None], scale[None], glob)[0]


@pytest.mark.parametrize("isa", ALL_ISAS)
@FP4
def test_dequantize_kernel_equals_the_python_dequantize_on_every_code_and_scale(isa, fmt):
    """Bit for bit to float32 (inf where 6 · 2^127 overflows, NaN scales as NaN) and to bf16
    (rounded to nearest even), whole rows and a block of columns."""
    data, scale = raw_fp4(fmt, 130, 512, seed=5)
    want = fp4_dequantize(data, scale)
    got = torch.ops.kt._dequantize(data, scale, isa)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().any()
    # bf16: where the value is finite and not a float32 denormal (vcvtneps2bf16 flushes those)
    plain = want.isfinite() & ((want.abs() >= torch.finfo(f32).tiny) | (want == 0))
    got16 = torch.ops.kt._dequantize(data, scale, isa, bf16)
    torch.testing.assert_close(got16[plain], want[plain].to(bf16), rtol=0, atol=0)
    block = torch.ops.kt._dequantize(data, scale, isa, f32, 128, 256)
    torch.testing.assert_close(block, want[:, 128:384], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("isa", [isa_param("avx512_bf16")])
@FP4
def test_packed_dequantization_equals_the_reference(isa, fmt):
    """The AMX / native-bf16 panels of fp4 weights in each layout: the reference loop's bits."""
    data, scale = raw_fp4(fmt, 256, 384, seed=6)
    # finite values, and no float32 denormal ones (vcvtne2ps2bf16 flushes those, as for every
    # format: mxfp4 scale bytes 64 .. 190 are 2^-63 .. 2^63)
    limits = (64, 190) if fmt == "mxfp4" else (0, 0x70)
    scale = scale.view(torch.uint8).clamp(*limits).view(scale.dtype)
    for transposed, start, count in [(False, 64, 128), (True, 128, 256), (True, 256, 32)]:
        for out_block, in_block in [(64, 384 if not transposed else 256), (32, 128), (16, 32)]:
            if transposed and count == 32 and out_block > 32:
                continue
            args = (data, scale, transposed, start, count, out_block, in_block)
            got = torch.ops.kt._dequantize_into_layout(*args, isa)
            ref = torch.ops.kt._dequantize_into_layout(*args, "portable")
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (transposed, start, out_block, in_block)


@pytest.mark.parametrize("isa", ALL_ISAS)
@FP4
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
def test_decode_gemv_against_float64(isa, fmt, rows, dtype):
    data, scale = raw_fp4(fmt, 200, 512, seed=7)
    scale = scale.view(torch.uint8).clamp(min=100, max=140).view(scale.dtype)  # finite, moderate
    if fmt == "nvfp4":
        scale = scale.view(torch.uint8).clamp(max=0x70).view(scale.dtype)
    x = randn(rows, 512, seed=8).to(dtype)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa)
    want = x.double() @ fp4_dequantize(data, scale).double().t()
    assert rel_err(got, want) < (1e-5 if dtype == f32 else 1e-2)


@pytest.mark.parametrize("isa", ALL_ISAS)
@FP4
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
def test_decode_gemv_on_every_scale_byte(isa, fmt, dtype):
    """Every scale byte (mxfp4's 2^-127 and NaN, up to 2^73, beyond which float32 sums overflow
    in an order-dependent way; nvfp4's subnormal, negative and NaN E4M3 ones): outputs where the
    float64 product is finite match it, and NaN outputs are where it has them (the kernels
    decode scales 16 at a time)."""
    data, scale = raw_fp4(fmt, 160, 512, seed=9)
    if fmt == "mxfp4":
        raw = scale.view(torch.uint8)
        scale = torch.where((raw > 200) & (raw < 255), raw - 60, raw).view(scale.dtype)
    x = randn(3, 512, seed=10).to(dtype)
    got = torch.ops.kt._quant_gemv_nt(x, data, scale, isa).double()
    want = x.double() @ fp4_dequantize(data, scale).double().t()
    finite = want.isfinite()
    assert finite.float().mean() > 0.3 and (~finite).any()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[want.isinf()], want[want.isinf()])
    assert rel_err(got[finite], want[finite]) < (1e-5 if dtype == f32 else 1e-2)


# ---- kt.moe -------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("fmt,group", FP4_FORMATS, ids=FP4_FORMAT_IDS)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [2, 48], ids=["decode", "gemm"])
def test_moe_matches_float64_on_the_dequantized_weights(isa, fmt, group, dtype, T):
    """Output and every gradient (hidden states, routing weights, the six LoRA tensors) against
    float64 on the dequantized weights, the nvfp4 global scales included."""
    kwargs = quantized_inputs(fmt, group, T_shape=(T,), H=256, I=128, E=4, K=2, r=4, dtype=dtype, mode="lora", seed=10)
    assert (kwargs.get("gate_global_scale") is not None) == (fmt == "nvfp4")
    with kt_ops.use_cpu_isa(isa):
        grads = check_against_reference(kwargs, dtype)
    assert set(grads) == {"hidden_states", "topk_weights", "gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b",
                          "down_lora_a", "down_lora_b"}


def extreme_scale_inputs(fmt, dtype, T, seed):
    """kt.moe inputs (K = 1, no LoRA) whose experts sit at the ends of the format's scale range:
    expert 0's gate and up scales the smallest (mxfp4 2^-127 .. 2^-125, float32 denormal
    weights, its tokens' hidden states times 2^100 to keep its output normal; nvfp4 E4M3
    subnormals), expert 1's down scales the largest that keep float32 finite (mxfp4 2^93 ..
    2^95; nvfp4 384 .. 448), expert 2 ordinary."""
    kwargs = quantized_inputs(fmt, None, T_shape=(T,), H=256, I=128, E=3, K=1, r=0, dtype=dtype, mode="inference",
                              seed=seed)
    ids = (torch.arange(T) % 3).reshape(T, 1)
    kwargs["topk_ids"] = ids
    small, large = ((0, 3), (220, 223)) if fmt == "mxfp4" else ((1, 8), (0x7C, 0x7F))
    for scale_name, expert, (lo, hi) in (("gate_scale", 0, small), ("up_scale", 0, small),
                                         ("down_scale", 1, large)):
        raw = kwargs[scale_name].view(torch.uint8).clone()
        raw[expert] = torch.randint(lo, hi, raw[expert].shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed + expert))
        kwargs[scale_name] = raw.view(kwargs[scale_name].dtype)
    if fmt == "mxfp4":
        x = kwargs["hidden_states"].detach().clone()
        x[ids[:, 0] == 0] *= 2.0 ** 100
        kwargs["hidden_states"] = x
    return kwargs


@pytest.mark.parametrize("isa", ALL_ISAS)
@FP4
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [6, 96], ids=["decode", "gemm"])
def test_moe_on_experts_at_the_scale_extremes(isa, fmt, dtype, T):
    """Each token's output (one expert per token) against float64 on the dequantized weights,
    per token, so that the tiny-scale expert's tokens are checked on their own scale."""
    kwargs = extreme_scale_inputs(fmt, dtype, T, seed=10)
    dequantized = dequantized_inputs(kwargs)
    if isa == "avx512_bf16" and dtype == bf16 and T > 16:
        # The native bf16 panels round through vcvtneps2bf16, which flushes float32 denormal
        # weights (|w| < 2^-126) to zero, as for every format (docs/kernels.md).
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = dequantized[name]
            dequantized[name] = torch.where(w.abs() < torch.finfo(f32).tiny, 0, w)
    with kt_ops.use_cpu_isa(isa), torch.no_grad():
        out = kt_ops.moe(**kwargs)
        ref = moe_reference(**to_float64(dequantized))
    tol = 1e-5 if dtype == f32 else 1e-2
    for t in range(T):
        assert ref[t].abs().amax() > 0, t
        assert rel_err(out[t], ref[t]) < tol, (t, rel_err(out[t], ref[t]))


def test_moe_refuses_bad_fp4_inputs():
    kwargs = quantized_inputs("nvfp4", None, T_shape=(4,), H=64, I=32, E=3, K=2, r=2, dtype=f32, seed=11)
    with pytest.raises(ValueError, match="up_proj is nvfp4 .* so up_global_scale must be given"):
        kt_ops.moe(**{**kwargs, "up_global_scale": None})
    with pytest.raises(ValueError, match=r"down_global_scale must have shape \[E\] = \[3\]"):
        kt_ops.moe(**{**kwargs, "down_global_scale": torch.ones(2)})
    with pytest.raises(TypeError, match="gate_global_scale must be float32"):
        kt_ops.moe(**{**kwargs, "gate_global_scale": kwargs["gate_global_scale"].double()})
    with pytest.raises(ValueError, match=r"gate_scale \(nvfp4\) must have shape \[E, out, in / 16\]"):
        kt_ops.moe(**{**kwargs, "gate_scale": kwargs["gate_scale"][:, :, :2]})
    mx = quantized_inputs("mxfp4", None, T_shape=(4,), H=64, I=32, E=3, K=2, r=2, dtype=f32, seed=11)
    with pytest.raises(ValueError, match="gate_global_scale was given but gate_proj is mxfp4"):
        kt_ops.moe(**{**mx, "gate_global_scale": torch.ones(3)})
    odd = quantized_inputs("mxfp4", None, T_shape=(4,), H=64, I=64, E=3, K=2, r=0, dtype=f32, mode="inference",
                           seed=11)
    for name, (out, inp) in (("gate", (48, 64)), ("up", (48, 64)), ("down", (64, 48))):
        odd[f"{name}_proj"] = torch.zeros(3, out, inp // 2, dtype=torch.uint8)
        odd[f"{name}_scale"] = torch.zeros(3, out, max(inp // 32, 1), dtype=torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="down_proj is mxfp4: its input size must be a multiple of 32, got 48"):
        kt_ops.moe(**odd)
