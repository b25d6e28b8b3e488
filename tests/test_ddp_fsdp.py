"""A patched transformers model under PyTorch's own engines on 2 gloo ranks: unmodified
``DistributedDataParallel(model)`` and FSDP2 ``fully_shard`` on every decoder layer and the root
(``ignored_params=kt_ops.expert_parameters(...)``), training the expert LoRA alone and the
expert LoRA with replicated parameters (router, attention), and the expert LoRA with PEFT LoRA
on attention (kt_ops.hf.get_peft_model). Each gives, step by step, the
per-rank losses and the trained parameters (fp32, SGD) of one process that averages the two
ranks' losses. The non-owner holds no expert tensor; with the expert LoRA alone it has nothing
of its own to train and still runs the backward the owner needs (its KT layers' grad anchors).
The same with the experts sharded over the two ranks (expert_shards=2): each holds and trains
half of every layer's experts, whose rows equal the reference's.
"""
import pytest
import torch

pytest.importorskip("transformers")

from distributed_harness import check_all_ok, run_ranks  # noqa: E402
from moe_testing import randomize_lora  # noqa: E402

STEPS, LR = 3, 0.5


def build_model(**patch):
    """The tiny Qwen3-MoE of test_quantized_layer (H=128, 8 experts, top-2), patched with rank-4
    expert LoRA whose B factors are nonzero (so every LoRA tensor gets a gradient); ``patch``:
    more arguments of patch_model (process groups)."""
    import kt_ops
    from test_quantized_layer import tiny_qwen3_moe

    model = kt_ops.patch_model(tiny_qwen3_moe(torch.float32), lora_rank=4, lora_alpha=8, **patch).train()
    randomize_lora(model, lambda name: name.endswith("lora_b"), seed=7)
    return model


def set_trainable(model, trained):
    """Everything frozen but the expert LoRA and the grad anchors, plus (``trained ==
    "lora+replicated"``) the routers and the attention q_proj of every layer, or (``trained ==
    "lora+peft-attention"``) PEFT LoRA on q_proj / v_proj (kt_ops.hf.get_peft_model; its B
    factors nonzero). Returns the model to train (the PEFT model in the last case)."""
    for name, p in model.named_parameters():
        replicated = name.endswith(("mlp.gate.weight", "self_attn.q_proj.weight"))
        p.requires_grad_("lora" in name or name.endswith("grad_anchor")
                         or (trained == "lora+replicated" and replicated))
    if trained != "lora+peft-attention":
        return model
    import peft

    import kt_ops
    model = kt_ops.hf.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=["q_proj", "v_proj"]))
    randomize_lora(model, lambda name: "lora_B" in name, seed=3)
    return model


def decoder_layers(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def batch(step, rank):
    from test_quantized_layer import input_ids
    return input_ids(seed=100 * step + rank)


def trained_state(model):
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.numel():
            t = p.detach()
            state[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return state


def _worker(rank, world_size, engine, trained, shards=1):
    import kt_ops

    model = set_trainable(build_model(expert_shards=shards), trained)
    if engine == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)  # patch_model marked the expert tensors
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in decoder_layers(model):
            fully_shard(layer, ignored_params=kt_ops.expert_parameters(layer))
        fully_shard(model, ignored_params=kt_ops.expert_parameters(model))
        net = model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank)
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    expert_names = kt_ops.expert_parameter_names(model)
    return dict(losses=losses, state=trained_state(model), expert_names=expert_names)


def reference(trained, world_size=2):
    """One process: per step, the mean of the ranks' losses, one SGD step."""
    model = set_trainable(build_model(), trained)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=batch(step, r), labels=batch(step, r), use_cache=False).loss
                    for r in range(world_size)]
        (sum(per_rank) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append([loss.item() for loss in per_rank])
    return losses, trained_state(model)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shards", [1, 2], ids=["one-owner", "two-shards"])
@pytest.mark.parametrize("trained", ["lora", "lora+replicated", "lora+peft-attention"])
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process(engine, trained, shards, monkeypatch):
    results = check_all_ok(run_ranks(_worker, 2, engine, trained, shards, timeout_s=240, pg_timeout_s=120))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref_losses, ref_state = reference(trained)
    for step in range(STEPS):
        for rank in range(2):
            got, want = results[rank]["losses"][step], ref_losses[step][rank]
            assert abs(got - want) <= 1e-5 * abs(want), f"{engine}, rank {rank}, step {step}: {got} vs {want}"
    owner, other = results
    assert owner["expert_names"] and any(".experts." in n for n in owner["state"])
    if shards == 1:  # the non-owner holds no expert tensor
        assert other["expert_names"] == [] and not any(".experts." in n for n in other["state"])
    else:
        assert other["expert_names"] == owner["expert_names"]
    assert any("q_proj.lora_A" in n for n in owner["state"]) == (trained == "lora+peft-attention")
    for name, want in ref_state.items():
        if ".experts." in name:  # sharded: rank 0's experts, then rank 1's
            got = owner["state"][name] if shards == 1 else torch.cat([owner["state"][name], other["state"][name]])
            assert rel_err(got, want) <= 1e-5, name
        else:  # replicated: the same on both ranks
            for rank, res in enumerate(results):
                assert rel_err(res["state"][name], want) <= 1e-5, (rank, name)
    assert set(owner["state"]) == set(ref_state)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_three_ranks_with_two_shards_equal_one_process(engine, monkeypatch):
    """3 ranks, expert_shards=2 (ranks 0 and 1 hold experts 0-3 and 4-7, rank 2 none), the
    router and q_proj replicated: per-rank losses and trained tensors of one process."""
    results = check_all_ok(run_ranks(_worker, 3, engine, "lora+replicated", 2, timeout_s=240, pg_timeout_s=120))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref_losses, ref_state = reference("lora+replicated", world_size=3)
    for step in range(STEPS):
        for rank in range(3):
            got, want = results[rank]["losses"][step], ref_losses[step][rank]
            assert abs(got - want) <= 1e-5 * abs(want), f"{engine}, rank {rank}, step {step}: {got} vs {want}"
    assert results[0]["expert_names"] == results[1]["expert_names"] != [] and results[2]["expert_names"] == []
    for name, want in ref_state.items():
        if ".experts." in name:
            got = torch.cat([results[0]["state"][name], results[1]["state"][name]])
            assert rel_err(got, want) <= 1e-5, name
        else:
            for rank, res in enumerate(results):
                assert rel_err(res["state"][name], want) <= 1e-5, (rank, name)
