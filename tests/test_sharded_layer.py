"""KTMoE(expert_shards=S) on gloo ranks equals one process holding all the experts.

Every rank builds the layer from the same seed: each shard owner gets exactly its experts of
the one-process layer (kt_ops.expert_init), LoRA B is set nonzero from one full draw sliced
to the shard. Each rank feeds its own [2, S_r, H] batch (lengths unequal, 0 on some rank in
some step, owners included) and backpropagates L_r = (y_r * c_r).sum(); the router gradients
are averaged over ranks (as DDP would) and every parameter takes an SGD step, 3 steps. With
the layer's gradient semantics the reference (one process, all ranks' batches, loss
(1/W)·Σ_r L_r, the same SGD) must give, fp32, relative error <= 1e-5, at every step:
  * outputs y_r and hidden-state gradients x_r.grad / W;
  * every owner's expert gradients (base / LoRA / scales frozen) == the reference's rows of
    its shard; after 3 steps its expert tensors == the reference's;
  * the expert-gradient norm each rank sees (its own expert gradients and expert_grad_norm's
    .grad) == the reference's expert-gradient norm, on owners and non-owners alike.
Cases: 2 ranks S = 2 (E = 6), 3 ranks S = 2 with E = 7 (shards of 4 and 3, rank 2 owns
nothing), LoRA / full / int8-quantized LoRA. Ranks past the owners hold no expert tensors; an
owner holds only its shard's. Bad arguments (S > E, S > ranks, S = 2 with one rank,
owner_rank with S > 1) raise ValueError naming the numbers.
"""
import pytest
import torch

from distributed_harness import check_all_ok, run_ranks
from test_distributed_layer import H, make_batch, reference_step  # one process on every rank's batch

I, K = 12, 3
TOL = 1e-5
LR = 0.05

MODES = {
    "lora": dict(lora_rank=4, lora_alpha=8.0),
    "full": dict(lora_rank=0, train_base=True),
    "lora-int8": dict(lora_rank=4, lora_alpha=8.0, expert_format="int8"),
}
# (world size, shards, experts, lengths per step)
CASES = {
    "W2-S2-E6": (2, 2, 6, [[3, 5], [0, 4], [6, 0]]),
    "W3-S2-E7": (3, 2, 7, [[2, 0, 5], [4, 3, 1], [0, 0, 6]]),
}
_B_NAMES = ("gate_lora_b", "up_lora_b", "down_lora_b")


def make_layer(mode: str, E: int, seed: int, shards: int = 1, **placement):
    from kt_ops.layer import KTMoE

    torch.manual_seed(seed)
    layer = KTMoE(H, I, E, K, dtype=torch.float32, expert_shards=shards, **MODES[mode], **placement)
    if layer.is_owner and layer.lora_rank:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name in _B_NAMES:
                full = 0.3 * torch.randn((E,) + getattr(layer, name).shape[1:], generator=gen)
                getattr(layer, name).copy_(full[layer.expert_range.start:layer.expert_range.stop])
    return layer




def _expert_names(layer):
    return sorted(n for n, p in layer.named_parameters() if n not in ("gate.weight", "grad_anchor", "expert_grad_norm"))


def train(layer, rank, world_size, seq_lens):
    """Each step: this rank's batch forward and backward, the router gradient averaged over the
    ranks (as DDP would), an SGD step on every parameter. Returns what the tests compare."""
    import torch.distributed as dist

    steps = []
    for step, lens in enumerate(seq_lens):
        x, c = make_batch(step, rank, lens[rank])
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        (y * c).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        seen_norm_sq = sum(grads[n].double().pow(2).sum() for n in _expert_names(layer) if n in grads)
        seen_norm_sq = float(seen_norm_sq) + float(layer.expert_grad_norm.grad.double().pow(2).sum())
        router = layer.gate.weight.grad
        dist.all_reduce(router)
        router /= world_size
        with torch.no_grad():
            for p in layer.parameters():
                if p.requires_grad and p.grad is not None:
                    p -= LR * p.grad
        steps.append(dict(y=y.detach(), x_grad=x.grad, grads=grads, seen_norm=seen_norm_sq ** 0.5))
    return dict(expert_range=(layer.expert_range.start, layer.expert_range.stop), names=_expert_names(layer),
                params={n: p.detach().clone() for n, p in layer.named_parameters()}, steps=steps)


