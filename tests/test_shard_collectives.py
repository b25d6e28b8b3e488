"""kt.dispatch_to_shards / kt.combine_from_shards / kt.dispatch_to_shards_sized (the sharded
layer's all-to-all) on real gloo groups of 2 and 3 local ranks (distributed_harness.py: every
run bounded by a timeout).

What is shown, against a plain rebuild of every rank's inputs here in the test process:
* dispatch: each owner (group rank s < S) receives, in source-rank then token order, exactly
  the rows of the tokens with an expert in its shard, their routing weights with the other
  shards' slots zeroed, and their local expert ids (-1 for other shards' slots); ranks past
  the S owners receive nothing; ids of -1 go nowhere; ranks with 0 tokens, S = 2 of 2 and 3
  ranks, S = 3 of 3, E not divisible by S;
* combine: each token gets the sum of its shards' rows (in float64 here, so exact) and each
  slot the value its expert's shard sent;
* they are each other's adjoint (float64 inner products), and the gradients autograd computes
  through dispatch, dispatch_sized and combine are those adjoints;
* opcheck passes for the three ops (1-rank group, S = 1);
* ranks whose expert_starts differ raise on every rank, naming the expert shards.
"""
import pytest
import torch

from distributed_harness import RankError, check_all_ok, run_ranks

from kt_ops.shard_collectives import shard_starts

# (world_size, shards, experts, tokens per rank)
CASES = [(2, 2, 6, [5, 3]), (2, 2, 5, [0, 4]), (3, 2, 7, [4, 0, 6]), (3, 3, 7, [3, 5, 2])]
CASE_IDS = [f"W{w}-S{s}-E{e}-T{'_'.join(map(str, t))}" for w, s, e, t in CASES]
K = 3


