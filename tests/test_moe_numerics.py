"""Numerics of kt.moe: output and gradients against the float64 reference, gradcheck,
unrequested gradients, inference, determinism, NaN isolation, varying T, output_mask."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kt_ops
from moe_samples import (ARG_NAMES, BASE_NAMES, GRAD_NAMES, LORA_NAMES, SAMPLE_IDS, SAMPLES,
                         grad_inputs, make_moe_inputs, positional)
from moe_testing import (TOLERANCE, clone_inputs, grad_output_for, rel_err, run_op,
                         run_reference)


def _save_flag(args, kwargs):
    """save_activations of a recorded moe_forward call (trailing defaults are left out)."""
    return args[13] if len(args) > 13 else kwargs.get("save_activations", False)


class RecordKtCalls(TorchDispatchMode):
    """Records (op name, args) of every kt.* op that reaches the dispatcher below autograd."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.forward_saves = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kt":
            name = func.__name__.split(".")[0]
            self.calls.append((name, args))
            if name == "moe_forward":
                self.forward_saves.append(_save_flag(args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_output_and_grads_match_float64_reference(sample):
    """Output and the gradient of every tensor that requires grad match the float64
    reference within the dtype's tolerance, with the input's shape and dtype."""
    kwargs = sample.make()
    grad_out = grad_output_for(kwargs)
    out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    tol = TOLERANCE[sample.dtype]

    x = kwargs["hidden_states"]
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) < tol, "output"
    assert set(grads) == set(ref_grads) == set(grad_inputs(kwargs))
    for name, g in grads.items():
        assert g is not None, f"{name} requires grad but got none"
        t = kwargs[name]
        assert g.shape == t.shape and g.dtype == t.dtype, name
        # A bf16 gradient (e.g. of bf16 routing weights next to fp32 hidden states) is rounded
        # to bf16, so it gets bf16's tolerance.
        assert rel_err(g, ref_grads[name]) < max(tol, TOLERANCE[g.dtype]), name
    # The reference's gradients are not trivially zero (else the comparison proves little),
    # unless there are no (token, slot) pairs at all.
    if kwargs["hidden_states"].numel() and kwargs["topk_ids"].numel():
        assert ref_out.abs().sum() > 0
        for name in grads:
            assert ref_grads[name].abs().sum() > 0, name


@pytest.mark.parametrize("mode", ["lora", "full", "hybrid"])
def test_gradcheck_float64(mode):
    """Finite differences agree with the analytic gradients in float64 (every input that
    requires grad in that mode, tiny shapes, distinct experts per token and an unused expert)."""
    kwargs = make_moe_inputs(T_shape=(3,), H=3, I=2, E=3, K=2, r=0 if mode == "full" else 1,
                             dtype=torch.float64, mode=mode, empty_experts=True, seed=3)
    assert kwargs["topk_ids"].unique().numel() < 3  # an expert with no token
    names = grad_inputs(kwargs)
    fixed = {k: v for k, v in kwargs.items() if k not in names}

    def fn(*tensors):
        return kt_ops.moe(**fixed, **dict(zip(names, tensors)))

    assert torch.autograd.gradcheck(fn, [kwargs[n] for n in names], eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("mode", ["lora", "hybrid"])
def test_gradcheck_float64_leading_dims_fast(mode):
    """gradcheck (fast mode) with [B, S, H] hidden states, int32 ids, K = E and larger sizes."""
    kwargs = make_moe_inputs(T_shape=(2, 3), H=6, I=5, E=3, K=3, r=2,
                             dtype=torch.float64, ids_dtype=torch.int32, mode=mode, seed=4)
    names = grad_inputs(kwargs)
    fixed = {k: v for k, v in kwargs.items() if k not in names}

    def fn(*tensors):
        return kt_ops.moe(**fixed, **dict(zip(names, tensors)))

    assert torch.autograd.gradcheck(fn, [kwargs[n] for n in names], eps=1e-6, atol=1e-8, rtol=1e-6,
                                    fast_mode=True)


@pytest.mark.parametrize("mode,expected_grads", [
    ("lora", ("hidden_states", "topk_weights") + LORA_NAMES),
    ("full", ("hidden_states", "topk_weights") + BASE_NAMES),
    ("hybrid", GRAD_NAMES),
])
def test_unrequested_grads_are_not_computed(mode, expected_grads):
    """Backward asks moe_backward for exactly the gradients that are needed (output_mask),
    the others come back empty, and frozen tensors keep .grad None."""
    kwargs = make_moe_inputs(mode=mode, r=0 if mode == "full" else 2, seed=5)
    out = kt_ops.moe(**kwargs)
    with RecordKtCalls() as rec:
        out.backward(grad_output_for(kwargs))
    backward_calls = [args for name, args in rec.calls if name == "moe_backward"]
    assert len(backward_calls) == 1
    mask = list(backward_calls[0][-1])
    assert mask == [n in expected_grads for n in GRAD_NAMES]
    for name in ARG_NAMES:
        t = kwargs.get(name)
        if t is None or not t.is_floating_point():
            continue
        if name in expected_grads:
            assert t.grad is not None and t.grad.shape == t.shape, name
        else:
            assert t.grad is None, name


def test_only_hidden_grad_requested():
    """With only hidden_states requiring grad, no weight gradient is asked for."""
    kwargs = make_moe_inputs(mode="inference", r=2, seed=6)
    kwargs["hidden_states"].requires_grad_(True)
    out = kt_ops.moe(**kwargs)
    with RecordKtCalls() as rec:
        (g,) = torch.autograd.grad(out, kwargs["hidden_states"], grad_output_for(kwargs))
    (args,) = [a for n, a in rec.calls if n == "moe_backward"]
    assert list(args[-1]) == [True] + [False] * 10
    _, ref = run_reference(kwargs, grad_output_for(kwargs))
    assert rel_err(g, ref["hidden_states"]) < 1e-5


def test_inference_saves_nothing():
    """Under no_grad (or with nothing requiring grad) kt.moe runs moe_forward with
    save_activations=False, and returns the same output as a training call."""
    kwargs = make_moe_inputs(mode="hybrid", r=2, seed=7)
    with RecordKtCalls() as rec:
        train_out = kt_ops.moe(**kwargs)
    assert [n for n, _ in rec.calls] == ["moe_forward"] and rec.forward_saves == [True]
    assert train_out.requires_grad

    with torch.no_grad(), RecordKtCalls() as rec:
        out = kt_ops.moe(**kwargs)
    assert [n for n, _ in rec.calls] == ["moe_forward"] and rec.forward_saves == [False]
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, train_out.detach())

    frozen = make_moe_inputs(mode="inference", r=2, seed=7)
    with RecordKtCalls() as rec:
        out2 = kt_ops.moe(**frozen)
    assert [n for n, _ in rec.calls] == ["moe_forward"] and rec.forward_saves == [False]
    assert torch.equal(out2, train_out.detach())

    with torch.inference_mode():
        out3 = kt_ops.moe(**frozen)
    assert torch.equal(out3, train_out.detach())


def test_moe_forward_activations_shape():
    """moe_forward returns [2, 0, I] activations without saving and [2, T*K, I] with."""
    kwargs = make_moe_inputs(T_shape=(2, 3), I=12, K=2, r=2, mode="inference", seed=8)
    args = positional(kwargs)
    out0, act0 = torch.ops.kt.moe_forward(*args, False)
    out1, act1 = torch.ops.kt.moe_forward(*args, True)
    assert act0.shape == (2, 0, 12)
    assert act1.shape == (2, 12, 12)
    assert torch.equal(out0, out1)
    assert torch.equal(out0, kt_ops.moe(**kwargs))


def test_moe_forward_without_saved_activations_cannot_backward():
    """Differentiating moe_forward(save_activations=False) fails with a clear message."""
    kwargs = make_moe_inputs(mode="full", seed=9)
    out, _ = torch.ops.kt.moe_forward(*positional(kwargs), False)
    with pytest.raises(RuntimeError, match="save_activations"):
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_deterministic(dtype):
    """Two identical calls give bitwise-equal outputs and gradients."""
    kwargs = make_moe_inputs(T_shape=(40,), E=4, K=2, r=2, dtype=dtype, mode="hybrid", seed=10)
    grad_out = grad_output_for(kwargs)
    out_a, grads_a = run_op(clone_inputs(kwargs), grad_out)
    out_b, grads_b = run_op(clone_inputs(kwargs), grad_out)
    assert torch.equal(out_a, out_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E", [(600, 16, 12, 3), (1, 256, 128, 4)], ids=["many-blocks", "one-block"])
def test_independent_of_thread_count(dtype, T, H, I, E):
    """Output and gradients are bitwise equal with 1 and 2 intra-op threads: with many tokens
    (forward splits experts into several blocks spread over threads) and with one token
    (a single block, whose GEMMs may themselves use both threads)."""
    kwargs = make_moe_inputs(T_shape=(T,), H=H, I=I, E=E, K=2, r=2, dtype=dtype, mode="hybrid",
                             seed=11)
    grad_out = grad_output_for(kwargs)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(run_op(clone_inputs(kwargs), grad_out))
    finally:
        torch.set_num_threads(threads)
    (out1, grads1), (out2, grads2) = results
    assert torch.equal(out1, out2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name


def test_nan_stays_in_its_token():
    """A NaN in one token's hidden state makes that token's output NaN, leaves the other
    tokens' outputs (and their hidden-state gradients) as without the NaN, and does not crash."""
    kwargs = make_moe_inputs(T_shape=(8,), mode="lora", r=2, seed=12)
    clean = clone_inputs(kwargs)
    bad = clone_inputs(kwargs)
    with torch.no_grad():
        bad["hidden_states"][3, 5] = float("nan")
    grad_out = grad_output_for(kwargs)
    out_clean, g_clean = run_op(clean, grad_out)
    out_bad, g_bad = run_op(bad, grad_out)
    others = [t for t in range(8) if t != 3]
    assert torch.isnan(out_bad[3]).all()
    assert torch.isfinite(out_bad[others]).all()
    torch.testing.assert_close(out_bad[others], out_clean[others], rtol=1e-6, atol=1e-7)
    gx_bad, gx_clean = g_bad["hidden_states"], g_clean["hidden_states"]
    assert torch.isnan(gx_bad[3]).any()
    torch.testing.assert_close(gx_bad[others], gx_clean[others], rtol=1e-6, atol=1e-7)


def test_repeated_calls_with_different_token_counts():
    """The same expert weights serve calls with T = 5, 0, 1, 17, 2 (forward and backward)."""
    weights = make_moe_inputs(T_shape=(1,), r=2, mode="lora", seed=13)
    for i, T in enumerate((5, 0, 1, 17, 2)):
        fresh = make_moe_inputs(T_shape=(T,), r=2, mode="lora", seed=100 + i)
        kwargs = {**weights, **{k: fresh[k] for k in ("hidden_states", "topk_ids", "topk_weights")}}
        grad_out = grad_output_for(kwargs, seed=i)
        out, grads = run_op(kwargs, grad_out)
        ref_out, ref_grads = run_reference(kwargs, grad_out)
        assert out.shape == (T, 16)
        assert rel_err(out, ref_out) < 1e-5, T
        for name in grads:
            assert rel_err(grads[name], ref_grads[name]) < 1e-5, (T, name)


def _masks():
    singles = [tuple(i == j for j in range(11)) for i in range(11)]
    return singles + [(True,) * 11, (False,) * 11,
                      (True, True, False, False, False) + (True,) * 6,
                      (False, False, True, True, True) + (False,) * 6,
                      (False,) * 5 + (False, True) * 3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", _masks(), ids=lambda m: "".join("1" if b else "0" for b in m))
def test_moe_backward_output_mask(mask, dtype):
    """moe_backward returns empty [0] tensors for masked gradients and reference-matching
    gradients for requested ones, whatever the combination."""
    kwargs = make_moe_inputs(T_shape=(7,), r=2, dtype=dtype, mode="hybrid", seed=14)
    args = positional(kwargs)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    _, activations = torch.ops.kt.moe_forward(*detached, True)
    grad_out = grad_output_for(kwargs)
    _, ref_grads = run_reference(kwargs, grad_out)
    grads = torch.ops.kt.moe_backward(grad_out, *detached[:3], activations, *detached[3:], list(mask))
    assert len(grads) == 11
    for name, wanted, g in zip(GRAD_NAMES, mask, grads):
        if wanted:
            t = kwargs[name]
            assert g.shape == t.shape and g.dtype == t.dtype, name
            assert rel_err(g, ref_grads[name]) < TOLERANCE[dtype], name
        else:
            assert g.shape == (0,), name


def test_moe_backward_without_lora():
    """moe_backward with no LoRA tensors computes base gradients; asking for a LoRA gradient
    that does not exist is an error naming output_mask."""
    kwargs = make_moe_inputs(mode="full", seed=15)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in positional(kwargs))
    _, act = torch.ops.kt.moe_forward(*args, True)
    grad_out = grad_output_for(kwargs)
    _, ref = run_reference(kwargs, grad_out)
    grads = torch.ops.kt.moe_backward(grad_out, *args[:3], act, *args[3:], [True] * 5 + [False] * 6)
    for name, g in zip(GRAD_NAMES[:5], grads[:5]):
        assert rel_err(g, ref[name]) < 1e-5, name
    assert all(g.numel() == 0 for g in grads[5:])
    for i in range(5, 11):
        mask = [True] * 5 + [j == i for j in range(5, 11)]
        with pytest.raises(ValueError, match=rf"output_mask\[{i}\]"):
            torch.ops.kt.moe_backward(grad_out, *args[:3], act, *args[3:], mask)


def test_partial_lora():
    """LoRA on only some projections (here: up only) matches the reference."""
    kwargs = make_moe_inputs(r=2, mode="hybrid", seed=16)
    for name in ("gate_lora_a", "gate_lora_b", "down_lora_a", "down_lora_b"):
        kwargs[name] = None
    grad_out = grad_output_for(kwargs)
    out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    assert rel_err(out, ref_out) < 1e-5
    assert set(grads) == {"hidden_states", "topk_weights", *BASE_NAMES, "up_lora_a", "up_lora_b"}
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, name


def test_lora_scale_is_applied():
    """lora_scale scales the LoRA terms: scale 0 gives the base-only output, other scales
    match the reference (forward and backward) and change the output."""
    kwargs = make_moe_inputs(r=2, mode="lora", seed=17)
    base = {k: v for k, v in kwargs.items() if k not in LORA_NAMES and k != "lora_scale"}
    with torch.no_grad():
        out0 = kt_ops.moe(**{**kwargs, "lora_scale": 0.0})
        torch.testing.assert_close(out0, kt_ops.moe(**base), rtol=1e-6, atol=1e-7)
        assert (kt_ops.moe(**{**kwargs, "lora_scale": 1.0}) - out0).abs().max() > 1e-2
    for scale in (-0.5, 3.0):
        scaled = {**kwargs, "lora_scale": scale}
        grad_out = grad_output_for(scaled)
        out, grads = run_op(scaled, grad_out)
        ref_out, ref_grads = run_reference(scaled, grad_out)
        assert rel_err(out, ref_out) < 1e-5, scale
        for name in grads:
            assert rel_err(grads[name], ref_grads[name]) < 1e-5, (scale, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_slots_are_the_slots_left_out(dtype):
    """An empty slot (id -1) is exactly a slot that is not there: the output and the hidden and
    LoRA gradients equal those of the call whose routing weight there is 0 (the expert is the
    same, so every row is computed alike), and the empty slot's routing-weight gradient is 0
    while the zero-weight slot's is not."""
    kwargs = make_moe_inputs(T_shape=(9,), E=4, K=3, r=2, mode="lora", dtype=dtype, empty_slots=True, seed=3)
    empty = kwargs["topk_ids"] < 0
    assert empty.any() and (~empty).any()
    grad_out = grad_output_for(kwargs)
    out, grads = run_op(clone_inputs(kwargs), grad_out)

    zero_weight = clone_inputs(kwargs)
    zero_weight["topk_ids"] = kwargs["topk_ids"].masked_fill(empty, 1)
    with torch.no_grad():
        zero_weight["topk_weights"].masked_fill_(empty, 0)
    out_zero, grads_zero = run_op(zero_weight, grad_out)
    torch.testing.assert_close(out, out_zero, rtol=0, atol=0)
    for name in grads:
        if name != "topk_weights":
            torch.testing.assert_close(grads[name], grads_zero[name], rtol=1e-6, atol=1e-6, msg=name)
    assert (grads["topk_weights"][empty] == 0).all()
    assert (grads_zero["topk_weights"][empty] != 0).any()
    torch.testing.assert_close(grads["topk_weights"][~empty], grads_zero["topk_weights"][~empty])
