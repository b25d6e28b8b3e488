"""kt.moe's gating arguments: ``swiglu_limit`` (transformers' clamped SwiGLU: DeepSeek-V4,
GLM-5-Next, HY-V4 compute ``silu(min(g, L))·clamp(u, -L, L)``), ``activation="gelu_tanh"``
(GeGLU, Gemma 4) and ``activation="swigluoai"`` with ``swiglu_alpha`` (gpt-oss's
``g·σ(α·g)·(u + 1)``: MiniMax-M3), alone and together: the output and every gradient against
the float64 reference (kt_ops.reference with the clamp) for each dtype and training mode, on
pre-activations well past the limit; gradcheck in float64; opcheck; quantized experts; KTMoE;
bad limits, activations and alphas refused by name. The kernels themselves, on every path:
tests/test_cpu_kernels.py."""
import math

import pytest
import torch

import kt_ops
from kt_ops import quantization
from moe_samples import make_moe_inputs, positional
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

ACTIVATIONS = ["silu", "gelu_tanh", "swigluoai"]
GPT_OSS_ALPHA = 1.702  # gpt-oss's and MiniMax-M3's swiglu_alpha
# Another activation whose result differs from each one's, to show that the activation matters.
OTHER_ACTIVATION = {"silu": "gelu_tanh", "gelu_tanh": "silu", "swigluoai": "silu"}


def with_activation(kwargs, activation):
    """kwargs with the activation (and, for swigluoai, gpt-oss's alpha)."""
    return dict(kwargs, activation=activation, swiglu_alpha=GPT_OSS_ALPHA if activation == "swigluoai" else None)


def clamped_case(dtype=torch.float32, mode="hybrid", r=4, seed=0, T=5, H=48, I=40, activation="silu"):
    """make_moe_inputs with larger hidden states (x3) and a swiglu_limit that many gate and up
    pre-activations pass (I = 40: SIMD steps and a tail on every path). The limit is the middle
    of the widest gap between pre-activations in [1, 2.5]: at the kinks ±limit, bf16's rounding
    of a pre-activation could flip the clamp against the float64 reference, and gradcheck's
    finite differences would straddle it."""
    kwargs = make_moe_inputs(T_shape=(T,), H=H, I=I, E=6, K=2, r=r if mode != "full" else 0, dtype=dtype,
                             mode=mode, seed=seed)
    x = kwargs["hidden_states"]
    kwargs["hidden_states"] = (x.detach() * 3).requires_grad_(x.requires_grad)
    g, u = pre_activations(kwargs)
    values = torch.cat([g.flatten(), u.abs().flatten()]).sort().values
    values = values[(values > 1.0) & (values < 2.5)]
    gaps = values[1:] - values[:-1]
    widest = int(gaps.argmax())
    assert gaps[widest] > 0.02, "no gap wide enough for the limit"  # bf16 rounds g in [1, 2.5) by < 0.008
    kwargs["swiglu_limit"] = float(values[widest] + gaps[widest] / 2)
    return with_activation(kwargs, activation)


