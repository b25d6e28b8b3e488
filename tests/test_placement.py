"""owners="rank0" | "per-node" (kt_ops.placement): the node layout read from torchrun's
environment before init_process_group, and every way of getting it wrong raising a ValueError
that names the numbers. (The per-node numerics: test_one_owner_per_node.py; the Trainer under
two torchrun commands as two nodes: test_per_node_torchrun.py.)"""
import pytest
import torch

from kt_ops import placement
from kt_ops.layer import KTMoE

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def set_env(monkeypatch, **values):
    """torchrun's environment with these values, as a process sees it before init_process_group."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("rank", range(6))
def test_node_layout_of_three_nodes_of_two(monkeypatch, rank):
    set_env(monkeypatch, RANK=rank, WORLD_SIZE=6, LOCAL_RANK=rank % 2, LOCAL_WORLD_SIZE=2, GROUP_RANK=rank // 2)
    layout = placement.node_layout()
    assert (layout.nodes, layout.node, layout.local_rank) == (3, rank // 2, rank % 2)
    assert layout.node_ranks(layout.node) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert layout.owner_ranks() == [0, 2, 4]
    p = placement.resolve("per-node", 0, None, None, "test")
    assert (p.rank, p.world_size, p.owner_rank, p.is_owner, p.replicas()) == (rank % 2, 2, 0, rank % 2 == 0, 3)


def test_one_process_needs_no_torchrun(monkeypatch):
    set_env(monkeypatch)
    p = placement.resolve("per-node", 0, None, None, "test")
    assert (p.rank, p.world_size, p.is_owner, p.replicas()) == (0, 1, True, 1)
    assert p.process_group is None and p.expert_replica_group is None


@pytest.mark.parametrize("env,match", [
    (dict(RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2), "LOCAL_RANK is not set"),
    (dict(RANK=1, WORLD_SIZE=4, LOCAL_RANK=1), "LOCAL_WORLD_SIZE is not set"),
    (dict(RANK=1, WORLD_SIZE=5, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2), "LOCAL_WORLD_SIZE=2 does not divide WORLD_SIZE=5"),
    (dict(RANK=1, WORLD_SIZE=4, LOCAL_RANK=2, LOCAL_WORLD_SIZE=2), r"LOCAL_RANK must be in \[0, LOCAL_WORLD_SIZE=2\)"),
    (dict(RANK=2, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2), "RANK=2 is not GROUP_RANK"),
    (dict(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=0), r"RANK=3 is not .*\(0 \* 2 \+ 1\)"),
])
def test_a_layout_that_does_not_fit_is_refused(monkeypatch, env, match):
    set_env(monkeypatch, **env)
    with pytest.raises(ValueError, match=match):
        KTMoE(8, 16, 4, 2, dtype=torch.float32, owners="per-node")


def test_owners_is_one_of_two_names_and_not_with_groups_by_hand(monkeypatch):
    set_env(monkeypatch)
    with pytest.raises(ValueError, match="owners must be one of 'rank0', 'per-node' or None, got 'node'"):
        KTMoE(8, 16, 4, 2, dtype=torch.float32, owners="node")
    for by_hand in (dict(owner_rank=1), dict(expert_replica_group=object()), dict(process_group=object())):
        with pytest.raises(ValueError, match="owners='per-node' places the experts itself"):
            placement.resolve("per-node", by_hand.get("owner_rank", 0), by_hand.get("process_group"),
                              by_hand.get("expert_replica_group"), "KTMoE")


def test_rank0_is_the_default_placement(monkeypatch):
    set_env(monkeypatch, RANK=1, WORLD_SIZE=3)
    named, default = (KTMoE(8, 16, 4, 2, dtype=torch.float32, **kw) for kw in (dict(owners="rank0"), {}))
    for layer in (named, default):
        assert (layer.rank, layer.world_size, layer.owner_rank, layer.is_owner) == (1, 3, 0, False)
        assert not hasattr(layer, "gate_proj")  # a non-owner allocates no expert memory


def test_a_non_owner_of_per_node_allocates_no_experts_before_init(monkeypatch):
    set_env(monkeypatch, RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    layer = KTMoE(8, 16, 4, 2, dtype=torch.float32, lora_rank=2, owners="per-node")
    assert not layer.is_owner and not hasattr(layer, "gate_proj")
    set_env(monkeypatch, RANK=2, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    owner = KTMoE(8, 16, 4, 2, dtype=torch.float32, lora_rank=2, owners="per-node")
    assert owner.is_owner and owner.gate_proj.shape == (4, 16, 8)
    # its gradient averaging over the owners waits for the group, made on first use
    lora = [p for n, p in owner.named_parameters() if "lora" in n]
    assert lora and all(getattr(p, "_kt_replica_hook", None) is owner._placement for p in lora)
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group before the first forward"):
        owner.process_group


def test_patch_model_and_from_pretrained_check_owners_first(monkeypatch):
    pytest.importorskip("transformers")
    import kt_ops
    from test_quantized_layer import tiny_qwen3_moe

    set_env(monkeypatch)
    model = tiny_qwen3_moe(torch.float32)
    with pytest.raises(ValueError, match="patch_model: owners must be one of"):
        kt_ops.patch_model(model, lora_rank=2, owners="socket")
    with pytest.raises(ValueError, match="from_pretrained: owners='per-node' places the experts itself"):
        kt_ops.hf.from_pretrained("/nonexistent", owners="per-node", owner_rank=1)


@pytest.mark.parametrize("owners,shards,env,expected", [
    (None, 1, dict(RANK=0, WORLD_SIZE=2), 1),
    (None, 2, dict(RANK=1, WORLD_SIZE=2), 2),
    (None, 2, dict(RANK=1, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2), 2),  # ranks 0, 1: node 0
    (None, 3, dict(RANK=2, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2), 1),  # rank 2 alone on node 1
    ("per-node", 2, dict(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=1), 2),
], ids=["one-owner", "two-shards", "two-shards-one-node", "three-shards-two-nodes", "per-node"])
def test_owners_on_this_node(monkeypatch, owners, shards, env, expected):
    set_env(monkeypatch, **env)
    where = placement.resolve(owners, 0, None, None, "test", shards, 8)
    assert placement.owners_on_this_node(where) == expected


@pytest.mark.parametrize("allowed,cpus,owners_here,expected", [
    (range(16), 16, 1, 16),   # the whole machine, one owner: all of it
    (range(16), 16, 2, 8),    # the whole machine, two owners, nothing bound them apart: half each
    (range(8, 16), 16, 2, 8),  # bound to a socket (numactl --cpunodebind): its CPUs, whatever else runs
    (range(3), 16, 2, 3),
    (range(1), 1, 2, 1),      # never 0
])
def test_owner_thread_count_follows_the_affinity_mask(monkeypatch, allowed, cpus, owners_here, expected):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(placement, "owners_on_this_node", lambda where: owners_here)
    assert placement.owner_thread_count(None) == expected


def test_set_owner_threads_sets_torch_threads_on_owners_only(monkeypatch):
    import kt_ops

    set_env(monkeypatch, RANK=1, WORLD_SIZE=2)
    monkeypatch.setattr(placement, "owner_thread_count", lambda where: 3)
    before = torch.get_num_threads()
    try:
        owner = torch.nn.Sequential(KTMoE(16, 8, 4, 2, dtype=torch.float32, expert_shards=2))
        assert kt_ops.distributed.set_owner_threads(owner) == 3 and torch.get_num_threads() == 3
        torch.set_num_threads(before)
        not_owner = torch.nn.Sequential(KTMoE(16, 8, 4, 2, dtype=torch.float32))  # rank 1 of one owner
        assert kt_ops.distributed.set_owner_threads(not_owner) is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_per_node_shards_must_fit_a_node(monkeypatch):
    set_env(monkeypatch, RANK=0, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, GROUP_RANK=0)
    with pytest.raises(ValueError, match=r"expert_shards=3 needs 3 ranks to own the shards, but a node "
                                         r"\(LOCAL_WORLD_SIZE=2\) has 2 ranks"):
        placement.resolve("per-node", 0, None, None, "KTMoE", 3, 8)
