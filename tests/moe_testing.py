"""Shared helpers of the kt.moe tests: run the op or the float64 reference, compare results."""
from typing import Dict, Optional, Tuple

import torch

import kt_ops
from kt_ops.reference import moe_reference
from moe_samples import grad_inputs

# Bound on ||op - ref|| / ||ref|| per dtype of hidden_states.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def randomize_lora(model: torch.nn.Module, picks, seed: int, scale: float = 0.2) -> None:
    """Overwrites the parameters whose name ``picks(name)`` accepts with ``scale * N(0, 1)``
    from a generator seeded with ``seed``, in parameter order: LoRA B factors start at zero
    (kt's and PEFT's init), which would leave half of the gradients a test compares at zero.
    A shard's owner (a KT layer with ``expert_shards > 1``) takes its experts' rows of the values
    all experts get, so that every placement gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if picks(name):
                layer = _kt_layer_of(model, name)
                mine = getattr(layer, "expert_range", None)
                if mine is None or getattr(layer, "expert_shards", 1) == 1:
                    p.copy_(scale * torch.randn(p.shape, generator=g))
                else:
                    full = torch.randn((layer.num_experts,) + p.shape[1:], generator=g)
                    p.copy_(scale * full[mine.start:mine.stop])


def _kt_layer_of(model: torch.nn.Module, name: str):
    """The innermost module on parameter ``name``'s path that holds experts (``expert_range``:
    a KT layer; its LoRA sits in ``adapters.lora.<adapter>``), else the parameter's own module."""
    parts = name.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if hasattr(module, "expert_range"):
            return module
    return model.get_submodule(".".join(parts))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny), computed in float64."""
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny)).item()


def to_float64(kwargs: Dict[str, object]) -> Dict[str, object]:
    """The same inputs upcast to float64 (ids untouched), as fresh leaves with the same requires_grad."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[k] = v.detach().double().requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


def grad_output_for(kwargs: Dict[str, object], seed: int = 1234) -> torch.Tensor:
    """A random upstream gradient shaped and typed like kt.moe's output."""
    x = kwargs["hidden_states"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)


def forward_backward(fn, kwargs: Dict[str, object], grad_output: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, Dict[str, Optional[torch.Tensor]]]:
    """Calls fn(**kwargs) and, when something requires grad, backpropagates grad_output.

    Returns the output and {name: .grad} for every tensor argument that requires grad.
    """
    out = fn(**kwargs)
    names = grad_inputs(kwargs)
    if names:
        grads = torch.autograd.grad(out, [kwargs[n] for n in names], grad_output.to(out.dtype),
                                    allow_unused=True)
        return out, dict(zip(names, grads))
    return out, {}


def run_op(kwargs, grad_output=None):
    return forward_backward(kt_ops.moe, kwargs, grad_output)


def run_reference(kwargs, grad_output=None):
    """The float64 reference on the op's inputs upcast to float64."""
    return forward_backward(moe_reference, to_float64(kwargs),
                            None if grad_output is None else grad_output.double())


def clone_inputs(kwargs: Dict[str, object]) -> Dict[str, object]:
    """Fresh leaves with the same values, strides and requires_grad."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            c = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            c.copy_(v.detach())
            out[k] = c.requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


__all__ = ["TOLERANCE", "rel_err", "to_float64", "grad_output_for", "run_op",
           "run_reference", "clone_inputs"]