def _worker(rank, world_size, mode, E, shards, seq_lens, seed):
    import kt_ops  # noqa: F401

    return train(make_layer(mode, E, seed, shards), rank, world_size, seq_lens)


def rel_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_layer_equals_one_process(case, mode, monkeypatch):
    world, shards, E, seq_lens = CASES[case]
    seed = 5
    results = check_all_ok(run_ranks(_worker, world, mode, E, shards, seq_lens, seed, timeout_s=180))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref = make_layer(mode, E, seed)
    ref_names = _expert_names(ref)
    from kt_ops.shard_collectives import shard_starts

    starts = shard_starts(E, shards)
    for rank, res in enumerate(results):
        if rank < shards:
            assert res["expert_range"] == (starts[rank], starts[rank + 1])
            assert res["names"] == ref_names
            for n in ref_names:  # only the shard's experts
                assert res["params"][n].shape[0] == starts[rank + 1] - starts[rank], n
        else:
            assert res["names"] == [] and res["expert_range"][0] == res["expert_range"][1]

    for step, lens in enumerate(seq_lens):
        where = f"{case} {mode} step {step} lengths {lens}"
        ref.zero_grad(set_to_none=True)
        xs, ys = reference_step(ref, step, lens, world)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        ref_norm = sum(ref_grads[n].double().pow(2).sum() for n in ref_names if n in ref_grads) ** 0.5
        for rank, res in enumerate(results):
            got = res["steps"][step]
            assert rel_err(got["y"], ys[rank]) <= TOL, f"output of rank {rank}, {where}"
            assert rel_err(got["x_grad"] / world, xs[rank].grad) <= TOL, f"hidden-state gradient, rank {rank}, {where}"
            assert got["seen_norm"] == pytest.approx(float(ref_norm), rel=TOL), f"expert grad norm, rank {rank}, {where}"
            if rank < shards:
                lo, hi = starts[rank], starts[rank + 1]
                for n in ref_names:
                    if n in ref_grads:
                        assert rel_err(got["grads"][n], ref_grads[n][lo:hi]) <= TOL, f"{n}.grad on rank {rank}, {where}"
                    else:
                        assert n not in got["grads"], n
        with torch.no_grad():  # the reference's router gradient is the ranks' average already
            for p in ref.parameters():
                if p.requires_grad and p.grad is not None:
                    p -= LR * p.grad
    ref_params = dict(ref.named_parameters())
    for rank in range(shards):
        lo, hi = starts[rank], starts[rank + 1]
        for n in ref_names:
            assert rel_err(results[rank]["params"][n].float(), ref_params[n][lo:hi].float()) <= TOL, \
                f"{n} after {len(seq_lens)} SGD steps on rank {rank}"
    for rank, res in enumerate(results):
        assert rel_err(res["params"]["gate.weight"], ref.gate.weight) <= TOL, f"router after the steps, rank {rank}"


def _bad_worker(rank, world_size, kwargs):
    from kt_ops.layer import KTMoE

    KTMoE(H, I, 4, 2, dtype=torch.float32, **kwargs)
    return "built"


