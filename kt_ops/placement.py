"""Where a KT layer's experts live, named with one argument: ``owners="rank0"`` or ``"per-node"``.

* ``"rank0"``: one owner for the whole job, global rank 0 (the default group): what
  ``KTMoE(owner_rank=0)`` without a ``process_group`` does.
* ``"per-node"``: one owner per node, the node's local rank 0; the node's ranks send their
  tokens to it, and the owners of all nodes average their expert gradients (each holds a
  replica of the experts): ``KTMoE(process_group=<the node's ranks>, owner_rank=0,
  expert_replica_group=<the owners>)`` without building those groups by hand.
* ``expert_shards=S`` with either: the experts are split into S contiguous ranges held by the
  first S ranks (of the job, or of each node); shard s's owners on all nodes average their
  gradients.

The layout comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``: torchrun numbers the ranks of a node consecutively),
so a layer knows at construction, before ``init_process_group``, whether it owns the experts
(only an owner allocates them). The process groups themselves need the default group: they
are made on first use (every rank makes all of them, in the same order, as
``torch.distributed.new_group`` requires) and shared by every layer of the same layout.
Models that compile their first step should call :func:`create_groups` once after
``init_process_group`` (KTTrainer does), so that no group is made while tracing.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch.distributed as dist

from kt_ops.rank_discovery import _env_int, discover_rank

OWNERS = ("rank0", "per-node")


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The job as ``nodes`` nodes of ``ranks_per_node`` consecutive ranks; this process is
    ``local_rank`` of node ``node``."""
    world_size: int
    ranks_per_node: int
    node: int
    local_rank: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def owner_ranks(self, shard: int = 0) -> list[int]:
        """The global ranks that own expert shard ``shard``: each node's local rank ``shard``."""
        return [n * self.ranks_per_node + shard for n in range(self.nodes)]


def node_layout(where: str = "kt_ops") -> NodeLayout:
    """This process's node layout from torchrun's environment (and the default group, when
    initialized, for the rank and world size). ValueError naming the variable that is
    missing or inconsistent."""
    rank, world_size = discover_rank()
    local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if world_size == 1 and local_rank is None and local_world is None:
        return NodeLayout(1, 1, 0, 0)
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            raise ValueError(f"{where}: owners='per-node' reads the node layout from torchrun's environment, "
                             f"but {name} is not set (launch with torchrun, or pass process_group and "
                             f"expert_replica_group built by hand)")
    if local_world < 1 or world_size % local_world:
        raise ValueError(f"{where}: owners='per-node' needs nodes of equal size: LOCAL_WORLD_SIZE={local_world} "
                         f"does not divide WORLD_SIZE={world_size}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"{where}: LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE={local_world}), got {local_rank}")
    node = rank // local_world
    group_rank = _env_int("GROUP_RANK")
    if rank % local_world != local_rank or (group_rank is not None and group_rank != node):
        raise ValueError(f"{where}: owners='per-node' needs each node's ranks numbered consecutively (as torchrun "
                         f"does): RANK={rank} is not GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK "
                         f"({group_rank} * {local_world} + {local_rank})")
    return NodeLayout(world_size, local_world, node, local_rank)


# (world_size, ranks_per_node, shards) -> (this rank's node group, its shard's owners' group,
# the default group they were made under): made once per layout and job, shared by the layers.
_GROUPS: dict = {}


def create_groups(layout: NodeLayout, shards: int = 1) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """The process groups of ``owners="per-node"`` for this process: (its node's ranks, the
    owners of its expert shard on all nodes; None off the owners). Made on the first call
    after ``init_process_group`` (every rank must call it: KT layers do on first use), then
    reused."""
    if not dist.is_initialized():
        raise RuntimeError("kt_ops: owners='per-node' makes its process groups from the default one: call "
                           "torch.distributed.init_process_group before the first forward")
    default = dist.distributed_c10d._get_default_group()
    key = (layout.world_size, layout.ranks_per_node, shards)
    made = _GROUPS.get(key)
    if made is None or made[2] is not default:  # a new job in this process (tests) makes new groups
        node_groups = [dist.new_group(layout.node_ranks(n)) for n in range(layout.nodes)]
        owners = [dist.new_group(layout.owner_ranks(s)) for s in range(shards)]
        mine = owners[layout.local_rank] if layout.local_rank < shards else None
        made = _GROUPS[key] = (node_groups[layout.node], mine, default)
    return made[0], made[1]


