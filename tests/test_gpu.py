"""GPU-side use (skipped without CUDA): hidden states and router on the GPU, experts on the
CPU; compiled with inductor; the collectives on an NCCL group."""
import pytest
import torch

import kt_ops
from distributed_harness import check_all_ok, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_layer():
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(64, 48, 8, 2, lora_rank=4, dtype=torch.float32)
    with torch.no_grad():
        for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
            getattr(layer, name).normal_(std=0.1)
    return layer


def step(layer, fn, x):
    x = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    y = fn(x)
    (y * torch.arange(y.numel(), device=y.device).view_as(y).sin()).sum().backward()
    # clone: moving the module later moves its .grad tensors in place
    return [t.detach().cpu().clone() for t in [y, x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cuda_hidden_states_match_cpu(backend):
    layer = make_layer()
    x = torch.randn(3, 7, 64)
    want = step(layer, layer, x)
    layer.cuda()
    assert layer.gate.weight.is_cuda and not layer.gate_proj.is_cuda  # experts stay on the CPU
    fn = layer if backend == "eager" else torch.compile(layer, backend=backend, fullgraph=True)
    got = step(layer, fn, x.cuda())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def nccl_collectives(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(ranks=list(range(world_size)), backend="nccl")
    x = torch.randn(5, 3, device="cuda", requires_grad=True)
    ids = torch.arange(10, device="cuda").view(5, 2)
    (gx, gids), lengths = kt_ops.gather_to_owner([x, ids], 0, group=group, tag=7)
    assert lengths.tolist() == [5] and torch.equal(gx, x) and torch.equal(gids, ids)
    (back,) = kt_ops.scatter_from_owner([gx * 2], lengths, 5, 0, group=group, tag=7)
    back.sum().backward()
    assert torch.equal(back, 2 * x) and torch.equal(x.grad, torch.full_like(x, 2.0))
    return True


def test_collectives_on_nccl_group():
    assert check_all_ok(run_ranks(nccl_collectives, 1, timeout_s=120)) == [True]


def nccl_shard_collectives(rank, world_size):
    """The sharded layer's all-to-all on CUDA tensors in an NCCL group (one rank, one shard):
    dispatch sends the tokens with an expert (an all -1 token stays home), combine brings them
    back, and the gradients are each other's."""
    import torch.distributed as dist

    group = dist.new_group(ranks=list(range(world_size)), backend="nccl")
    name = group.group_name
    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    w = torch.rand(4, 2, device="cuda", requires_grad=True)
    ids = torch.tensor([[0, 5], [-1, -1], [2, -1], [7, 1]], device="cuda")
    (xr,), (wr,), local, counts = torch.ops.kt.dispatch_to_shards([x], [w], ids, [0, 8], 0, 1, 7, name)
    kept = torch.tensor([0, 2, 3], device="cuda")
    assert counts.tolist() == [3] and torch.equal(xr, x[kept]) and torch.equal(local, ids[kept])
    (y,), (wc,) = torch.ops.kt.combine_from_shards([xr * 2], [wr], ids, counts, [0, 8], 0, 1, 7, name)
    assert torch.equal(y[kept], 2 * x[kept]) and (y[1] == 0).all()
    assert torch.equal(wc, w.masked_fill(ids < 0, 0))
    (y.sum() + wc.sum()).backward()
    assert torch.equal(x.grad[kept], torch.full_like(x[kept], 2.0)) and (x.grad[1] == 0).all()
    assert torch.equal(w.grad, (ids >= 0).float())
    return True


def test_shard_collectives_on_nccl_group():
    assert check_all_ok(run_ranks(nccl_shard_collectives, 1, timeout_s=120)) == [True]
