"""The tiny MoE LM on 2 ranks (gloo) with kt checkpointing, compiled with inductor (fullgraph):
the gradients equal a single-process reference, with one owner and with the experts sharded
over both ranks (expert_shards=2: the all-to-all ops traced with no graph break). Plain
checkpointing around the distributed layer raises on every rank, naming the fix, instead of
replaying collectives."""
import pytest
import torch

from distributed_harness import RankError, check_all_ok, run_ranks

LAYERS = 2
BATCHES = {0: (2, 9), 1: (1, 6)}  # (batch, sequence) per rank: different lengths


def rank_tokens(rank):
    b, s = BATCHES[rank]
    return torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(10 + rank))


def build_model(checkpointing, shards=1):
    from tiny_moe_model import TinyMoELM, make_lora_trainable

    torch.manual_seed(0)
    model = TinyMoELM(layers=LAYERS, checkpointing=checkpointing, expert_shards=shards)
    make_lora_trainable(model)
    return model


def compiled_training_rank(rank, world_size, backend, shards):
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from kt_ops import _kernels

    model = build_model("kt", shards)
    loss_fn = torch.compile(model.loss, backend=backend, fullgraph=True)
    _kernels.calls.clear()
    loss = loss_fn(rank_tokens(rank))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, dict(_kernels.calls)


@pytest.mark.parametrize("shards", [1, 2], ids=["one-owner", "two-shards"])
def test_two_ranks_inductor_with_kt_checkpointing_match_single_process(shards):
    results = check_all_ok(run_ranks(compiled_training_rank, 2, "inductor", shards, timeout_s=400))

    model = build_model("kt")  # one process: world size 1, same initialisation
    loss = sum(model.loss(rank_tokens(r)) for r in range(2)) / 2  # DDP: mean of rank losses
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(sum(r[0] for r in results) / 2, loss.detach(), rtol=1e-5, atol=1e-6)
    owner_grads, other_grads = results[0][1], results[1][1]
    expert_names = {n for n in want if ".moe." in n and not n.endswith(("moe.gate.weight", "moe.grad_anchor"))}
    assert expert_names and expert_names <= owner_grads.keys()
    if shards == 1:
        assert not expert_names & other_grads.keys()  # the other rank holds no experts
    for name, g in want.items():
        if name in expert_names:  # already the average over ranks (DDP semantics); per shard: by experts
            got = owner_grads[name] if shards == 1 else torch.cat([owner_grads[name], other_grads[name]])
        else:
            got = (owner_grads[name] + other_grads[name]) / 2  # what DDP's all-reduce gives
        torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6, msg=name)
    ran_once = {"moe_forward": LAYERS, "moe_backward": LAYERS}  # each owner's experts ran once per step
    assert results[0][2] == ran_once
    assert results[1][2] == ({} if shards == 1 else ran_once)


def plain_checkpoint_rank(rank, world_size, shards):
    model = build_model("plain", shards)
    loss = model.loss(rank_tokens(rank))
    loss.backward()


@pytest.mark.parametrize("shards", [1, 2], ids=["one-owner", "two-shards"])
def test_plain_checkpointing_of_distributed_layer_raises_on_every_rank(shards):
    results = run_ranks(plain_checkpoint_rank, 2, shards, timeout_s=120)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} did not raise"
        assert "kt_ops.checkpoint_context_fn" in result.message, result.message
