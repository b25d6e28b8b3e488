"""KTMoE on 2 and 3 gloo ranks equals a single-process KTMoE on the concatenated batch.

Every rank builds the layer from the same seed (so routers agree, and the owner's experts
equal the reference's), feeds its own [2, S_r, H] hidden states (S_r differs per rank, 0 on
some rank in some step, also on the owner) and backpropagates its own loss
L_r = (y_r * c_r).sum(). With the layer's DDP gradient semantics, the reference on the
concatenated batch with loss (1/W)·Σ_r L_r must give (fp32, relative error <= 1e-5):
  * outputs: y_r == the reference's rows of rank r;
  * experts (base and LoRA, whatever is trained): the owner's gradients == the reference's;
  * router: the average over ranks of each rank's gradient == the reference's;
  * hidden states: x_r.grad / W == the reference's gradient of rank r's rows.
Eager on 2 ranks (full, LoRA with B nonzero, hybrid) and 3 ranks (owner_rank = 1), and
torch.compile(fullgraph=True) forward + backward with aot_eager and with inductor on 2 ranks.
Non-owner ranks hold no expert parameters. The pytest process builds only the world-size-1
reference; all distributed work runs in spawned ranks (distributed_harness.py).
"""
import time

import pytest
import torch

from distributed_harness import check_all_ok, run_ranks

H, I, E, K = 16, 12, 6, 2
TOL = 1e-5

MODES = {
    "full": dict(lora_rank=0, train_base=True),
    "lora": dict(lora_rank=4, lora_alpha=8.0, train_base=False),
    "hybrid": dict(lora_rank=4, lora_alpha=8.0, train_base=True),
    # Quantized frozen experts: only the owner holds them (and their scales).
    "lora-fp8": dict(lora_rank=4, lora_alpha=8.0, expert_format="fp8"),
    "lora-int8": dict(lora_rank=4, lora_alpha=8.0, expert_format="int8"),
}


def make_layer(mode: str, owner_rank: int, seed: int):
    """The layer as every rank (and the reference) builds it: same seed, LoRA B set nonzero
    (deterministically, on the owner only: only it has experts)."""
    from kt_ops.layer import KTMoE

    torch.manual_seed(seed)
    layer = KTMoE(H, I, E, K, owner_rank=owner_rank, dtype=torch.float32, **MODES[mode])
    if layer.is_owner and layer.lora_rank:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
                getattr(layer, name).copy_(0.3 * torch.randn(getattr(layer, name).shape, generator=gen))
    return layer


def make_batch(step: int, rank: int, seq_len: int):
    """Rank `rank`'s hidden states [2, S, H] and loss weights c of one step."""
    gen = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    return torch.randn(2, seq_len, H, generator=gen), torch.randn(2, seq_len, H, generator=gen)


def _layer_worker(rank, world_size, mode, owner_rank, seq_lens, backend, seed):
    import kt_ops  # noqa: F401

    layer = make_layer(mode, owner_rank, seed)
    fn = layer
    if backend is not None:
        if backend == "inductor":
            import torch._inductor.config as inductor_config
            inductor_config.force_disable_caches = True  # compile this build's code, not a cached one
        fn = torch.compile(layer, backend=backend, fullgraph=True)
    steps = []
    for step, lens in enumerate(seq_lens):
        x, c = make_batch(step, rank, lens[rank])
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        start = time.monotonic()
        y = fn(x)
        (y * c).sum().backward()
        steps.append(dict(
            seconds=time.monotonic() - start, y=y.detach(), x_grad=x.grad,
            grads={n: p.grad for n, p in layer.named_parameters() if p.requires_grad}))
    return dict(params=sorted(n for n, _ in layer.named_parameters()), is_owner=layer.is_owner,
                steps=steps)


def reference_step(ref, step: int, seq_lens, world_size: int):
    """One process standing in for ``world_size`` ranks: every rank's batch of ``step`` through
    ``ref`` at once, the ranks' losses averaged, backward. Returns (inputs, outputs) per rank."""
    xs, cs = zip(*(make_batch(step, r, seq_lens[r]) for r in range(world_size)))
    xs = [x.requires_grad_(True) for x in xs]
    y_all = ref(torch.cat([x.reshape(-1, H) for x in xs]))
    ys = [y.reshape(x.shape) for y, x in zip(y_all.split([x.shape[0] * x.shape[1] for x in xs]), xs)]
    (sum((y * c).sum() for y, c in zip(ys, cs)) / world_size).backward()
    return xs, ys


