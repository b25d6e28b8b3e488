"""A non-owner rank's memory does not grow with the number of experts under DDP and FSDP2.

Two gloo ranks load a saved tiny Qwen3-MoE with kt_ops.hf.from_pretrained (rank 1 never reads
or allocates an expert) and train its expert LoRA for two steps under
``DistributedDataParallel(model)`` or FSDP2 ``fully_shard`` on every decoder layer and the root.
With 128 experts the owner holds 192 MiB of fp32 experts (16x the 8-expert model's); rank 1's
peak RSS growth (VmHWM after training minus before loading) is printed for both and must not
differ by more than 24 MiB (the router grows by 128 KiB; the rest is allocator noise).
"""
import pytest
import torch

pytest.importorskip("transformers")

from distributed_harness import check_all_ok, run_ranks  # noqa: E402

MiB = 1 << 20
H, I, LAYERS = 256, 256, 2


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _worker(rank, world_size, path, engine):
    import kt_ops

    before = _status("VmHWM")
    model = kt_ops.hf.from_pretrained(path, lora_rank=4, progress=False).train()
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name or name.endswith("grad_anchor"))
    if engine == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, ignored_params=kt_ops.expert_parameters(layer))
        fully_shard(model, ignored_params=kt_ops.expert_parameters(model))
        net = model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    experts = sum(kt.expert_nbytes() for _, kt in kt_ops.hf.patched_experts(model))
    return {"peak_growth": _status("VmHWM") - before, "expert_bytes": experts}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import checkpoint_samples as samples

    paths = {}
    for experts in (8, 128):
        path = tmp_path_factory.mktemp(f"experts{experts}")
        samples.tiny_qwen3_moe(hidden_size=H, moe_intermediate_size=I, num_experts=experts,
                               num_hidden_layers=LAYERS).save_pretrained(path)
        paths[experts] = str(path)
    return paths


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_non_owner_peak_memory_is_independent_of_the_experts(checkpoints, engine):
    growth, owner_bytes = {}, {}
    for experts, path in checkpoints.items():
        (r0, r1) = check_all_ok(run_ranks(_worker, 2, path, engine, timeout_s=240))
        assert r1["expert_bytes"] == 0
        growth[experts], owner_bytes[experts] = r1["peak_growth"], r0["expert_bytes"]
    assert owner_bytes[128] == 3 * 128 * H * I * 4 * LAYERS
    print(f"\n{engine}: rank 1 peak RSS growth {growth[8] / MiB:.1f} MiB (8 experts) vs "
          f"{growth[128] / MiB:.1f} MiB (128 experts; the owner holds {owner_bytes[128] / MiB:.0f} MiB of experts)")
    assert abs(growth[128] - growth[8]) < 24 * MiB
