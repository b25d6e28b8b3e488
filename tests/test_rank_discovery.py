"""kt_ops.rank_discovery.discover_rank without a process group (torchrun's RANK / WORLD_SIZE),
and KTMoE's validation of owner_rank against the discovered world size.

Valid: neither variable set -> (0, 1); both set and consistent -> their values (surrounding
whitespace allowed; an empty value counts as unset); an explicit process group wins over
the environment. Invalid (ValueError naming the offending variable): malformed values,
one variable without the other, RANK outside [0, WORLD_SIZE), WORLD_SIZE < 1.
The pytest process never initializes torch.distributed, so the environment path is taken.
"""
import re

import pytest
import torch

from kt_ops.layer import KTMoE
from kt_ops.rank_discovery import discover_rank


@pytest.fixture
def env(monkeypatch):
    """Sets RANK / WORLD_SIZE (None: unset) for one test."""
    def set_env(rank, world_size):
        for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    set_env(None, None)
    return set_env


def test_no_process_group_in_this_process():
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("rank,world_size,expected", [
    (None, None, (0, 1)),
    ("0", "1", (0, 1)),
    ("1", "2", (1, 2)),
    ("7", "8", (7, 8)),
    (" 2 ", "3\n", (2, 3)),
    ("", "", (0, 1)),
])
def test_valid_environment(env, rank, world_size, expected):
    env(rank, world_size)
    assert discover_rank() == expected


@pytest.mark.parametrize("rank,world_size,variable,match", [
    ("abc", "2", "RANK", "not an integer"),
    ("1.5", "2", "RANK", "not an integer"),
    ("0", "two", "WORLD_SIZE", "not an integer"),
    ("0", "0x2", "WORLD_SIZE", "not an integer"),
    ("1", None, "WORLD_SIZE", "not set"),       # RANK without WORLD_SIZE
    (None, "2", "RANK", "not set"),             # WORLD_SIZE without RANK
    ("2", "2", "RANK", r"\[0, WORLD_SIZE=2\)"),  # RANK >= WORLD_SIZE
    ("5", "2", "RANK", r"\[0, WORLD_SIZE=2\)"),
    ("-1", "2", "RANK", r"\[0, WORLD_SIZE=2\)"),
    ("0", "0", "WORLD_SIZE", ">= 1"),           # WORLD_SIZE < 1
    ("0", "-3", "WORLD_SIZE", ">= 1"),
])
def test_invalid_environment_names_the_variable(env, rank, world_size, variable, match):
    env(rank, world_size)
    with pytest.raises(ValueError, match=match) as info:
        discover_rank()
    # the offending variable is the one the message names first
    assert re.search(r"\b(RANK|WORLD_SIZE)\b", str(info.value)).group(1) == variable, str(info.value)


def test_explicit_process_group_wins_over_environment(env):
    class Group:  # duck-typed: discover_rank only asks rank() and size()
        def rank(self):
            return 2

        def size(self):
            return 4

    env("abc", "also bad")
    assert discover_rank(Group()) == (2, 4)


# ---- KTMoE's owner_rank --------------------------------------------------------------------

@pytest.mark.parametrize("rank,world_size,owner_rank", [
    (None, None, 1), (None, None, -1), ("0", "2", 2), ("1", "3", 3), ("1", "3", -1),
])
def test_ktmoe_rejects_owner_rank_outside_world(env, rank, world_size, owner_rank):
    env(rank, world_size)
    ws = 1 if world_size is None else int(world_size)
    with pytest.raises(ValueError, match=rf"owner_rank must be in \[0, {ws}\), got {owner_rank}"):
        KTMoE(8, 4, 4, 2, owner_rank=owner_rank, dtype=torch.float32)


@pytest.mark.parametrize("rank,owner_rank,is_owner", [("0", 0, True), ("1", 0, False), ("2", 2, True),
                                                      ("0", 2, False)])
def test_ktmoe_ownership_from_environment(env, rank, owner_rank, is_owner):
    """With RANK / WORLD_SIZE=3 and no process group, KTMoE knows its rank at construction:
    only the owner allocates experts."""
    env(rank, "3")
    layer = KTMoE(8, 4, 4, 2, lora_rank=2, owner_rank=owner_rank, dtype=torch.float32)
    assert (layer.rank, layer.world_size, layer.is_owner) == (int(rank), 3, is_owner)
    names = {n for n, _ in layer.named_parameters()}
    assert ("gate_proj" in names) == is_owner and "gate.weight" in names


def test_ktmoe_invalid_environment_raises(env):
    env("3", "2")
    with pytest.raises(ValueError, match="RANK"):
        KTMoE(8, 4, 4, 2, dtype=torch.float32)


def test_multi_rank_layer_without_process_group_raises_on_forward(env):
    """Built for a 2-rank job (from the environment) but called before init_process_group:
    a clear RuntimeError, not a hang or an obscure failure."""
    env("1", "2")
    layer = KTMoE(8, 4, 4, 2, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        layer(torch.randn(3, 8))
