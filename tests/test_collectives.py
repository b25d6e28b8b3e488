"""kt.gather_to_owner / kt.scatter_from_owner on real gloo process groups (2 and 3 local
ranks, see distributed_harness.py: every run is bounded by a timeout, a hang fails).

What is shown:
* gather concatenates every rank's rows on the owner in rank order (0 rows elsewhere) and
  returns every rank's row count on every rank; scatter gives each rank its slice of the
  owner's rows; for every owner rank (not only 0), per-rank lengths that change from call
  to call and include 0 (also on the owner, also on all ranks at once), several dtypes
  (fp32, bf16, int64, float64) and trailing shapes (none, [4], [2, 3], non-contiguous) in
  one call;
* they are each other's adjoint: sum_r <scatter(y)_r, x_r> == <y, gather(x)>, and the
  gradients autograd computes through them are exactly those adjoints;
* torch.library.opcheck passes for both ops (in a group of size 1);
* the dead-collective trap is closed: a non-owner rank whose gather output is unused still
  sends its rows when compiled with inductor, and the compiled code contains the call.

The pytest process itself never initializes a process group: everything distributed runs
in the spawned ranks, and the checks run here on the returned tensors.
"""
import time

import pytest
import torch

from distributed_harness import check_all_ok, run_ranks

# Per-call lengths, one list per call: zeros on single ranks, on the owner, on all ranks.
STEPS = {
    2: [[3, 5], [0, 4], [6, 0], [0, 0], [1, 7]],
    3: [[2, 0, 5], [4, 3, 0], [0, 0, 0], [1, 2, 3], [0, 6, 0]],
}


def make_rows(call: int, rank: int, n: int):
    """This rank's tensors of one call (deterministic, so the test can rebuild every rank's)."""
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return [
        torch.randn(n, 4, generator=gen),                                   # fp32 [n, 4]
        torch.randn(n, 2, 3, generator=gen).to(torch.bfloat16),             # bf16 [n, 2, 3]
        torch.randint(-2**40, 2**40, (n,), generator=gen, dtype=torch.int64),  # int64 [n]
        torch.randn(3, n, generator=gen, dtype=torch.float64).t(),          # f64, non-contiguous
    ]


def make_owner_rows(call: int, lengths):
    """The owner's rows to scatter in one call: [sum(lengths), 5] fp32 and [sum, 2] int64."""
    gen = torch.Generator().manual_seed(50_000 + call)
    n = sum(lengths)
    return [torch.randn(n, 5, generator=gen), torch.randint(0, 1000, (n, 2), generator=gen)]


def _collectives_worker(rank, world_size, steps):
    """For every owner and every call: gather, scatter, and the autograd adjoint check."""
    import kt_ops

    out = []
    for owner in range(world_size):
        for call, lengths in enumerate(steps):
            n = lengths[rank]
            tensors = make_rows(call, rank, n)
            gathered, got_lengths = kt_ops.gather_to_owner(tensors, owner, tag=call)

            ys = make_owner_rows(call, lengths)
            if rank != owner:
                ys = [y[:0] for y in ys]
            scattered = kt_ops.scatter_from_owner(ys, got_lengths, n, owner, tag=call)

            # Adjoint, through autograd: x (every rank), y (owner; 0 rows elsewhere).
            gen = torch.Generator().manual_seed(7 + 100 * call + rank)
            x = torch.randn(n, 3, generator=gen, dtype=torch.float64, requires_grad=True)
            y = torch.randn(sum(lengths) if rank == owner else 0, 3, generator=gen,
                            dtype=torch.float64, requires_grad=True)
            (gx,), lens = kt_ops.gather_to_owner([x], owner, tag=call)
            (sy,) = kt_ops.scatter_from_owner([y], lens, n, owner, tag=call)
            # <y, gather(x)> (differentiated in x only), <scatter(y)_r, x_r> (in y only)
            inner_y_gx = (y.detach() * gx).sum() if rank == owner else gx.sum() * 0
            inner_sy_x = (sy * x.detach()).sum()
            # Every rank runs the same backward collectives (also with 0 rows).
            torch.autograd.backward([inner_y_gx, inner_sy_x])
            out.append(dict(owner=owner, call=call, lengths=lengths, gathered=gathered,
                            got_lengths=got_lengths, scattered=scattered, x=x.detach(), y=y.detach(),
                            gx=gx.detach(), sy=sy.detach(), x_grad=x.grad, y_grad=y.grad,
                            inner_y_gx=inner_y_gx.item(), inner_sy_x=inner_sy_x.item()))
    return out