def pre_activations(kwargs):
    """The gate and up pre-activations (base + LoRA) of every (token, slot), in float64."""
    x = kwargs["hidden_states"].detach().double()
    ids = kwargs["topk_ids"]
    s = kwargs.get("lora_scale", 1.0)

    def project(name):
        w = kwargs[f"{name}_proj"].detach().double()[ids]  # [T, K, I, H]
        out = torch.einsum("th,tkih->tki", x, w)
        if kwargs.get(f"{name}_lora_a") is not None:
            a, b = (kwargs[f"{name}_lora_{p}"].detach().double()[ids] for p in "ab")
            out = out + s * torch.einsum("tkir,tkr->tki", b, torch.einsum("th,tkrh->tkr", x, a))
        return out

    return project("gate"), project("up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("mode", ["inference", "lora", "full", "hybrid"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_clamped_moe_matches_float64_reference(dtype, mode, activation):
    kwargs = clamped_case(dtype, mode, activation=activation)
    g, u = pre_activations(kwargs)
    L = kwargs["swiglu_limit"]
    # The clamp must act on both sides for the test to mean anything.
    assert (g > L).float().mean() > 0.05 and (u > L).any() and (u < -L).any()
    dy = grad_output_for(kwargs)
    out, grads = run_op(kwargs, dy)
    ref_out, ref_grads = run_reference(kwargs, dy)
    # bf16: the clamp zeroes the gradient of every element it cut, so the gate-side gradients sum
    # fewer, smaller terms and bf16's rounding weighs more: up to 1.5% over seeds 0-2 at these
    # sizes, against 0.5-0.8% unclamped (the bounds are never crossed by rounding: see clamped_case).
    # swigluoai: 2.3% at seed 0 (plain PyTorch autograd in bf16 on the same inputs: 2.5%). The
    # gradient of an expert with one token, whose gate pre-activations move by up to 0.06 when
    # bf16 rounds the LoRA product x·Aᵀ (as PEFT's bf16 LoRA does too), and σ(1.702·g) is steeper.
    tol = (3e-2 if activation == "swigluoai" else 2e-2) if dtype == torch.bfloat16 else TOLERANCE[dtype]
    assert rel_err(out, ref_out) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= tol, name
    unclamped = dict(kwargs, swiglu_limit=None)
    assert rel_err(run_reference(unclamped, dy)[0], ref_out) > 0.05  # the clamp changes the result
    other = with_activation(kwargs, OTHER_ACTIVATION[activation])
    assert rel_err(run_reference(other, dy)[0], ref_out) > 0.05  # and so does the activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "swigluoai"])
def test_unclamped_activation_matches_float64_reference(dtype, activation):
    kwargs = dict(clamped_case(dtype, "hybrid", activation=activation), swiglu_limit=None)
    dy = grad_output_for(kwargs)
    out, grads = run_op(kwargs, dy)
    ref_out, ref_grads = run_reference(kwargs, dy)
    assert rel_err(out, ref_out) <= TOLERANCE[dtype]
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64_across_the_limit(activation):
    kwargs = clamped_case(torch.float64, "hybrid", T=4, H=16, I=12, activation=activation)
    g, u = pre_activations(kwargs)
    L = kwargs["swiglu_limit"]
    assert (g > L).any() and (u.abs() > L).any()
    names = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]

    def fn(*tensors):
        return kt_ops.moe(**dict(kwargs, **dict(zip(names, tensors))))

    assert torch.autograd.gradcheck(fn, [kwargs[n] for n in names], eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype,mode,activation", [(torch.float32, "hybrid", "gelu_tanh"),
                                                   (torch.bfloat16, "lora", "gelu_tanh"),
                                                   (torch.float32, "hybrid", "swigluoai")],
                         ids=["fp32-hybrid-gelu_tanh", "bf16-lora-gelu_tanh", "fp32-hybrid-swigluoai"])
def test_opcheck_with_gating(dtype, mode, activation):
    kwargs = clamped_case(dtype, mode, activation=activation)
    args = positional(kwargs)
    gating = (kwargs["swiglu_limit"], activation, kwargs["swiglu_alpha"])
    torch.library.opcheck(torch.ops.kt.moe, args + (None, None, None, *gating))
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.kt.moe_forward, detached + (True, None, None, None, *gating))
    _, activations = torch.ops.kt.moe_forward(*detached, True, None, None, None, *gating)
    dy = grad_output_for(kwargs)
    mask = [True] * 11 if mode == "hybrid" else [True, True, False, False, False] + [True] * 6
    torch.library.opcheck(torch.ops.kt.moe_backward,
                          (dy, *detached[:3], activations, *detached[3:], mask, None, None, None, *gating))


@pytest.mark.parametrize("fmt,group,activation", [("int8", None, "silu"), ("int4", 32, "silu"),
                                                  ("fp8", None, "swigluoai")])
def test_quantized_experts_clamped(fmt, group, activation):
    """Weight-only quantized experts with the clamp: the float64 reference on the dequantized
    weights, LoRA and hidden-state gradients included."""
    kwargs = clamped_case(torch.float32, "lora", H=64, I=64, activation=activation)
    scales = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        data, scale = quantization.quantize(kwargs[name].detach(), fmt, group, name=name)
        kwargs[name], scales[name] = data, scale
    dense = dict(kwargs, **{n: quantization.dequantize(kwargs[n], scales[n]).float() for n in scales})
    dy = grad_output_for(kwargs)
    out, grads = run_op(dict(kwargs, gate_scale=scales["gate_proj"], up_scale=scales["up_proj"],
                             down_scale=scales["down_proj"]), dy)
    ref_out, ref_grads = run_reference(dense, dy)
    assert rel_err(out, ref_out) <= 1e-5
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, name


