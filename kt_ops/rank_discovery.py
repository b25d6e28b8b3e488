"""Where this process stands in a distributed job, also before init_process_group.

Models are often built before torch.distributed is initialized (torchrun, accelerate), and
KTMoE must know at construction whether this rank owns the experts (only the owner
allocates them). The process group is authoritative when there is one; otherwise torchrun's
RANK / WORLD_SIZE environment variables are read and checked.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"kt_ops: environment variable {name}={raw!r} is not an integer") from None


def discover_rank(process_group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    """Returns ``(rank, world_size)`` of this process.

    From ``process_group`` if given, else from the default process group if initialized,
    else from ``RANK`` and ``WORLD_SIZE`` (both or neither), else ``(0, 1)``.
    Raises ValueError for malformed or inconsistent values.
    """
    if process_group is not None:
        return process_group.rank(), process_group.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        return 0, 1
    if rank is None or world_size is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise ValueError(f"kt_ops: {missing} is not set while "
                         f"{'WORLD_SIZE' if rank is None else 'RANK'} is; set both (as torchrun does) or neither")
    if world_size < 1:
        raise ValueError(f"kt_ops: WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"kt_ops: RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
    return rank, world_size