def rank_inputs(case: int, rank: int, T: int, E: int):
    """x [T, 4] f64, weights [T, K] f64, ids [T, K] (distinct per token, a few -1), y [T, 4]."""
    gen = torch.Generator().manual_seed(100 * case + rank)
    x = torch.randn(T, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(T, K, generator=gen, dtype=torch.float64)
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    ids[torch.rand(T, K, generator=gen) < 0.2] = -1
    return x, w, ids


def _worker(rank, world_size, case, shards, E, lengths):
    import torch.distributed as dist

    import kt_ops  # noqa: F401

    name = dist.group.WORLD.group_name
    starts = shard_starts(E, shards)
    x, w, ids = rank_inputs(case, rank, lengths[rank], E)
    x.requires_grad_(True)
    w.requires_grad_(True)
    (xr,), (wr,), local_ids, counts = torch.ops.kt.dispatch_to_shards([x], [w], ids, starts, rank, world_size, 7,
                                                                      name)
    # What an owner sends back: its own deterministic rows, so the test can rebuild them.
    gen = torch.Generator().manual_seed(9000 + rank)
    back_rows = torch.randn(xr.shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    back_slots = torch.randn(wr.shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    (yc,), (wc,) = torch.ops.kt.combine_from_shards([back_rows], [back_slots], ids, counts, starts, rank,
                                                    world_size, 7, name)
    # Adjoint check: <dispatch(x), (back_rows, back_slots)> summed over ranks equals
    # <x, combine(back)> summed over ranks; the gradients are the adjoint ops' results.
    inner_dispatch = (xr * back_rows.detach()).sum() + (wr * back_slots.detach()).sum()
    inner_combine = (x.detach() * yc).sum() + (w.detach() * wc).sum()
    inner_dispatch.backward()
    inner_combine.backward()
    return {"xr": xr.detach(), "wr": wr.detach(), "local_ids": local_ids, "counts": counts,
            "back_rows": back_rows.detach(), "back_slots": back_slots.detach(), "yc": yc.detach(),
            "wc": wc.detach(), "inner_dispatch": inner_dispatch.item(), "inner_combine": inner_combine.item(),
            "x_grad": x.grad, "w_grad": w.grad, "back_rows_grad": back_rows.grad, "back_slots_grad": back_slots.grad}


_results = {}


def _run(index):
    if index not in _results:
        world, shards, E, lengths = CASES[index]
        _results[index] = check_all_ok(run_ranks(_worker, world, index, shards, E, lengths, timeout_s=120))
    return _results[index]


def expected_dispatch(index):
    """Per owner s: (rows, weights, local ids, counts per source) rebuilt from every rank's inputs."""
    world, shards, E, lengths = CASES[index]
    starts = shard_starts(E, shards)
    per_owner = []
    for s in range(world):
        rows, weights, local, counts = [], [], [], []
        for r in range(world):
            x, w, ids = rank_inputs(index, r, lengths[r], E)
            in_shard = (ids >= starts[s]) & (ids < starts[s + 1]) if s < shards else torch.zeros_like(ids, dtype=bool)
            hit = in_shard.any(dim=1)
            rows.append(x[hit])
            weights.append(torch.where(in_shard, w, 0.0)[hit])
            local.append(torch.where(in_shard, ids - (starts[s] if s < shards else 0), -1)[hit])
            counts.append(int(hit.sum()))
        per_owner.append((torch.cat(rows), torch.cat(weights), torch.cat(local), torch.tensor(counts)))
    return per_owner


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASE_IDS)
def test_dispatch_sends_each_token_to_its_shards(index):
    results = _run(index)
    for s, (rows, weights, local, counts) in enumerate(expected_dispatch(index)):
        res = results[s]
        torch.testing.assert_close(res["xr"], rows, rtol=0, atol=0, msg=lambda m: f"rows on rank {s}: {m}")
        torch.testing.assert_close(res["wr"], weights, rtol=0, atol=0, msg=lambda m: f"weights on rank {s}: {m}")
        torch.testing.assert_close(res["local_ids"], local, rtol=0, atol=0, msg=lambda m: f"ids on rank {s}: {m}")
        assert res["counts"].tolist() == counts.tolist(), f"recv_counts on rank {s}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASE_IDS)
def test_combine_sums_rows_and_picks_each_slot_from_its_shard(index):
    world, shards, E, lengths = CASES[index]
    starts = shard_starts(E, shards)
    results = _run(index)
    # offset of each source rank's rows in each owner's received block
    offsets = [[sum(results[s]["counts"][:r].tolist()) for r in range(world)] for s in range(world)]
    for r in range(world):
        x, w, ids = rank_inputs(index, r, lengths[r], E)
        y = torch.zeros_like(x)
        wc = torch.zeros_like(w)
        for s in range(shards):
            in_shard = (ids >= starts[s]) & (ids < starts[s + 1])
            tokens = in_shard.any(dim=1).nonzero().flatten()
            block = slice(offsets[s][r], offsets[s][r] + len(tokens))
            y[tokens] += results[s]["back_rows"][block]
            wc[tokens] = torch.where(in_shard[tokens], results[s]["back_slots"][block], wc[tokens])
        torch.testing.assert_close(results[r]["yc"], y, rtol=0, atol=1e-15, msg=lambda m: f"rows on rank {r}: {m}")
        torch.testing.assert_close(results[r]["wc"], wc, rtol=0, atol=0, msg=lambda m: f"slots on rank {r}: {m}")
        assert (wc[ids < 0] == 0).all()


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASE_IDS)
def test_dispatch_and_combine_are_adjoint_and_autograd_uses_them(index):
    results = _run(index)
    lhs = sum(r["inner_dispatch"] for r in results)
    rhs = sum(r["inner_combine"] for r in results)
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    for r, res in enumerate(results):
        # d<dispatch(x), back>/dx = combine(back); d<x, combine(back)>/d back = dispatch(x)
        torch.testing.assert_close(res["x_grad"], res["yc"], rtol=0, atol=1e-15, msg=lambda m: f"x.grad, rank {r}: {m}")
        torch.testing.assert_close(res["w_grad"], res["wc"], rtol=0, atol=0, msg=lambda m: f"w.grad, rank {r}: {m}")
        torch.testing.assert_close(res["back_rows_grad"], res["xr"], rtol=0, atol=0)
        torch.testing.assert_close(res["back_slots_grad"], res["wr"], rtol=0, atol=0)


def _opcheck_worker(rank, world_size):
    import torch.distributed as dist

    import kt_ops  # noqa: F401

    name = dist.group.WORLD.group_name
    report = {}
    gen = torch.Generator().manual_seed(0)
    for T in (5, 0):
        x = torch.randn(T, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.randn(T, 2, generator=gen, requires_grad=True)
        ids = torch.randint(-1, 6, (T, 2), generator=gen)
        _rows, _slots, _local, counts = torch.ops.kt.dispatch_to_shards([x], [w], ids, [0, 6], 0, 1, 3, name)
        n = int(counts.sum())
        back = torch.randn(n, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        back_w = torch.randn(n, 2, generator=gen, requires_grad=True)
        cases = {
            "dispatch_to_shards": (torch.ops.kt.dispatch_to_shards, ([x], [w], ids, [0, 6], 0, 1, 3, name)),
            "dispatch_to_shards_sized": (torch.ops.kt.dispatch_to_shards_sized,
                                         ([x], [w], ids, counts, n, [0, 6], 0, 1, 3, name)),
            "combine_from_shards": (torch.ops.kt.combine_from_shards,
                                    ([back], [back_w], ids, counts, [0, 6], 0, 1, 3, name)),
        }
        for op_name, (op, args) in cases.items():
            torch.library.opcheck(op, args)  # raises on failure
            report[f"{op_name} T={T}"] = "ok"
    return report


def test_opcheck_shard_collectives():
    """torch.library.opcheck (schema, autograd registration, fake vs real kernel, AOTAutograd
    with dynamic shapes) on the three ops, T = 5 and 0, in a 1-rank gloo group (S = 1)."""
    (report,) = check_all_ok(run_ranks(_opcheck_worker, 1, timeout_s=120))
    assert len(report) == 6, report


def _mismatch_worker(rank, world_size):
    import torch.distributed as dist

    import kt_ops  # noqa: F401

    ids = torch.tensor([[0, 3]])
    starts = [0, 2, 4] if rank == 0 else [0, 3, 4]  # ranks disagree on the shards
    torch.ops.kt.dispatch_to_shards([torch.ones(1, 2)], [torch.ones(1, 2)], ids, starts, rank, world_size, 1,
                                    dist.group.WORLD.group_name)
    return "no error"


def test_mismatched_shards_raise_on_every_rank():
    results = run_ranks(_mismatch_worker, 2, timeout_s=60)
    for r, res in enumerate(results):
        assert isinstance(res, RankError), f"rank {r} did not raise: {res}"
        assert "expert shards" in res.message, res.message