def test_ktmoe_with_swiglu_limit_is_kt_moe_with_it():
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(32, 24, 4, 2, lora_rank=2, dtype=torch.float32, swiglu_limit=0.75)
    with torch.no_grad():
        for n in ("gate_lora_b", "up_lora_b", "down_lora_b"):
            getattr(layer, n).normal_()
    x = torch.randn(7, 32) * 3
    weights, ids = layer.gate(x)
    expected = kt_ops.moe(x, ids, weights, *layer.expert_tensors(), layer.lora_scale, swiglu_limit=0.75)
    assert rel_err(layer(x), expected) <= 1e-6
    assert rel_err(layer(x), kt_ops.moe(x, ids, weights, *layer.expert_tensors(), layer.lora_scale)) > 1e-3


def test_ktmoe_with_swigluoai_is_kt_moe_with_it():
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(32, 24, 4, 2, lora_rank=2, dtype=torch.float32, swiglu_limit=7.0,
                         activation="swigluoai", swiglu_alpha=GPT_OSS_ALPHA)
    x = torch.randn(7, 32) * 3
    weights, ids = layer.gate(x)
    gating = dict(swiglu_limit=7.0, activation="swigluoai", swiglu_alpha=GPT_OSS_ALPHA)
    expected = kt_ops.moe(x, ids, weights, *layer.expert_tensors(), layer.lora_scale, **gating)
    assert rel_err(layer(x), expected) <= 1e-6
    other_alpha = kt_ops.moe(x, ids, weights, *layer.expert_tensors(), layer.lora_scale, **dict(gating, swiglu_alpha=1.0))
    assert rel_err(layer(x), other_alpha) > 1e-3


@pytest.mark.parametrize("limit", [0.0, -1.0, math.nan], ids=["zero", "negative", "nan"])
def test_bad_swiglu_limit_is_refused(limit):
    kwargs = clamped_case(torch.float32, "inference")
    with pytest.raises(ValueError, match=r"kt.moe: swiglu_limit must be None or a number > 0"):
        kt_ops.moe(**dict(kwargs, swiglu_limit=limit))
    with pytest.raises(ValueError, match=r"KTMoE: swiglu_limit must be None or a number > 0"):
        kt_ops.KTMoE(32, 24, 4, 2, swiglu_limit=limit)


def test_unknown_activation_is_refused():
    kwargs = clamped_case(torch.float32, "inference")
    with pytest.raises(ValueError, match=r"kt.moe: activation must be 'silu' \(SwiGLU\), 'gelu_tanh'.* or "
                                         r"'swigluoai'.*got 'relu'"):
        kt_ops.moe(**dict(kwargs, activation="relu"))
    with pytest.raises(ValueError, match=r"KTMoE: activation must be 'silu', 'gelu_tanh' or 'swigluoai', got 'gelu'"):
        kt_ops.KTMoE(32, 24, 4, 2, activation="gelu")


@pytest.mark.parametrize("alpha", [None, 0.0, -1.0, math.nan, math.inf], ids=["none", "zero", "negative", "nan", "inf"])
def test_swigluoai_needs_a_finite_positive_alpha(alpha):
    kwargs = clamped_case(torch.float32, "inference")
    with pytest.raises(ValueError, match=r"kt.moe: activation='swigluoai' .* needs swiglu_alpha"):
        kt_ops.moe(**dict(kwargs, activation="swigluoai", swiglu_alpha=alpha))
    with pytest.raises(ValueError, match=r"KTMoE: activation='swigluoai' needs swiglu_alpha"):
        kt_ops.KTMoE(32, 24, 4, 2, activation="swigluoai", swiglu_alpha=alpha)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_alpha_without_swigluoai_is_refused(activation):
    kwargs = clamped_case(torch.float32, "inference")
    with pytest.raises(ValueError, match=rf"kt.moe: swiglu_alpha is the α of activation='swigluoai' and must be None "
                                         rf"with activation='{activation}'"):
        kt_ops.moe(**dict(kwargs, activation=activation, swiglu_alpha=1.702))
    with pytest.raises(ValueError, match=r"KTMoE: swiglu_alpha is the alpha of activation='swigluoai'"):
        kt_ops.KTMoE(32, 24, 4, 2, activation=activation, swiglu_alpha=1.702)


def test_infinite_limit_is_no_clamp():
    kwargs = clamped_case(torch.float32, "inference")
    assert torch.equal(kt_ops.moe(**dict(kwargs, swiglu_limit=math.inf)), kt_ops.moe(**dict(kwargs, swiglu_limit=None)))
