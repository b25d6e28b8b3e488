"""bf16 storage at float32 speed for a model's layers outside the experts.

PyTorch's bf16 GEMMs on CPUs without AVX512-BF16 (AVX2 and AVX-512F machines) are a slow
fallback: an nn.Linear's input gradient ran 390x slower than in float32 on a Zen 3 (14.6 s
against 38 ms at [512, 2048] x [2048, 2048], csrc/ops/linear.cpp), so a bf16 model trains there
only at a crawl, and a float32 one needs twice the memory. ``kt.linear`` runs nn.Linear's three
GEMMs on kt's base-GEMM paths instead: bf16 operands converted to float32 a cache-sized panel at a
time, float32 accumulation, one rounding (oneDNN's own bf16 GEMMs where the CPU has AVX512-BF16).

:func:`use_kt_linear` routes a model's ``nn.Linear`` modules through it (``patch_model`` does this
for bf16 models on such CPUs): each keeps its class's behaviour, parameters and state-dict names
(a subclass, so PEFT's LoRA still wraps it), and takes ``kt.linear`` only for bf16 inputs on the
CPU; anything else (float32, a GPU) runs ``F.linear`` as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad = grad.contiguous()
    dx = torch.ops.kt.linear_input_grad(grad, weight) if ctx.needs_input_grad[0] else None
    dw = torch.ops.kt.linear_weight_grad(grad, x) if ctx.needs_input_grad[1] else None
    db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


torch.library.register_autograd("kt::linear", _backward, setup_context=_setup)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through ``kt.linear`` (CPU tensors of one floating dtype)."""
    return torch.ops.kt.linear(x, weight, bias)


class KTLinear(nn.Linear):
    """An ``nn.Linear`` whose bf16 CPU GEMMs are kt's (module docstring). Made by
    :func:`use_kt_linear` from an existing ``nn.Linear`` (its class swapped in place)."""

    def forward(self, input: Tensor) -> Tensor:
        w = self.weight
        if input.device.type == "cpu" and w.device.type == "cpu" and input.dtype == w.dtype == torch.bfloat16:
            return torch.ops.kt.linear(input, w, self.bias)
        return F.linear(input, w, self.bias)


def bf16_gemms_are_slow() -> bool:
    """Whether ATen's bf16 GEMMs on this CPU are the slow fallback (kt's active path converts bf16
    panels to float32 instead of using native bf16 GEMMs)."""
    return torch.ops.kt._base_gemm_path(torch.bfloat16) == "bf16_to_fp32_panels"


def use_kt_linear(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` (exactly that class, not its subclasses) for
    :class:`KTLinear`, in place; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = KTLinear
            swapped += 1
    return swapped
