"""Random expert weights of one shard, equal to the same experts of a draw of all of them.

A layer with sharded experts initialises only its own experts, but every shard count must
give the same numbers (a job's result may not depend on how its experts are placed). So each
owner replays the one draw of all ``E`` experts from the same generator, in chunks, keeping
its own experts: the memory is one chunk, the time that of the full draw.

The chunks are exact: torch's CPU ``randn`` fills its uniforms in order and transforms them
in blocks of 16 (recomputing the last 16 of a size that is not a multiple of 16, and using a
scalar path below 16 values), so chunks whose sizes are multiples of 16, the last one 16 or
more values long, give the numbers of one call. ``rand`` draws one value per element.
tests/test_expert_init.py checks both against the full draw.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

_CHUNK = 1 << 22  # values per draw (16 MiB of float32); a multiple of 16


def draw_experts(sampler, shape: tuple, generator: torch.Generator, experts: range,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """``sampler(shape, generator=generator, dtype=dtype)[experts.start:experts.stop]``, drawing
    ``_CHUNK`` values at a time. ``sampler``: ``torch.randn`` or ``torch.rand``."""
    per_expert = math.prod(shape[1:])
    total = shape[0] * per_expert
    begin, end = experts.start * per_expert, experts.stop * per_expert
    out = torch.empty((len(experts),) + tuple(shape[1:]), dtype=dtype)
    flat = out.view(-1)
    pos = 0
    while pos < total:
        n = min(_CHUNK, total - pos)
        if total - (pos + n) < 16:  # never leave a tail under 16 values: draw it with this chunk
            n = total - pos
        lo, hi = max(pos, begin), min(pos + n, end)
        values = sampler(n, generator=generator, dtype=dtype)
        if lo < hi:
            flat[lo - begin:hi - begin].copy_(values[lo - pos:hi - pos])
        pos += n
    return out