def rel_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_reference(results, mode, owner_rank, seq_lens, seed, monkeypatch):
    """The comparison described in the module docstring, step by step."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world_size = len(results)
    ref = make_layer(mode, 0, seed)
    assert ref.world_size == 1
    replicated = ("gate.weight", "grad_anchor")  # on every rank: the router and the 0-element grad anchor
    expert_names = sorted(n for n, p in ref.named_parameters() if p.requires_grad and n not in replicated)
    for rank, res in enumerate(results):
        if rank == owner_rank:
            assert res["params"] == sorted(n for n, _ in ref.named_parameters())
        else:  # a non-owner holds the router, the grad anchor and the expert-gradient norm only
            assert res["params"] == ["expert_grad_norm", "gate.weight", "grad_anchor"], \
                f"rank {rank} holds {res['params']}"

    for step, lens in enumerate(seq_lens):
        ref.zero_grad(set_to_none=True)
        xs, ys = reference_step(ref, step, lens, world_size)

        where = f"step {step}, lengths {lens}"
        for rank, res in enumerate(results):
            got = res["steps"][step]
            assert rel_err(got["y"], ys[rank]) <= TOL, f"output of rank {rank}, {where}"
            assert rel_err(got["x_grad"] / world_size, xs[rank].grad) <= TOL, \
                f"hidden-state gradient of rank {rank}, {where}"
        router = sum(res["steps"][step]["grads"]["gate.weight"] for res in results) / world_size
        assert rel_err(router, ref.gate.weight.grad) <= TOL, f"router gradient, {where}"
        owner_grads = results[owner_rank]["steps"][step]["grads"]
        assert sorted(n for n in owner_grads if n not in replicated) == expert_names
        for name in expert_names:
            assert rel_err(owner_grads[name], dict(ref.named_parameters())[name].grad) <= TOL, \
                f"gradient of {name} on the owner, {where}"


def _run_and_check(world_size, mode, owner_rank, seq_lens, backend, monkeypatch, timeout_s=120, seed=3):
    start = time.monotonic()
    results = check_all_ok(run_ranks(_layer_worker, world_size, mode, owner_rank, seq_lens, backend, seed,
                                     timeout_s=timeout_s, pg_timeout_s=max(60, timeout_s - 20)))
    print(f"\n{world_size} ranks, {backend or 'eager'}, {mode}: run {time.monotonic() - start:.1f} s; "
          "per-step forward+backward (s) by rank: "
          + "; ".join(", ".join(f"{s['seconds']:.2f}" for s in res["steps"]) for res in results))
    check_against_reference(results, mode, owner_rank, seq_lens, seed, monkeypatch)


@pytest.mark.parametrize("mode", ["full", "lora", "hybrid", "lora-fp8", "lora-int8"])
def test_eager_two_ranks(mode, monkeypatch):
    """Eager, 2 ranks, owner 0, in each training mode: outputs and the gradients of hidden
    states, router and experts equal the reference; a rank with 0 tokens (also the owner, and
    both ranks at once)."""
    _run_and_check(2, mode, 0, [[5, 3], [0, 4], [7, 0], [0, 0]], None, monkeypatch)


def test_eager_three_ranks_owner_one(monkeypatch):
    """Eager, 3 ranks, hybrid, owner_rank = 1: per-rank lengths differ, one rank (the owner in
    the first step) has 0 tokens."""
    _run_and_check(3, "hybrid", 1, [[3, 0, 5], [0, 4, 2], [6, 1, 0]], None, monkeypatch)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_two_ranks(backend, monkeypatch):
    """torch.compile(fullgraph=True) forward + backward with aot_eager and inductor, 2 ranks,
    hybrid with nonzero LoRA B: the compiled ranks (with recompiles for new lengths, incl.
    0 tokens on one rank) equal the eager single-process reference."""
    _run_and_check(2, "hybrid", 0, [[5, 3], [4, 0], [2, 6]], backend, monkeypatch, timeout_s=300)