@dataclasses.dataclass
class Placement:
    """A KT layer's rank, world size and owner within the group its tokens go through, and its
    process groups (made lazily for ``owners="per-node"``)."""
    rank: int
    world_size: int
    owner_rank: int
    layout: Optional[NodeLayout] = None          # owners="per-node"
    _process_group: Optional[dist.ProcessGroup] = None
    _replica_group: Optional[dist.ProcessGroup] = None
    shards: int = 1  # expert shards: shard s is held by rank owner_rank + s (owner_rank is 0 when > 1)

    @property
    def shard(self) -> Optional[int]:
        """The expert shard this rank holds, or None."""
        s = self.rank - self.owner_rank
        return s if 0 <= s < self.shards else None

    @property
    def is_owner(self) -> bool:
        return self.shard is not None

    def replicas(self) -> int:
        """How many owners hold the experts (the size of the replica group), without making it."""
        if self.layout is not None:
            return self.layout.nodes
        return self._replica_group.size() if self._replica_group is not None else 1

    def create_groups(self) -> Optional[tuple]:
        """(node group, owners' group) of a multi-rank ``owners="per-node"`` placement, made on
        the first call (see :func:`create_groups`); None for the others, whose groups were given."""
        if self.layout is None or self.layout.world_size == 1:
            return None
        return create_groups(self.layout, self.shards)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        made = self.create_groups()
        return self._process_group if made is None else made[0]

    @property
    def expert_replica_group(self) -> Optional[dist.ProcessGroup]:
        made = self.create_groups()
        return self._replica_group if made is None else made[1]


def owners_on_this_node(placement: "Placement") -> int:
    """How many expert owners share this process's node (torchrun's ``LOCAL_WORLD_SIZE`` says
    which ranks are on it; without it, every rank is taken to be on one machine)."""
    if placement.layout is not None:  # owners="per-node": the first S local ranks of every node
        return min(placement.shards, placement.layout.ranks_per_node)
    first = placement.owner_rank
    owners = range(first, first + placement.shards)
    local_world = _env_int("LOCAL_WORLD_SIZE")
    if local_world is None or placement.world_size % local_world:
        return len(owners)
    node = placement.rank // local_world
    return sum(1 for r in owners if r // local_world == node)


def owner_thread_count(placement: "Placement") -> int:
    """The intra-op threads an expert owner should compute with: the CPUs its affinity mask
    allows (what ``numactl --cpunodebind`` or ``taskset`` gave it), split evenly between the
    node's owners when the mask is the whole machine (nothing bound them apart)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if allowed >= (os.cpu_count() or allowed):
        return max(1, allowed // max(1, owners_on_this_node(placement)))
    return allowed


def check_shards(shards, num_experts: Optional[int], ranks: int, where: str, ranks_of: str = "the job") -> int:
    """``expert_shards`` checked against the experts and the ranks that can own a shard
    (``ranks`` of ``ranks_of``: "the job", "the group", "a node (LOCAL_WORLD_SIZE)")."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"{where}: expert_shards must be an int >= 1, got {shards!r}")
    if num_experts is not None and shards > num_experts:
        raise ValueError(f"{where}: expert_shards={shards} is more than the {num_experts} experts (num_experts)")
    if shards > ranks:
        raise ValueError(f"{where}: expert_shards={shards} needs {shards} ranks to own the shards, but {ranks_of} has "
                         f"{ranks} rank{'' if ranks == 1 else 's'}")
    return shards


def resolve(owners: Optional[str], owner_rank: int, process_group: Optional[dist.ProcessGroup],
            expert_replica_group: Optional[dist.ProcessGroup], where: str, expert_shards: int = 1,
            num_experts: Optional[int] = None) -> Placement:
    """One placement from a layer's arguments: ``owners`` names it, or the groups given by
    hand (``process_group``, ``owner_rank``, ``expert_replica_group``) do, never both. With
    ``expert_shards=S`` the first S ranks of the group (of each node, for ``"per-node"``) hold
    one shard each."""
    if owners is None:
        rank, world_size = discover_rank(process_group)
        if not 0 <= owner_rank < world_size:
            raise ValueError(f"{where}: owner_rank must be in [0, {world_size}), got {owner_rank}")
        shards = check_shards(expert_shards, num_experts, world_size, where,
                              "the group" if process_group is not None else "the job")
        if shards > 1 and owner_rank != 0:
            raise ValueError(f"{where}: with expert_shards={shards} the shards are held by the group's ranks "
                             f"0..{shards - 1}: leave owner_rank at 0 (got {owner_rank})")
        return Placement(rank, world_size, owner_rank, None, process_group, expert_replica_group, shards)
    if owners not in OWNERS:
        raise ValueError(f"{where}: owners must be one of {', '.join(map(repr, OWNERS))} or None, got {owners!r}")
    if process_group is not None or expert_replica_group is not None or owner_rank != 0:
        raise ValueError(f"{where}: owners={owners!r} places the experts itself; leave process_group, "
                         f"expert_replica_group and owner_rank at their defaults (or pass those instead of owners)")
    if owners == "rank0":
        rank, world_size = discover_rank()
        shards = check_shards(expert_shards, num_experts, world_size, where)
        return Placement(rank, world_size, 0, shards=shards)
    layout = node_layout(where)
    shards = check_shards(expert_shards, num_experts, layout.ranks_per_node, where,
                          f"a node (LOCAL_WORLD_SIZE={layout.ranks_per_node})")
    return Placement(layout.local_rank, layout.ranks_per_node, 0, layout, shards=shards)