@pytest.mark.parametrize("kwargs,world,match", [
    (dict(expert_shards=5), 2, r"expert_shards=5 is more than the 4 experts"),
    (dict(expert_shards=3), 2, r"expert_shards=3 needs 3 ranks to own the shards, but the job has 2 ranks"),
    (dict(expert_shards=2), 1, r"expert_shards=2 needs 2 ranks to own the shards, but the job has 1 rank$"),
    (dict(expert_shards=2, owner_rank=1), 2, r"leave owner_rank at 0"),
    (dict(expert_shards=0), 2, r"expert_shards must be an int >= 1"),
], ids=["S>E", "S>ranks", "S2-one-rank", "owner_rank", "S0"])
def test_bad_shards_raise_on_every_rank(kwargs, world, match):
    import re

    results = run_ranks(_bad_worker, world, kwargs, timeout_s=60)
    for r, res in enumerate(results):
        assert not isinstance(res, str), f"rank {r} built the layer"
        assert res.type_name == "ValueError" and re.search(match, res.message), res.message


def _mismatch_worker(rank, world_size, shards_by_rank):
    import kt_ops  # noqa: F401

    torch.manual_seed(0)
    layer = make_layer("lora", 6, 0, shards_by_rank[rank])
    x = torch.randn(2, 3, H, requires_grad=True)
    layer(x).sum().backward()
    return "ran"


@pytest.mark.parametrize("shards_by_rank", [(2, 1), (2, 3, 2)], ids=["S2-vs-S1", "S2-vs-S3"])
def test_ranks_with_different_shards_raise_on_every_rank(shards_by_rank):
    """Ranks built with different expert_shards meet in their first collective, whose header
    differs (the op, or the expert layout): every rank raises, none hangs."""
    results = run_ranks(_mismatch_worker, len(shards_by_rank), shards_by_rank, timeout_s=60)
    for r, res in enumerate(results):
        assert not isinstance(res, str), f"rank {r} ran"
        assert "out of step" in res.message, res.message


PER_NODE_LENGTHS = [[3, 5, 0, 4], [6, 2, 7, 1], [0, 0, 2, 5]]


def _per_node_worker(rank, world_size, mode, E, seed):
    import os

    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    return train(make_layer(mode, E, seed, 2, owners="per-node"), rank, world_size, PER_NODE_LENGTHS)


def test_two_nodes_of_two_shards_equal_one_process(monkeypatch):
    """4 processes as 2 nodes x 2 ranks (torchrun's environment), owners="per-node",
    expert_shards=2: each node's local rank s holds shard s, its tokens go to its own node's
    owners, and shard s's owners on the two nodes average their gradients. Outputs, hidden-state
    gradients, expert gradients (equal on both replicas of a shard) and 3 SGD steps equal one
    process on the 4 ranks' batches (E = 7: shards of 4 and 3)."""
    E, seed, world = 7, 5, 4
    results = check_all_ok(run_ranks(_per_node_worker, world, "lora", E, seed, timeout_s=180))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref = make_layer("lora", E, seed)
    names = _expert_names(ref)
    for step, lens in enumerate(PER_NODE_LENGTHS):
        ref.zero_grad(set_to_none=True)
        xs, ys = reference_step(ref, step, lens, world)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        for rank, res in enumerate(results):
            got, where = res["steps"][step], f"rank {rank}, step {step}"
            assert rel_err(got["y"], ys[rank]) <= TOL, f"output, {where}"
            assert rel_err(got["x_grad"] / world, xs[rank].grad) <= TOL, f"hidden-state gradient, {where}"
            lo, hi = res["expert_range"]
            assert (lo, hi) == ((0, 4) if rank % 2 == 0 else (4, 7))
            for n in names:
                if n in ref_grads:
                    assert rel_err(got["grads"][n], ref_grads[n][lo:hi]) <= TOL, f"{n}.grad, {where}"
        with torch.no_grad():
            for p in ref.parameters():
                if p.requires_grad and p.grad is not None:
                    p -= LR * p.grad
    ref_params = dict(ref.named_parameters())
    for rank, res in enumerate(results):
        lo, hi = res["expert_range"]
        for n in names:
            assert rel_err(res["params"][n], ref_params[n][lo:hi]) <= TOL, f"{n} after the steps, rank {rank}"
