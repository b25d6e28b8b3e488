"""kt.moe on device="meta" tensors (model construction without memory): forward gives the
right shape and dtype, and autograd backward gives meta gradients of the right shapes/dtypes."""
import pytest
import torch

import kt_ops
from moe_samples import ARG_NAMES, grad_inputs, make_moe_inputs, positional


def meta_inputs(**params):
    """make_moe_inputs, moved to the meta device as fresh leaves (same requires_grad)."""
    kwargs = make_moe_inputs(**params)
    return {k: v.detach().to("meta").requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()}


CASES = [
    dict(mode="inference", r=2),
    dict(mode="lora", r=2, dtype=torch.bfloat16),
    dict(mode="full", dtype=torch.float64, ids_dtype=torch.int32),
    dict(mode="hybrid", r=3, T_shape=(2, 5)),
    dict(mode="hybrid", r=3, dtype=torch.bfloat16, weights_dtype=torch.float32),
    dict(mode="hybrid", r=1, T_shape=(0,)),
    dict(mode="lora", r=2, K=0),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_forward_on_meta(params):
    """Forward returns a meta tensor shaped and typed like hidden_states."""
    kwargs = meta_inputs(**params)
    with torch.no_grad():
        out = kt_ops.moe(**kwargs)
    x = kwargs["hidden_states"]
    assert out.device.type == "meta"
    assert out.shape == x.shape and out.dtype == x.dtype
    out_op, act = torch.ops.kt.moe_forward(*positional(kwargs), True)
    I = kwargs["gate_proj"].shape[1]
    T = x.shape[:-1].numel()
    assert out_op.shape == x.shape and out_op.dtype == x.dtype
    assert act.shape == (2, T * kwargs["topk_ids"].shape[-1], I) and act.device.type == "meta"
    _, act0 = torch.ops.kt.moe_forward(*positional(kwargs), False)
    assert act0.shape == (2, 0, I)


@pytest.mark.parametrize("params", [c for c in CASES if c["mode"] != "inference"],
                         ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_backward_on_meta(params):
    """Autograd through kt.moe on meta tensors yields meta gradients of every tensor that
    requires grad, each shaped and typed like its input; frozen tensors get none."""
    kwargs = meta_inputs(**params)
    out = kt_ops.moe(**kwargs)
    assert out.requires_grad and out.device.type == "meta"
    out.backward(torch.ones_like(out))
    names = grad_inputs(kwargs)
    assert names
    for name in ARG_NAMES:
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor):
            continue
        if name in names:
            assert t.grad is not None, name
            assert t.grad.device.type == "meta", name
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype, name
        else:
            assert t.grad is None, name


def test_moe_backward_on_meta_output_mask():
    """moe_backward's Meta kernel returns [0] tensors for masked gradients."""
    kwargs = meta_inputs(mode="inference", r=2)
    args = positional(kwargs)
    _, act = torch.ops.kt.moe_forward(*args, True)
    mask = [True, False, False, True, False, True, False, False, False, False, True]
    grads = torch.ops.kt.moe_backward(torch.empty_like(kwargs["hidden_states"]), *args[:3], act,
                                      *args[3:], mask)
    names = ("hidden_states", "topk_weights", "gate_proj", "up_proj", "down_proj") + ARG_NAMES[6:]
    for name, wanted, g in zip(names, mask, grads):
        assert g.device.type == "meta"
        assert g.shape == (kwargs[name].shape if wanted else (0,)), name
