"""kt.moe under CPU autocast (transformers' Trainer with ``bf16=True`` on a CPU, TRL's default
there): the kernels compute in their inputs' dtypes, so the result and every gradient equal
those without autocast, for float32 and bfloat16 inputs, with LoRA. (The ATen calls inside
the kernels once ran under autocast and broke an internal buffer check.)"""
import pytest
import torch

import kt_ops
from moe_testing import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [8, 512])  # the decode path and the blocked GEMM path
def test_moe_under_cpu_autocast_equals_plain(dtype, tokens):
    E, H, I, K, r = 4, 64, 32, 2, 4
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, w = rand(tokens, H, scale=1.0), torch.rand(tokens, K, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, K), generator=g)
    base = (rand(E, I, H), rand(E, I, H), rand(E, H, I))
    lora = [rand(E, r, H), rand(E, I, r), rand(E, r, H), rand(E, I, r), rand(E, r, I), rand(E, H, r)]

    def run(autocast):
        leaves = [t.clone().requires_grad_() for t in [x, w] + lora]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = kt_ops.moe(leaves[0], ids, leaves[1], *base, *leaves[2:], 2.0)
        out.float().square().sum().backward()
        return [out] + [t.grad for t in leaves]

    want, got = run(False), run(True)
    assert got[0].dtype == dtype
    for a, b in zip(got, want):
        assert rel_err(a, b) == 0.0
