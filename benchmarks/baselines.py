"""Eager PyTorch baseline for ``kt.moe``: a Hugging Face-style sparse MoE block with PEFT LoRA.

This is what a user gets today without ``kt_ops``: one ``nn.Module`` per expert holding
``nn.Linear`` gate/up/down projections (bias=False, as in Qwen2/Qwen3-MoE / Mixtral in
transformers 4.x), each optionally wrapped PEFT-style with two extra ``nn.Linear`` calls
(``lora_A`` then ``lora_B``, times ``scaling``), and the HF routing loop::

    expert_mask = one_hot(topk_ids, E).permute(2, 1, 0)          # [E, K, T]
    for e in experts that got at least one token:
        idx, top = torch.where(expert_mask[e])
        current = hidden[top]
        out = expert(current) * topk_weights[top, idx, None]
        final.index_add_(0, top, out)

The weights are copied from the same stacked ``[E, ...]`` tensors that ``kt.moe`` takes, so both
implementations compute the same function (see ``kt_ops/moe.py`` for the math).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _linear_from(weight: Tensor) -> nn.Linear:
    """An ``nn.Linear(in, out, bias=False)`` holding a copy of ``weight`` ([out, in]).

    Built on the meta device and then given its weight, so that no time is spent on a random
    init that would be overwritten anyway (hundreds of large linears at Qwen3 shapes).
    """
    out_features, in_features = weight.shape
    lin = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.detach().clone().contiguous())
    return lin


class LoraLinear(nn.Module):
    """PEFT ``lora.Linear`` in miniature: ``base(x) + lora_B(lora_A(dropout(x))) * scaling``.

    Dropout is 0 (PEFT's default, an identity), so it is left out.
    """

    def __init__(self, weight: Tensor, lora_a: Optional[Tensor] = None,
                 lora_b: Optional[Tensor] = None, scaling: float = 1.0):
        super().__init__()
        self.base_layer = _linear_from(weight)
        if lora_a is not None:
            self.lora_A = _linear_from(lora_a)  # [r, in]
            self.lora_B = _linear_from(lora_b)  # [out, r]
            self.scaling = scaling
        else:
            self.lora_A = self.lora_B = None

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        if self.lora_A is not None:
            result = result + self.lora_B(self.lora_A(x)) * self.scaling
        return result


class ExpertMLP(nn.Module):
    """SwiGLU expert as in ``Qwen3MoeMLP``: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, gate: LoraLinear, up: LoraLinear, down: LoraLinear):
        super().__init__()
        self.gate_proj = gate
        self.up_proj = up
        self.down_proj = down

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFLoopMoE(nn.Module):
    """The experts of a HF sparse-MoE block (router excluded), with optional PEFT LoRA.

    ``forward(hidden_states [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]``, the same
    contract as ``kt.moe`` once the router has run.
    """

    def __init__(self, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor,
                 gate_lora_a: Optional[Tensor] = None, gate_lora_b: Optional[Tensor] = None,
                 up_lora_a: Optional[Tensor] = None, up_lora_b: Optional[Tensor] = None,
                 down_lora_a: Optional[Tensor] = None, down_lora_b: Optional[Tensor] = None,
                 lora_scale: float = 1.0):
        super().__init__()
        self.num_experts = gate_proj.shape[0]
        lora = gate_lora_a is not None

        def pick(t, e):
            return t[e] if lora else None

        self.experts = nn.ModuleList(
            ExpertMLP(
                LoraLinear(gate_proj[e], pick(gate_lora_a, e), pick(gate_lora_b, e), lora_scale),
                LoraLinear(up_proj[e], pick(up_lora_a, e), pick(up_lora_b, e), lora_scale),
                LoraLinear(down_proj[e], pick(down_lora_a, e), pick(down_lora_b, e), lora_scale),
            )
            for e in range(self.num_experts)
        )

    def forward(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        hidden_dim = hidden_states.shape[-1]
        final = torch.zeros_like(hidden_states)
        # [E, K, T]: expert_mask[e, j, t] == 1 iff token t sends slot j to expert e.
        expert_mask = F.one_hot(topk_ids.long(), num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[int(expert_idx)]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden = expert_layer(current_state) * topk_weights[top_x, idx, None]
            final.index_add_(0, top_x, current_hidden.to(hidden_states.dtype))
        return final

    # -- helpers for the benchmark: gradients restacked into kt.moe's [E, ...] layout ---------

    def _stack(self, getter, like: Tensor) -> Tensor:
        grads = []
        for expert in self.experts:
            p = getter(expert)
            grads.append(torch.zeros_like(like[0]) if p.grad is None else p.grad)
        return torch.stack(grads)

    def stacked_grads(self, names, like):
        """Gradients of the named stacked parameters, e.g. ``gate_proj`` or ``up_lora_a``.

        ``like`` maps the same names to the stacked tensors (shape/dtype of the result).
        Experts that received no token have no ``.grad``; they count as zeros.
        """
        getters = {
            "gate_proj": lambda m: m.gate_proj.base_layer.weight,
            "up_proj": lambda m: m.up_proj.base_layer.weight,
            "down_proj": lambda m: m.down_proj.base_layer.weight,
            "gate_lora_a": lambda m: m.gate_proj.lora_A.weight,
            "gate_lora_b": lambda m: m.gate_proj.lora_B.weight,
            "up_lora_a": lambda m: m.up_proj.lora_A.weight,
            "up_lora_b": lambda m: m.up_proj.lora_B.weight,
            "down_lora_a": lambda m: m.down_proj.lora_A.weight,
            "down_lora_b": lambda m: m.down_proj.lora_B.weight,
        }
        return {n: self._stack(getters[n], like[n]) for n in names}
