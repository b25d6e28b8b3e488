"""Kernels and autograd of the sharded layer's collectives (schemas: csrc/ops/registration.cpp,
fakes: meta_kernels/shard_collectives.py).

A layer whose experts are split over S owners (``KTMoE(expert_shards=S)``) gives shard ``s``
(held by group rank ``s``) the experts ``[expert_starts[s], expert_starts[s+1])``. A token
goes to every shard that holds one of its experts, and only there:

* ``kt.dispatch_to_shards(rows, slots, topk_ids, expert_starts, ...)``: each ``rows`` tensor
  (``[T, ...]``: hidden states) is sent whole to each shard its token hits; each ``slots``
  tensor (``[T, K, ...]``: routing weights) is sent with the slots of other shards' experts
  set to 0. On an owner, the received rows are in source-rank order, each rank's in token
  order. Also returns ``local_ids`` ``[N, K]`` (the expert within the shard, -1 for a slot of
  another shard: kt.moe's empty slot) and ``recv_counts`` (rows received from each rank,
  int64 ``[world_size]`` on the CPU). Ids of -1 on the token's rank go nowhere.
* ``kt.combine_from_shards(rows, slots, topk_ids, recv_counts, expert_starts, ...)``: the way
  back. Each token's rows from its shards are summed in the accumulation dtype (float32, or
  float64 for float64) in shard order, so the result is deterministic; each slot's value is
  taken from the shard that holds its expert (0 for an id of -1).
* ``kt.dispatch_to_shards_sized(...)``: dispatch with the counts known (combine's adjoint).

Dispatch and combine are each other's adjoint, so their autograd formulas are one line each.
Every call exchanges a header (as kt_ops/collectives.py's ops do: op, layer tag, row
shapes, dtypes, the expert shards) with the row counts each rank sends each rank: ranks out
of step, or with different ``expert_starts``, raise on every rank; waiting polls the fault
channel. Data moves with all_to_all_single, one call per tensor.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Optional, Sequence

import torch
from torch import Tensor

from kt_ops.collectives import (_HEADER_FIELDS, _all_to_all, _exchange_headers, _grads_or_zeros,
                                _refuse_recompute, _start, register_collectives)
from kt_ops.profiler_ranges import profiler_range


def shard_starts(num_experts: int, shards: int) -> list[int]:
    """The first expert of each of ``shards`` contiguous ranges, and ``num_experts``: sizes
    differ by at most one, the larger first (``torch.tensor_split``'s rule)."""
    base, extra = divmod(num_experts, shards)
    return [s * base + min(s, extra) for s in range(shards + 1)]


def _check_starts(op: str, expert_starts: Sequence[int], world_size: int) -> None:
    starts = list(expert_starts)
    if len(starts) < 2 or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"kt.{op}: expert_starts must be 0 followed by S >= 1 increasing expert counts "
                         f"(shard s holds [expert_starts[s], expert_starts[s+1])), got {starts}")
    if len(starts) - 1 > world_size:
        raise ValueError(f"kt.{op}: {len(starts) - 1} expert shards need at least as many ranks, "
                         f"the group has {world_size}")


def _layout_code(expert_starts: Sequence[int]) -> int:
    """A number that differs between two expert layouts (checked across ranks)."""
    return zlib.crc32(",".join(map(str, expert_starts)).encode())


@dataclasses.dataclass
class _Routes:
    """Where this rank's tokens go: per shard, the tokens that hit it (ascending)."""
    shard: Tensor              # [T, K]: the shard of each slot's expert, -1 for an empty slot
    tokens: list[Tensor]       # per shard s: int64 token indices
    send_counts: list[int]     # [world_size]: rows sent to each rank (0 past the S owners)

    def slots_of(self, s: int, dims: int) -> Tensor:
        """Which slots of shard ``s``'s tokens are its own, shaped to broadcast over a
        ``dims``-dimensional ``[n, K, ...]`` tensor."""
        mine = self.shard.index_select(0, self.tokens[s]) == s
        return mine.reshape(mine.shape + (1,) * (dims - 2))


def _routes(op: str, topk_ids: Tensor, expert_starts: Sequence[int], world_size: int) -> _Routes:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kt.{op}: topk_ids must be a 2-D [T, K] int32 or int64 tensor, "
                         f"got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    ids = topk_ids.long()
    num_experts = expert_starts[-1]
    if ids.numel() and (bool((ids < -1).any()) or bool((ids >= num_experts).any())):
        bad = ids[(ids < -1) | (ids >= num_experts)][0].item()
        raise IndexError(f"kt.{op}: topk_ids must lie in [0, {num_experts}) or be -1 (no expert), got {bad}")
    bounds = torch.tensor(list(expert_starts[1:-1]), dtype=torch.int64, device=ids.device)
    shard = torch.bucketize(ids, bounds, right=True).masked_fill(ids < 0, -1)
    shards = len(expert_starts) - 1
    tokens = [(shard == s).any(dim=1).nonzero().flatten() for s in range(shards)]
    counts = [int(t.numel()) for t in tokens] + [0] * (world_size - shards)
    return _Routes(shard, tokens, counts)


