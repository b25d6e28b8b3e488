"""A profiler trace of a distributed KT step shows its parts: gather, experts (forward and
backward, on the owner) and scatter, as named ranges."""
import torch

from distributed_harness import check_all_ok, run_ranks


def _profiled_step(rank, world_size):
    from kt_ops.layer import KTMoE

    torch.manual_seed(0)
    layer = KTMoE(8, 6, 4, 2, lora_rank=2, dtype=torch.float32)
    x = torch.randn(3 + rank, 8, requires_grad=True)
    with torch.profiler.profile() as prof:
        layer(x).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("kt.")})


def test_trace_names_gather_experts_and_scatter():
    owner, other = check_all_ok(run_ranks(_profiled_step, 2, timeout_s=90))
    collectives = {"kt.gather_to_owner", "kt.scatter_from_owner", "kt.gather_to_owner_sized"}
    assert collectives | {"kt.experts.forward", "kt.experts.backward"} <= set(owner), owner
    assert collectives <= set(other) and not any(n.startswith("kt.experts") for n in other), other


def test_experts_range_only_while_a_profiler_runs(monkeypatch):
    """Without a profiler, a kt.moe call opens no record_function range (it cost ~0.1 ms a decode
    call, kt_ops/profiler_ranges.py); under torch.profiler the range is there."""
    import kt_ops

    opened = []
    real_record_function = torch.profiler.record_function

    def counting_record_function(name, *args):
        opened.append(name)
        return real_record_function(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", counting_record_function)
    torch.manual_seed(0)
    E, H, I = 4, 8, 6
    x = torch.randn(3, H)
    ids = torch.randint(0, E, (3, 2))
    w = torch.rand(3, 2)
    weights = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    kt_ops.moe(x, ids, w, *weights)
    assert opened == []
    with torch.profiler.profile() as prof:
        kt_ops.moe(x, ids, w, *weights)
    assert opened == ["kt.experts.forward"]
    assert "kt.experts.forward" in {e.name for e in prof.events()}
