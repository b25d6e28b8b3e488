"""Plain-PyTorch reference of kt.moe: slow, obviously correct, differentiable by autograd.

Tests run it in float64 and compare the op's output and gradients against it.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _project(inp: Tensor, weight: Tensor, lora_a: Optional[Tensor], lora_b: Optional[Tensor],
             scale: float) -> Tensor:
    """inp [T, K, in], weight/lora_* already gathered per (token, slot): [T, K, out, in] ..."""
    out = torch.einsum("tki,tkoi->tko", inp, weight)
    if lora_a is not None:
        low_rank = torch.einsum("tki,tkri->tkr", inp, lora_a)
        out = out + scale * torch.einsum("tkr,tkor->tko", low_rank, lora_b)
    return out


def moe_reference(hidden_states, topk_ids, topk_weights, gate_proj, up_proj, down_proj,
                  gate_lora_a=None, gate_lora_b=None, up_lora_a=None, up_lora_b=None,
                  down_lora_a=None, down_lora_b=None, lora_scale=1.0, swiglu_limit=None,
                  activation="silu", swiglu_alpha=None, gate_bias=None, up_bias=None,
                  down_bias=None) -> Tensor:
    """Same math and arguments as :func:`kt_ops.moe`, computed per (token, slot) pair."""
    H = hidden_states.shape[-1]
    K = topk_ids.shape[-1]
    T = hidden_states.shape[:-1].numel()  # not reshape(-1, K): ambiguous when K == 0
    x = hidden_states.reshape(T, H)
    ids = topk_ids.reshape(T, K).long()
    # Empty slots (id -1) compute expert 0 with their weight masked to 0: they add nothing, and
    # the masked weight's gradient is 0.
    empty = ids < 0
    ids = ids.masked_fill(empty, 0)
    w = topk_weights.reshape(T, K).masked_fill(empty, 0)

    def gathered(t):
        return None if t is None else t[ids]  # [T, K, ...]

    xk = x.unsqueeze(1).expand(-1, K, -1)
    g = _project(xk, gathered(gate_proj), gathered(gate_lora_a), gathered(gate_lora_b), lora_scale)
    u = _project(xk, gathered(up_proj), gathered(up_lora_a), gathered(up_lora_b), lora_scale)
    if gate_bias is not None:
        g = g + gathered(gate_bias)
    if up_bias is not None:
        u = u + gathered(up_bias)
    if swiglu_limit is not None:  # as transformers' clamped SwiGLU (DeepSeek-V4's _apply_gate)
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(min=-swiglu_limit, max=swiglu_limit)
    if activation == "swigluoai":  # as gpt-oss's _apply_gate
        h = g * torch.sigmoid(g * swiglu_alpha) * (u + 1)
    else:
        h = {"silu": F.silu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation](g) * u
    o = _project(h, gathered(down_proj), gathered(down_lora_a), gathered(down_lora_b), lora_scale)
    if down_bias is not None:
        o = o + gathered(down_bias)
    y = (w.unsqueeze(-1).to(o.dtype) * o).sum(1)
    return y.reshape(hidden_states.shape).to(hidden_states.dtype)
