"""Eager PyTorch baselines for ``kt.moe``.

* ``HFLoopMoE`` (below, used by ``bench_moe.py`` and the ``suite``): a Hugging Face-style sparse
  MoE block with PEFT LoRA;
* ``SortedMoE`` (the ``suite``): pairs sorted by expert, one fused gate|up ``mm`` per expert,
  ``index_add_``, eager autograd: well-written plain PyTorch;
* ``GroupedMMMoE`` (the ``suite``): the same with ``torch._grouped_mm`` instead of the loop.

``HFLoopMoE``: a Hugging Face-style sparse MoE block with PEFT LoRA.

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


# ============================================================================================
# Well-written eager PyTorch: pairs sorted by expert, one fused gate|up GEMM per expert.


def sort_pairs(topk_ids: Tensor, topk_weights: Tensor, num_experts: int):
    """Group the (token, slot) pairs by expert.

    Returns ``(token, weight, counts)``: for the pairs in expert order (stable, so tokens stay
    ascending within an expert) the token index ``[P]`` and routing weight ``[P]``, and the
    number of pairs per expert ``[E]`` (int64). ``P = T·K``.
    """
    K = topk_ids.shape[-1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    token = torch.div(order, K, rounding_mode="floor")
    weight = topk_weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat, minlength=num_experts)
    return token, weight, counts


class SortedMoE(nn.Module):
    """The experts as a careful eager PyTorch user writes them (router excluded).

    Pairs are sorted by expert, the hidden states gathered once (``index_select``), ``split``
    into per-expert chunks; each expert runs one fused gate|up GEMM on ``w13[e] = [Wg; Wu]``
    (``[2I, H]``, nn.Linear layout), SwiGLU, the down GEMM; the outputs are concatenated, scaled
    by the routing weights and summed per token with one ``index_add_``. LoRA (PEFT layout) adds,
    per expert, one fused ``[Ag; Au]`` GEMM and the three B GEMMs and the down adapter. Backward
    is eager autograd. The stacked parameters are ``unbind``-ed once per call, not indexed per
    expert: indexing a stacked parameter per expert zero-fills the whole stacked gradient once
    per expert (docs/benchmarks.md).

    Parameters: ``w13 [E, 2I, H]`` (a fused copy, the implementation's own layout), ``w2 =
    down_proj [E, H, I]`` and the six LoRA tensors ``[E, …]`` (these share storage with the
    tensors given). Which of them require grad is the caller's business (``requires_grad_``).
    ``w13`` may be passed pre-fused (``w13=``) to share one copy between several instances.
    """

    def __init__(self, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor,
                 gate_lora_a: Optional[Tensor] = None, gate_lora_b: Optional[Tensor] = None,
                 up_lora_a: Optional[Tensor] = None, up_lora_b: Optional[Tensor] = None,
                 down_lora_a: Optional[Tensor] = None, down_lora_b: Optional[Tensor] = None,
                 lora_scale: float = 1.0, w13: Optional[Tensor] = None):
        super().__init__()
        self.num_experts, self.intermediate, _ = gate_proj.shape
        if w13 is None:
            w13 = torch.cat([gate_proj, up_proj], dim=1)
        self.w13 = nn.Parameter(w13.detach(), requires_grad=False)
        self.w2 = nn.Parameter(down_proj.detach(), requires_grad=False)
        self.lora = gate_lora_a is not None
        self.lora_scale = lora_scale
        if self.lora:
            self.lora_rank = gate_lora_a.shape[1]
            for name, t in (("gate_lora_a", gate_lora_a), ("gate_lora_b", gate_lora_b),
                            ("up_lora_a", up_lora_a), ("up_lora_b", up_lora_b),
                            ("down_lora_a", down_lora_a), ("down_lora_b", down_lora_b)):
                setattr(self, name, nn.Parameter(t.detach(), requires_grad=False))

    def set_trainable(self, names) -> None:
        """``names`` in kt.moe's naming (``gate_proj``, ``up_lora_a``, …) require grad."""
        names = set(names)
        for n, p in self.named_parameters():
            if n == "w13":
                p.requires_grad_(bool(names & {"gate_proj", "up_proj"}))
            elif n == "w2":
                p.requires_grad_("down_proj" in names)
            else:
                p.requires_grad_(n in names)

    def stacked_grads(self, names) -> dict:
        """Gradients in kt.moe's layout (``gate_proj``/``up_proj`` are views of ``w13.grad``)."""
        out = {}
        I = self.intermediate
        for n in names:
            if n in ("gate_proj", "up_proj"):
                g = self.w13.grad
                out[n] = None if g is None else (g[:, :I] if n == "gate_proj" else g[:, I:])
            elif n == "down_proj":
                out[n] = self.w2.grad
            else:
                out[n] = getattr(self, n).grad
        return out

    def forward(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        T, H = hidden_states.shape
        I, s = self.intermediate, self.lora_scale
        token, weight, counts = sort_pairs(topk_ids, topk_weights, self.num_experts)
        xs = hidden_states.index_select(0, token)  # [P, H]
        w13, w2 = self.w13.unbind(0), self.w2.unbind(0)
        if self.lora:
            r = self.lora_rank
            ga, gb = self.gate_lora_a.unbind(0), self.gate_lora_b.unbind(0)
            ua, ub = self.up_lora_a.unbind(0), self.up_lora_b.unbind(0)
            da, db = self.down_lora_a.unbind(0), self.down_lora_b.unbind(0)
        outs = []
        for e, xe in enumerate(xs.split(counts.tolist())):
            if xe.shape[0] == 0:
                continue
            gu = F.linear(xe, w13[e])  # [n, 2I]
            g, u = gu[:, :I], gu[:, I:]
            if self.lora:
                xa = F.linear(xe, torch.cat([ga[e], ua[e]]))  # [n, 2r]
                g = g + s * F.linear(xa[:, :r], gb[e])
                u = u + s * F.linear(xa[:, r:], ub[e])
            h = F.silu(g) * u
            o = F.linear(h, w2[e])
            if self.lora:
                o = o + s * F.linear(F.linear(h, da[e]), db[e])
            outs.append(o)
        out = hidden_states.new_zeros(T, H)
        if outs:
            o = torch.cat(outs) * weight.to(hidden_states.dtype).unsqueeze(1)
            out.index_add_(0, token, o)
        return out


class GroupedMMMoE(SortedMoE):
    """``SortedMoE`` with every per-expert GEMM replaced by one ``torch._grouped_mm`` call.

    ``torch._grouped_mm(a [P, in], b [E, in, out], offs=cumsum(counts) int32)`` is a private
    PyTorch op (CPU support and autograd since 2.9; bf16 and fp32 in eager). Same parameters,
    routing, SwiGLU and ``index_add`` as the parent; LoRA: one grouped GEMM on the concatenated
    ``[Ag; Au]`` and one per B and for the down adapter.
    """

    def forward(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        T, H = hidden_states.shape
        I, s = self.intermediate, self.lora_scale
        gmm = torch._grouped_mm
        token, weight, counts = sort_pairs(topk_ids, topk_weights, self.num_experts)
        offs = counts.cumsum(0).to(torch.int32)
        xs = hidden_states.index_select(0, token)  # [P, H]
        gu = gmm(xs, self.w13.transpose(-2, -1), offs=offs)  # [P, 2I]
        g, u = gu[:, :I], gu[:, I:]
        if self.lora:
            r = self.lora_rank
            a13 = torch.cat([self.gate_lora_a, self.up_lora_a], dim=1)  # [E, 2r, H]
            xa = gmm(xs, a13.transpose(-2, -1), offs=offs)  # [P, 2r]
            g = g + s * gmm(xa[:, :r].contiguous(), self.gate_lora_b.transpose(-2, -1), offs=offs)
            u = u + s * gmm(xa[:, r:].contiguous(), self.up_lora_b.transpose(-2, -1), offs=offs)
        h = F.silu(g) * u
        o = gmm(h, self.w2.transpose(-2, -1), offs=offs)  # [P, H]
        if self.lora:
            ha = gmm(h, self.down_lora_a.transpose(-2, -1), offs=offs)  # [P, r]
            o = o + s * gmm(ha, self.down_lora_b.transpose(-2, -1), offs=offs)
        o = o * weight.to(hidden_states.dtype).unsqueeze(1)
        return hidden_states.new_zeros(T, H).index_add_(0, token, o)
