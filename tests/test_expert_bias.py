"""kt.moe's per-expert biases (``gate_bias``/``up_bias`` [E, I] added to the pre-activations,
``down_bias`` [E, H] to each expert's output; gpt-oss's experts): output and every gradient,
the biases' included, against the float64 reference for each dtype and training mode, on
decode-sized blocks (row dot products) and GEMM blocks; each bias alone; gradcheck; opcheck;
the backward's 11- and 14-entry output masks; quantized experts; KTMoE(expert_bias=True);
bad biases refused by name."""
import pytest
import torch

import kt_ops
from kt_ops import quantization
from moe_samples import make_moe_inputs, positional
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

BIAS_NAMES = ("gate_bias", "up_bias", "down_bias")
# (T, E): about 2 rows per expert (decode-sized blocks: row dot products), or about 40 (GEMMs).
SIZES = {"decode": (5, 6), "gemm": (80, 4)}


def with_biases(kwargs, names=BIAS_NAMES, seed=0, requires_grad=None):
    """kwargs with random biases (std 0.5, so that they move the result); they require grad
    when the base weights do (a bias is part of the base: trained with it), or as given."""
    E, I, H = kwargs["gate_proj"].shape
    dtype = kwargs["hidden_states"].dtype
    trains = kwargs["gate_proj"].requires_grad if requires_grad is None else requires_grad
    gen = torch.Generator().manual_seed(seed + 1000)
    out = dict(kwargs)
    for name, size in zip(BIAS_NAMES, (I, I, H)):
        if name in names:
            out[name] = (torch.randn(E, size, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_(trains)
    return out


def bias_case(dtype=torch.float32, mode="hybrid", size="decode", seed=0, **extra):
    T, E = SIZES[size]
    kwargs = make_moe_inputs(T_shape=(T,), H=48, I=40, E=E, K=2, r=4 if mode in ("lora", "hybrid") else 0,
                             dtype=dtype, mode=mode, seed=seed)
    return with_biases(dict(kwargs, **extra), seed=seed)


def assert_matches_reference(kwargs, tol):
    dy = grad_output_for(kwargs)
    out, grads = run_op(kwargs, dy)
    ref_out, ref_grads = run_reference(kwargs, dy)
    assert rel_err(out, ref_out) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= tol, name
    return grads, dy, ref_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("mode", ["inference", "lora", "full", "hybrid"])
@pytest.mark.parametrize("size", list(SIZES))
def test_biases_match_float64_reference(dtype, mode, size):
    kwargs = bias_case(dtype, mode, size)
    grads, dy, ref_out = assert_matches_reference(kwargs, TOLERANCE[dtype])
    assert (set(BIAS_NAMES) <= grads.keys()) == (mode in ("full", "hybrid"))  # trained with the base
    no_bias = {k: v for k, v in kwargs.items() if k not in BIAS_NAMES}
    assert rel_err(run_reference(no_bias, dy)[0], ref_out) > 0.05  # the biases change the result


@pytest.mark.parametrize("name", BIAS_NAMES)
def test_each_bias_alone(name):
    kwargs = with_biases(make_moe_inputs(T_shape=(9,), H=48, I=40, E=4, K=2, r=4, mode="hybrid", seed=3),
                         names=(name,), seed=3)
    grads, _, _ = assert_matches_reference(kwargs, TOLERANCE[torch.float32])
    assert [n for n in BIAS_NAMES if n in grads] == [name]


def test_biases_with_gpt_oss_gating():
    """gpt-oss's experts in full: biases, swigluoai with alpha 1.702, the clamp at 7 cutting."""
    kwargs = bias_case(torch.float32, "hybrid", "gemm", swiglu_limit=0.75, activation="swigluoai", swiglu_alpha=1.702)
    assert_matches_reference(kwargs, TOLERANCE[torch.float32])


def test_gradcheck_float64_with_biases():
    kwargs = with_biases(make_moe_inputs(T_shape=(4,), H=16, I=12, E=3, K=2, r=2, dtype=torch.float64,
                                         mode="hybrid", seed=1), seed=1)
    names = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    assert set(BIAS_NAMES) <= set(names)

    def fn(*tensors):
        return kt_ops.moe(**dict(kwargs, **dict(zip(names, tensors))))

    assert torch.autograd.gradcheck(fn, [kwargs[n] for n in names], eps=1e-6, atol=1e-7, rtol=1e-5)


def _gating_and_biases(kwargs):
    return (None, "silu", None) + tuple(kwargs[n].detach() for n in BIAS_NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_with_biases(dtype):
    kwargs = bias_case(dtype, "hybrid")
    args = positional(kwargs)
    rest = _gating_and_biases(kwargs)
    torch.library.opcheck(torch.ops.kt.moe, args + (None, None, None) + rest)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.kt.moe_forward, detached + (True, None, None, None) + rest)
    _, activations = torch.ops.kt.moe_forward(*detached, True, None, None, None, *rest)
    dy = grad_output_for(kwargs)
    for mask in ([True] * 14, [True] * 11, [True, True] + [False] * 9 + [True, False, True]):
        torch.library.opcheck(torch.ops.kt.moe_backward,
                              (dy, *detached[:3], activations, *detached[3:], mask, None, None, None, *rest))


def test_backward_masks_with_and_without_bias_entries():
    """A mask of 11 entries asks for no bias gradient and gets 11 results; one of 14 gets the
    biases' too, equal to autograd's through kt.moe; asking for a bias not given is refused."""
    kwargs = bias_case(torch.float32, "hybrid")
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in positional(kwargs))
    rest = _gating_and_biases(kwargs)
    _, activations = torch.ops.kt.moe_forward(*args, True, None, None, None, *rest)
    dy = grad_output_for(kwargs)
    backward = lambda mask, rest=rest: torch.ops.kt.moe_backward(dy, *args[:3], activations, *args[3:], mask,  # noqa: E731
                                                                 None, None, None, *rest)
    eleven, fourteen = backward([True] * 11), backward([True] * 14)
    assert len(eleven) == 11 and len(fourteen) == 14
    for a, b in zip(eleven, fourteen):
        assert torch.equal(a, b)
    _, grads = run_op(kwargs, dy)
    for name, grad in zip(BIAS_NAMES, fourteen[11:]):
        assert torch.allclose(grad, grads[name], rtol=1e-6, atol=1e-6), name
    without_up = rest[:4] + (None,) + rest[5:]
    with pytest.raises(ValueError, match=r"output_mask\[12\] asks for the gradient of a bias that was not given"):
        backward([True] * 14, without_up)
    with pytest.raises(ValueError, match=r"output_mask must have 11 entries \(14 with the biases' gradients\), got 12"):
        backward([True] * 12)


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 32), ("fp8", None)])
def test_quantized_experts_with_biases(fmt, group):
    """Frozen quantized experts with (frozen) biases and LoRA: the float64 reference on the
    dequantized weights."""
    kwargs = with_biases(make_moe_inputs(T_shape=(40,), H=64, I=64, E=4, K=2, r=4, mode="lora", seed=2), seed=2)
    scales = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        kwargs[name], scales[name] = quantization.quantize(kwargs[name].detach(), fmt, group, name=name)
    dense = dict(kwargs, **{n: quantization.dequantize(kwargs[n], scales[n]).float() for n in scales})
    dy = grad_output_for(kwargs)
    out, grads = run_op(dict(kwargs, gate_scale=scales["gate_proj"], up_scale=scales["up_proj"],
                             down_scale=scales["down_proj"]), dy)
    ref_out, ref_grads = run_reference(dense, dy)
    assert rel_err(out, ref_out) <= 1e-5
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("train_base", [False, True], ids=["lora", "full"])
def test_ktmoe_with_biases(train_base):
    """KTMoE(expert_bias=True): kt.moe with its biases, which train with the base weights only."""
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(32, 24, 4, 2, lora_rank=0 if train_base else 2, train_base=train_base,
                         dtype=torch.float32, expert_bias=True)
    biases = layer.expert_biases()
    assert [tuple(b.shape) for b in biases] == [(4, 24), (4, 24), (4, 32)]
    assert all(b.requires_grad == train_base and not b.any() for b in biases)  # zeros, as gpt-oss's init
    with torch.no_grad():
        for b in biases:
            b.normal_()
    x = torch.randn(7, 32)
    weights, ids = layer.gate(x)
    expected = kt_ops.moe(x, ids, weights, *layer.expert_tensors(), layer.lora_scale, gate_bias=biases[0],
                          up_bias=biases[1], down_bias=biases[2])
    out = layer(x)
    assert rel_err(out, expected) <= 1e-6
    out.square().sum().backward()
    assert all((b.grad is not None) == train_base for b in biases)
    base_bytes = sum(w.numel() * w.element_size() for w in layer.expert_tensors()[:3])
    assert layer.expert_nbytes() == base_bytes + sum(b.numel() * b.element_size() for b in biases)


@pytest.mark.parametrize("name,shape,match", [
    ("gate_bias", (6, 41), r"kt.moe: gate_bias must have shape \[E, I\] = \[6, 40\], got \[6, 41\]"),
    ("up_bias", (6, 40, 1), r"kt.moe: up_bias must have shape \[E, I\] = \[6, 40\], got \[6, 40, 1\]"),
    ("down_bias", (5, 48), r"kt.moe: down_bias must have shape \[E, H\] = \[6, 48\], got \[5, 48\]"),
])
def test_bad_bias_shape_is_refused(name, shape, match):
    kwargs = bias_case(torch.float32, "inference")
    with pytest.raises(ValueError, match=match):
        kt_ops.moe(**dict(kwargs, **{name: torch.zeros(shape)}))


def test_bias_of_another_dtype_is_refused():
    kwargs = bias_case(torch.float32, "inference")
    with pytest.raises(TypeError, match=r"kt.moe: down_bias must have the dtype of hidden_states \(Float\), got BFloat16"):
        kt_ops.moe(**dict(kwargs, down_bias=kwargs["down_bias"].bfloat16()))