def _send_slots(slots: Tensor, routes: _Routes, fill) -> Tensor:
    """The slot values each shard receives, in send order: other shards' slots set to ``fill``."""
    other = torch.full((), fill, dtype=slots.dtype, device=slots.device)
    return torch.cat([torch.where(routes.slots_of(s, slots.dim()), slots.index_select(0, tokens), other)
                      for s, tokens in enumerate(routes.tokens)])


def _exchange(t: Tensor, recv_total: int, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    out = t.new_empty((recv_total,) + tuple(t.shape[1:]))
    _all_to_all(out, t, out_splits, in_splits, group)
    return out


def _dispatch(op, rows, slots, topk_ids, expert_starts, rank, world_size, tag, group_name,
              recv_counts: Optional[Tensor] = None, with_local_ids: bool = False):
    tensors = list(rows) + list(slots)
    group = _start(op, rank, world_size, 0, group_name, tensors + [topk_ids], topk_ids.shape[0] if topk_ids.dim() else -1)
    _check_starts(op, expert_starts, world_size)
    routes = _routes(op, topk_ids, expert_starts, world_size)
    with profiler_range(f"kt.{op}"):
        headers = _exchange_headers(op, group, tag, topk_ids.shape[0], tensors + [topk_ids],
                                    _layout_code(expert_starts), routes.send_counts)
        received = headers[:, _HEADER_FIELDS + rank].clone()
        if recv_counts is not None and not torch.equal(received, recv_counts.cpu().long()):
            raise RuntimeError(f"kt.{op}: rank {rank} receives {received.tolist()} rows but the forward "
                               f"received {recv_counts.tolist()}")
        out_splits, total = received.tolist(), int(received.sum())
        order = torch.cat(routes.tokens)
        rows_out = [_exchange(t.index_select(0, order), total, out_splits, routes.send_counts, group)
                    for t in rows]
        slots_out = [_exchange(_send_slots(t, routes, 0), total, out_splits, routes.send_counts, group)
                     for t in slots]
        if not with_local_ids:
            return rows_out, slots_out
        # The expert within the receiving shard (-1: another shard's), computed by the sender.
        starts = torch.tensor(list(expert_starts[:-1]), dtype=torch.int64, device=topk_ids.device)
        local = topk_ids.long() - starts[routes.shard.clamp(min=0)]  # the other shards' slots: -1 below
        local_ids = _exchange(_send_slots(local, routes, -1), total, out_splits, routes.send_counts, group)
        return rows_out, slots_out, local_ids, received


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64 or not dtype.is_floating_point:
        return dtype
    return torch.float32


def _combine(rows, slots, topk_ids, recv_counts, expert_starts, rank, world_size, tag, group_name):
    op = "combine_from_shards"
    counts = recv_counts.cpu().long()
    total = int(counts.sum())
    tensors = list(rows) + list(slots)
    group = _start(op, rank, world_size, 0, group_name, tensors, total)
    _check_starts(op, expert_starts, world_size)
    routes = _routes(op, topk_ids, expert_starts, world_size)
    T = topk_ids.shape[0]
    with profiler_range(f"kt.{op}"):
        headers = _exchange_headers(op, group, tag, total, tensors, _layout_code(expert_starts), counts.tolist())
        coming = headers[:, _HEADER_FIELDS + rank].tolist()
        if coming != routes.send_counts:
            raise RuntimeError(f"kt.{op}: rank {rank} sent {routes.send_counts} rows to the shards but gets "
                               f"{coming} back (topk_ids or recv_counts differ from the dispatch's)")
        back = [_exchange(t, sum(coming), coming, counts.tolist(), group) for t in tensors]
        rows_out = []
        for t in back[:len(rows)]:
            acc = t.new_zeros((T,) + tuple(t.shape[1:]), dtype=_accumulation_dtype(t.dtype))
            for tokens, part in zip(routes.tokens, t.split(routes.send_counts[:len(routes.tokens)])):
                acc.index_add_(0, tokens, part.to(acc.dtype))  # shard by shard: a fixed order
            rows_out.append(acc.to(t.dtype))
        slots_out = []
        for t in back[len(rows):]:
            out = t.new_zeros((T,) + tuple(t.shape[1:]))
            for s, (tokens, part) in enumerate(zip(routes.tokens, t.split(routes.send_counts[:len(routes.tokens)]))):
                out[tokens] = torch.where(routes.slots_of(s, part.dim()), part, out.index_select(0, tokens))
            slots_out.append(out)
        return rows_out, slots_out


def _dispatch_impl(rows, slots, topk_ids, expert_starts, rank, world_size, tag, group_name):
    _refuse_recompute("dispatch_to_shards")
    return _dispatch("dispatch_to_shards", rows, slots, topk_ids, expert_starts, rank, world_size, tag,
                     group_name, with_local_ids=True)


def _dispatch_sized_impl(rows, slots, topk_ids, recv_counts, total_rows, expert_starts, rank, world_size, tag,
                         group_name):
    op = "dispatch_to_shards_sized"
    if total_rows != int(recv_counts.sum()):
        raise ValueError(f"kt.{op}: total_rows={total_rows} on rank {rank} does not match recv_counts "
                         f"{recv_counts.tolist()}")
    return _dispatch(op, rows, slots, topk_ids, expert_starts, rank, world_size, tag, group_name,
                     recv_counts=recv_counts)


register_collectives({"dispatch_to_shards": _dispatch_impl, "dispatch_to_shards_sized": _dispatch_sized_impl,
                      "combine_from_shards": _combine})


# ---- autograd: dispatch and combine are each other's adjoint ------------------------------

def _setup(ctx, rows, slots, topk_ids, recv_counts, outputs, comm_args):
    ctx.wanted = [t.requires_grad and t.dtype.is_floating_point for t in list(rows) + list(slots)]
    ctx.num_rows = len(rows)
    ctx.comm_args = comm_args
    ctx.input_rows = rows[0].shape[0] if rows else (slots[0].shape[0] if slots else 0)
    ctx.save_for_backward(topk_ids, recv_counts, *outputs)


def _dispatch_setup(ctx, inputs, output):
    rows, slots, topk_ids, *comm_args = inputs
    rows_out, slots_out, _local_ids, recv_counts = output
    _setup(ctx, rows, slots, topk_ids, recv_counts, list(rows_out) + list(slots_out), comm_args)


def _dispatch_sized_setup(ctx, inputs, output):
    rows, slots, topk_ids, recv_counts, _total, *comm_args = inputs
    _setup(ctx, rows, slots, topk_ids, recv_counts, list(output[0]) + list(output[1]), comm_args)


def _combine_setup(ctx, inputs, output):
    rows, slots, topk_ids, recv_counts, *comm_args = inputs
    _setup(ctx, rows, slots, topk_ids, recv_counts, list(output[0]) + list(output[1]), comm_args)


def _split_grads(ctx, grad_rows, grad_slots):
    """(topk_ids, recv_counts, row grads, slot grads): the grads of the wanted outputs, zeros
    where one is missing."""
    topk_ids, recv_counts, *outputs = ctx.saved_tensors
    grads = _grads_or_zeros(list(grad_rows) + list(grad_slots), outputs, ctx.wanted)
    n = sum(ctx.wanted[:ctx.num_rows])
    return topk_ids, recv_counts, grads[:n], grads[n:]


def _spread_lists(rows_in, slots_in, wanted, num_rows):
    it_rows, it_slots = iter(rows_in), iter(slots_in)
    rows = [next(it_rows) if w else None for w in wanted[:num_rows]]
    slots = [next(it_slots) if w else None for w in wanted[num_rows:]]
    return rows, slots


def _adjoint(ctx, grad_rows, grad_slots, adjoint_op, num_args: int) -> tuple:
    """Gradients of an op's ``rows`` and ``slots`` (then None for its other ``num_args - 2``
    arguments): its adjoint op applied to its outputs' gradients, zeros where one is missing."""
    if not any(ctx.wanted):
        return (None,) * num_args
    topk_ids, recv_counts, g_rows, g_slots = _split_grads(ctx, grad_rows, grad_slots)
    rows, slots = adjoint_op(g_rows, g_slots, topk_ids, recv_counts, ctx)
    return _spread_lists(rows, slots, ctx.wanted, ctx.num_rows) + (None,) * (num_args - 2)


def _combine_back(rows, slots, topk_ids, recv_counts, ctx):
    return torch.ops.kt.combine_from_shards(rows, slots, topk_ids, recv_counts, *ctx.comm_args)


def _dispatch_back(rows, slots, topk_ids, recv_counts, ctx):
    return torch.ops.kt.dispatch_to_shards_sized(rows, slots, topk_ids, recv_counts, ctx.input_rows, *ctx.comm_args)


def _dispatch_backward(ctx, grad_rows, grad_slots, _grad_ids, _grad_counts):
    return _adjoint(ctx, grad_rows, grad_slots, _combine_back, 8)


def _dispatch_sized_backward(ctx, grad_rows, grad_slots):
    return _adjoint(ctx, grad_rows, grad_slots, _combine_back, 10)


def _combine_backward(ctx, grad_rows, grad_slots):
    return _adjoint(ctx, grad_rows, grad_slots, _dispatch_back, 9)


torch.library.register_autograd("kt::dispatch_to_shards", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("kt::dispatch_to_shards_sized", _dispatch_sized_backward,
                                setup_context=_dispatch_sized_setup)
torch.library.register_autograd("kt::combine_from_shards", _combine_backward, setup_context=_combine_setup)
