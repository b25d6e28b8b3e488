"""A small but complete MoE language model built on KTMoE, for the compile tests:
embedding → [RMSNorm → causal attention → RMSNorm → KT MoE] × L → RMSNorm → LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kt_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype)
        self.out = nn.Linear(dim, dim, bias=False, dtype=dtype)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim, heads, intermediate, experts, top_k, lora_rank, dtype, **moe_kwargs):
        super().__init__()
        self.attn_norm = RMSNorm(dim, dtype=dtype)
        self.attn = Attention(dim, heads, dtype=dtype)
        self.moe_norm = RMSNorm(dim, dtype=dtype)
        self.moe = kt_ops.KTMoE(dim, intermediate, experts, top_k, lora_rank=lora_rank, dtype=dtype,
                                **moe_kwargs)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class TinyMoELM(nn.Module):
    """``checkpointing``: None, "kt" (kt_ops' policy) or "plain" (torch's default)."""

    def __init__(self, vocab=64, dim=32, heads=4, intermediate=24, experts=6, top_k=2, layers=2,
                 lora_rank=4, dtype=torch.float32, checkpointing=None, **moe_kwargs):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.blocks = nn.ModuleList(Block(dim, heads, intermediate, experts, top_k, lora_rank, dtype,
                                          **moe_kwargs) for _ in range(layers))
        self.norm = RMSNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.checkpointing = checkpointing

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing == "kt":
                x = kt_ops.checkpoint(block, x)
            elif self.checkpointing == "plain":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def make_lora_trainable(model: nn.Module, seed: int = 1) -> None:
    """LoRA B starts at zero (PEFT); give it values so that LoRA A gets real gradients. A shard's
    owner (expert_shards > 1) takes its experts' rows of the values all experts get."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_lora_b"):
                layer = model.get_submodule(name.rpartition(".")[0])
                full = torch.randn((layer.num_experts,) + p.shape[1:], generator=g, dtype=torch.float32)
                p.copy_(full[layer.expert_range.start:layer.expert_range.stop].to(p.dtype) * 0.1)