_results = {}


def _run(world_size):
    if world_size not in _results:
        start = time.monotonic()
        _results[world_size] = check_all_ok(
            run_ranks(_collectives_worker, world_size, STEPS[world_size], timeout_s=120))
        print(f"\n{world_size}-rank collectives run: {time.monotonic() - start:.1f} s")
    return _results[world_size]


def _assert_equal(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: values differ"


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_and_scatter_rows(world_size):
    """Gather: the owner gets every rank's rows (all dtypes/trailing shapes of one call) in rank
    order, other ranks get 0 rows, every rank gets the lengths. Scatter: each rank gets its
    slice of the owner's rows. For every owner rank and changing lengths incl. zeros."""
    results = _run(world_size)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            owner, call, lengths = res["owner"], res["call"], res["lengths"]
            where = f"rank {rank}, owner {owner}, lengths {lengths}"
            _assert_equal(res["got_lengths"], torch.tensor(lengths, dtype=torch.int64), f"lengths on {where}")
            every = [make_rows(call, r, lengths[r]) for r in range(world_size)]
            for i, got in enumerate(res["gathered"]):
                expected = torch.cat([t[i] for t in every])
                if rank != owner:
                    expected = expected[:0]
                _assert_equal(got, expected, f"gathered[{i}] on {where}")
            start = sum(lengths[:rank])
            for i, (got, full) in enumerate(zip(res["scattered"], make_owner_rows(call, lengths))):
                _assert_equal(got, full[start:start + lengths[rank]], f"scattered[{i}] on {where}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_scatter_adjoint(world_size):
    """sum_r <scatter(y)_r, x_r> == <y, gather(x)>, and autograd's gradients through the ops
    are the adjoints: d<y, gather(x)>/dx_r == scatter(y)_r, d sum_r <scatter(y)_r, x_r>/dy ==
    gather(x) (float64)."""
    results = _run(world_size)
    for call_index in range(len(results[0])):
        per_rank = [results[r][call_index] for r in range(world_size)]
        owner = per_rank[0]["owner"]
        where = f"owner {owner}, lengths {per_rank[0]['lengths']}"
        lhs = sum(res["inner_sy_x"] for res in per_rank)
        rhs = per_rank[owner]["inner_y_gx"]
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12), where
        y, gx = per_rank[owner]["y"], per_rank[owner]["gx"]
        torch.testing.assert_close(gx, torch.cat([res["x"] for res in per_rank]), rtol=0, atol=0)
        start = 0
        for rank, res in enumerate(per_rank):
            n = res["x"].shape[0]
            torch.testing.assert_close(res["sy"], y[start:start + n], rtol=0, atol=0)
            # the gradient of x_r is the scatter of y; the owner's y gets the gather of x
            torch.testing.assert_close(res["x_grad"], y[start:start + n], rtol=0, atol=0,
                                       msg=lambda m: f"x.grad on rank {rank}, {where}: {m}")
            start += n
            expected_y_grad = gx if rank == owner else torch.zeros(0, 3, dtype=torch.float64)
            torch.testing.assert_close(res["y_grad"], expected_y_grad, rtol=0, atol=0,
                                       msg=lambda m: f"y.grad on rank {rank}, {where}: {m}")


# ---- opcheck, in a process group of size 1 ------------------------------------------------

def _opcheck_worker(rank, world_size):
    import torch.distributed as dist

    import kt_ops  # noqa: F401

    name = dist.group.WORLD.group_name
    report = {}
    gen = torch.Generator().manual_seed(0)
    for T in (5, 0):
        x = torch.randn(T, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.randn(T, 2, 3, generator=gen, requires_grad=True)
        ids = torch.randint(0, 8, (T, 2), generator=gen)
        lengths = torch.tensor([T])
        cases = {
            "gather_to_owner": (torch.ops.kt.gather_to_owner, ([x, ids, w], 0, 1, 0, 3, name)),
            "scatter_from_owner": (torch.ops.kt.scatter_from_owner, ([x, w, ids], lengths, T, 0, 1, 0, 3, name)),
            "gather_to_owner_sized": (torch.ops.kt.gather_to_owner_sized, ([w, x], lengths, T, 0, 1, 0, 3, name)),
        }
        for op_name, (op, args) in cases.items():
            torch.library.opcheck(op, args)  # raises on failure
            report[f"{op_name} T={T}"] = "ok"
    return report


def test_opcheck_collectives():
    """torch.library.opcheck (schema, autograd registration, fake kernel vs real kernel,
    AOTAutograd with dynamic shapes) on gather_to_owner, scatter_from_owner and
    gather_to_owner_sized, with mixed dtypes and 0 rows, in a 1-rank gloo group."""
    (report,) = check_all_ok(run_ranks(_opcheck_worker, 1, timeout_s=120))
    assert len(report) == 6, report


# ---- the dead-collective trap under inductor -----------------------------------------------

def _unused_gather(x, tag, group_name):
    """A non-owner's call whose gather output feeds nothing: inductor would delete it unless
    the op is declared side-effectful, and the owner would then wait forever."""
    torch.ops.kt.gather_to_owner([x], 1, 2, 0, tag, group_name)
    return x * 2


def _dead_code_worker(rank, world_size):
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    import kt_ops

    inductor_config.force_disable_caches = True  # the generated code must come from this build
    name = dist.group.WORLD.group_name
    out = {"received": [], "codes": None}
    shapes = [(3, 4), (0, 4), (5, 4)]  # rank 1's rows per call (also 0 rows)
    with torch.no_grad():
        if rank == 0:
            for call, shape in enumerate(shapes):
                mine = torch.full((2, 4), -1.0)
                (rows,), lengths = kt_ops.gather_to_owner([mine], 0, tag=5)
                out["received"].append((rows, lengths))
        else:
            compiled = torch.compile(_unused_gather, backend="inductor", fullgraph=True)
            for call, shape in enumerate(shapes):
                x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + 100 * call
                start = time.monotonic()
                if call == 0:
                    result, codes = run_and_get_code(compiled, x, 5, name)
                    out["codes"] = codes
                else:
                    result = compiled(x, 5, name)
                out.setdefault("call_s", []).append(time.monotonic() - start)
                torch.testing.assert_close(result, x * 2)
                out["received"].append(x)
    return out


def test_inductor_keeps_unused_gather():
    """On the non-owner, an inductor-compiled function calls kt.gather_to_owner and returns
    something independent of its output (under no_grad). The owner (eager) still receives the
    non-owner's rows, right, on every call (0 rows and changing shapes too), and the code
    inductor generated for the non-owner contains the kt.gather_to_owner call."""
    owner, non_owner = check_all_ok(run_ranks(_dead_code_worker, 2, timeout_s=240, pg_timeout_s=200))
    print("\nnon-owner inductor calls (incl. compiles): "
          + ", ".join(f"{t:.1f} s" for t in non_owner["call_s"]))
    code = "\n".join(non_owner["codes"])
    assert "kt.gather_to_owner" in code, "the compiled non-owner code lost the gather:\n" + code
    for call, ((rows, lengths), x) in enumerate(zip(owner["received"], non_owner["received"])):
        assert lengths.tolist() == [2, x.shape[0]]
        _assert_equal(rows, torch.cat([torch.full((2, 4), -1.0), x]), f"owner's rows in call {call}")
