"""One owner per node: 4 gloo processes as 2 "nodes" of 2 ranks. Each node's tokens go to its
own owner (``process_group`` = the node's ranks, ``owner_rank=0`` within it), and the two
owners average their expert gradients over ``expert_replica_group`` (the owners' group). The
whole equals one process on the 4 ranks' batches with loss (1/4)·Σ_r L_r (fp32, 1e-5): outputs,
hidden-state gradients, the owners' expert gradients (equal on both owners) and the average of
the router gradients; then an SGD step keeps the two replicas of the experts equal. The same
with ``owners="per-node"``, the layout read from torchrun's environment (kt_ops.placement)."""
import pytest
import torch

from distributed_harness import check_all_ok, run_ranks
from test_distributed_layer import E, H, I, K, make_batch, reference_step, rel_err

NODES, PER_NODE = 2, 2
LENGTHS = [(3, 5, 0, 4), (6, 2, 7, 1)]  # per step, per global rank (0 rows on a rank in step 0)
LORA = dict(lora_rank=4, lora_alpha=8.0)


def make_layer(process_group=None, replica_group=None, seed=5, **placement):
    from kt_ops.layer import KTMoE

    torch.manual_seed(seed)
    layer = KTMoE(H, I, E, K, dtype=torch.float32, process_group=process_group, expert_replica_group=replica_group,
                  **LORA, **placement)
    if layer.is_owner:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
                getattr(layer, name).copy_(0.3 * torch.randn(getattr(layer, name).shape, generator=gen))
    return layer


def _worker(rank, world_size, placement="by hand"):
    import os

    import torch.distributed as dist

    import kt_ops  # noqa: F401

    if placement == "by hand":
        nodes = [dist.new_group(list(range(n * PER_NODE, (n + 1) * PER_NODE))) for n in range(NODES)]
        owners = dist.new_group([n * PER_NODE for n in range(NODES)])
        layer = make_layer(nodes[rank // PER_NODE], owners)
    else:  # torchrun's environment of 2 nodes of 2 ranks; the groups made at the first forward
        os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                          GROUP_RANK=str(rank // PER_NODE))
        layer = make_layer(owners=placement)
        assert (layer.rank, layer.world_size, layer.owner_rank) == (rank % PER_NODE, PER_NODE, 0)
    steps = []
    for step, lens in enumerate(LENGTHS):
        x, c = make_batch(step, rank, lens[rank])
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        (y * c).sum().backward()
        steps.append(dict(y=y.detach(), x_grad=x.grad,
                          grads={n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}))
    # One SGD step with the last gradients: the owners' replicas stay equal.
    with torch.no_grad():
        for p in layer.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    after = {n: p.detach().clone() for n, p in layer.named_parameters() if "lora" in n}
    return dict(is_owner=layer.is_owner, steps=steps, after=after)


@pytest.mark.parametrize("placement", ["by hand", "per-node"])
def test_two_nodes_of_two_ranks_equal_one_process(monkeypatch, placement):
    results = check_all_ok(run_ranks(_worker, NODES * PER_NODE, placement, timeout_s=180, pg_timeout_s=120))
    assert [r["is_owner"] for r in results] == [True, False, True, False]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref = make_layer()
    world = NODES * PER_NODE
    lora_names = [n for n, _ in ref.named_parameters() if "lora" in n]
    for step, lens in enumerate(LENGTHS):
        ref.zero_grad(set_to_none=True)
        xs, ys = reference_step(ref, step, lens, world)
        for rank, res in enumerate(results):
            got = res["steps"][step]
            if lens[rank]:
                assert rel_err(got["y"], ys[rank]) <= 1e-5, (step, rank)
                assert rel_err(got["x_grad"] / world, xs[rank].grad) <= 1e-5, (step, rank)
        router = sum(res["steps"][step]["grads"]["gate.weight"] for res in results) / world
        assert rel_err(router, ref.gate.weight.grad) <= 1e-5, step
        for owner in (0, PER_NODE):
            grads = results[owner]["steps"][step]["grads"]
            for name in lora_names:
                assert rel_err(grads[name], dict(ref.named_parameters())[name].grad) <= 1e-5, (step, owner, name)
    for name in lora_names:
        torch.testing.assert_close(results[0]["after"][name], results[PER_NODE]["after"][name], rtol=0, atol=0)
    assert results[1]["after"] == {} and results[3]["after"] == {}


def test_replica_group_needs_no_hook_without_replicas():
    """A single owner (no replica group, or a group of one) registers no gradient hook."""
    layer = make_layer()
    assert not any(hasattr(p, "_kt_replica_hook") for p in layer.parameters())


def test_patch_model_passes_the_replica_group(monkeypatch):
    """patch_model hands expert_replica_group to every KT layer (checked without processes)."""
    pytest.importorskip("transformers")
    import kt_ops
    from kt_ops.hf.patch import patched_experts
    from test_quantized_layer import tiny_qwen3_moe

    sentinel = object()
    monkeypatch.setattr(kt_ops.KTMoE, "register_gradient_hooks", lambda self: None)
    model = kt_ops.patch_model(tiny_qwen3_moe(torch.float32), lora_rank=2, expert_replica_group=sentinel)
    assert all(kt.expert_replica_group is sentinel for _, kt in patched_experts(model))
