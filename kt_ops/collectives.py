"""Python kernels and autograd of the kt collectives (schemas: csrc/ops/registration.cpp).

* ``kt.gather_to_owner(tensors, ...)``: every rank's rows (dim 0) of each tensor,
  concatenated in rank order on the owner rank; 0 rows elsewhere. Also returns the
  per-rank row counts (int64 [world_size], on the CPU, on every rank).
* ``kt.scatter_from_owner(rows, lengths, local_rows, ...)``: the owner's rows cut by
  ``lengths``, each rank receiving its own ``local_rows`` rows.
* ``kt.gather_to_owner_sized(rows, lengths, total_rows, ...)``: gather with known counts
  (the adjoint of scatter; ``total_rows`` is the owner's row count, 0 elsewhere).

Each is the other's adjoint, so their autograd formulas are one line each. Every call
starts with the same small all-gather of a header (which op, which layer, how many rows of
what width and dtype): ranks that are out of step get an error on every rank instead of a
deadlock. Data moves with all_to_all_single (uneven splits), which gloo and NCCL both
support. Waiting polls the fault channel (kt_ops.faults), so a failure on one rank
raises on all.

The ops are marked side-effectful (torch.fx.node.has_side_effect): no dead-code
elimination may drop them, also on a rank where their output looks unused. (The effect-
token API, torch.library._register_effectful_op, breaks inductor on the unbacked row
counts the gather produces, in torch 2.13.)
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx.node import has_side_effect

from kt_ops import faults
from kt_ops.profiler_ranges import profiler_range

# Header layout: one int64 row per rank, then the op's per-destination row counts (if any).
_OP, _TAG, _ROWS, _WIDTH, _DTYPE, _NUM_TENSORS, _SIGNATURE, _LAYOUT = range(8)
_HEADER_FIELDS = 8
_OP_CODES = {"gather_to_owner": 1, "scatter_from_owner": 2, "gather_to_owner_sized": 3,
             "dispatch_to_shards": 4, "dispatch_to_shards_sized": 5, "combine_from_shards": 6}
_OP_NAMES = {v: k for k, v in _OP_CODES.items()}
_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int32,
           torch.int64, torch.int8, torch.uint8, torch.bool]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def _check_rank(op: str, group: dist.ProcessGroup, rank: int, world_size: int, owner_rank: int):
    if group.rank() != rank or group.size() != world_size:
        raise ValueError(f"kt.{op}: rank={rank}, world_size={world_size} do not match the process "
                         f"group (rank {group.rank()} of {group.size()})")
    if not 0 <= owner_rank < world_size:
        raise ValueError(f"kt.{op}: owner_rank must be in [0, {world_size}), got {owner_rank}")


def _exchange_headers(op: str, group: dist.ProcessGroup, tag: int, rows: int,
                      tensors: Sequence[Tensor], layout: int = 0, counts: Sequence[int] = ()) -> Tensor:
    """All-gathers each rank's header and checks that all ranks run the same call. ``layout``
    (an op's placement, e.g. its expert shards) must agree too; ``counts`` (rows this rank
    sends to each rank) ride along unchecked: ``headers[r, _HEADER_FIELDS + d]``."""
    sample = tensors[0]
    width = math.prod(sample.shape[1:])
    dtype = _dtype_code(sample.dtype)
    signature = sum((i + 1) * (math.prod(t.shape[1:]) * 64 + _dtype_code(t.dtype)) for i, t in enumerate(tensors))
    # On the rows' device: NCCL only moves device tensors.
    # Every op's header has the same length (world_size counts, zeros for the owner ops), so
    # that ranks running different ops still meet in one all-gather and get the error below.
    counts = list(counts) or [0] * group.size()
    mine = torch.tensor([_OP_CODES[op], tag, rows, width, dtype, len(tensors), signature, layout, *counts],
                        dtype=torch.int64, device=sample.device)
    slots = [torch.empty_like(mine) for _ in range(group.size())]
    faults.wait_for([dist.all_gather(slots, mine, group=group, async_op=True)], group)
    headers = torch.stack(slots).cpu()
    for field, what in ((_OP, "op"), (_TAG, "tag"), (_WIDTH, "row width"), (_DTYPE, "dtype"),
                        (_NUM_TENSORS, "number of tensors"), (_SIGNATURE, "row shapes or dtypes"),
                        (_LAYOUT, "expert shards")):
        if (headers[:, field] != headers[0, field]).any():
            calls = ", ".join(
                f"rank {r}: kt.{_OP_NAMES.get(int(h[_OP]), '?')}(tag={int(h[_TAG])}, rows={int(h[_ROWS])}, "
                f"row width={int(h[_WIDTH])}, dtype={_DTYPES[int(h[_DTYPE])] if int(h[_DTYPE]) < len(_DTYPES) else '?'})"
                for r, h in enumerate(headers))
            raise RuntimeError(f"kt.{op}: ranks are out of step (their {what} differs): {calls}")
    return headers


def _all_to_all(out: Tensor, rows: Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> None:
    """Variable-length exchange of rows (dim 0). all_to_all_single is one collective on
    gloo and NCCL alike, and its work can be polled (gloo's point-to-point works cannot)."""
    if group.size() == 1:
        out.copy_(rows)
        return
    work = dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group, async_op=True)
    faults.wait_for([work], group)


def _gather_rows(rows: Tensor, lengths: list[int], rank: int, owner_rank: int,
                 group: dist.ProcessGroup) -> Tensor:
    """Every rank's rows, concatenated on the owner (0 rows elsewhere)."""
    is_owner = rank == owner_rank
    out = rows.new_empty((sum(lengths) if is_owner else 0,) + tuple(rows.shape[1:]))
    out_splits = lengths if is_owner else [0] * len(lengths)
    in_splits = [rows.shape[0] if r == owner_rank else 0 for r in range(len(lengths))]
    _all_to_all(out, rows, out_splits, in_splits, group)
    return out


def _scatter_rows(rows: Tensor, lengths: list[int], rank: int, owner_rank: int,
                  group: dist.ProcessGroup) -> Tensor:
    """The owner's rows cut by lengths, each rank receiving its own (the adjoint of gather)."""
    is_owner = rank == owner_rank
    out = rows.new_empty((lengths[rank],) + tuple(rows.shape[1:]))
    out_splits = [lengths[rank] if r == owner_rank else 0 for r in range(len(lengths))]
    in_splits = lengths if is_owner else [0] * len(lengths)
    _all_to_all(out, rows, out_splits, in_splits, group)
    return out


def _run_reporting_failures(fn, *args):
    try:
        return fn(*args)
    except faults.RemoteRankFailure:
        raise
    except Exception as error:  # tell the other ranks before raising here
        faults.report_failure(error)
        raise


def _start(op: str, rank: int, world_size: int, owner_rank: int, group_name: str,
           tensors: Sequence[Tensor], rows: int) -> dist.ProcessGroup:
    """Checks shared by all three ops; returns the group."""
    group = _group(group_name)
    faults.register_group(group)
    faults.check_group(group)
    _check_rank(op, group, rank, world_size, owner_rank)
    if len(tensors) == 0:
        raise ValueError(f"kt.{op}: tensors must hold at least one tensor")
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != rows:
            raise ValueError(f"kt.{op}: every tensor must have {rows} rows (dim 0) on rank {rank}; "
                             f"tensors[{i}] has shape {tuple(t.shape)}")
    return group


def _refuse_recompute(op: str) -> None:
    """A forward collective that runs inside backward is activation checkpointing replaying
    it: ranks may not replay alike, so this is refused (the fix: kt's checkpoint policy)."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"kt.{op} was called during backward: activation checkpointing is recomputing a "
            "distributed KT layer, which would replay its collectives (ranks can deadlock). "
            "Checkpoint with kt_ops' policy instead: torch.utils.checkpoint.checkpoint(fn, ..., "
            "use_reentrant=False, context_fn=kt_ops.checkpoint_context_fn), or kt_ops.checkpoint(fn, ...)")


def _gather_impl(tensors, rank, world_size, owner_rank, tag, group_name):
    _refuse_recompute("gather_to_owner")
    rows = tensors[0].shape[0] if len(tensors) and tensors[0].dim() > 0 else -1
    group = _start("gather_to_owner", rank, world_size, owner_rank, group_name, tensors, rows)
    with profiler_range("kt.gather_to_owner"):
        headers = _exchange_headers("gather_to_owner", group, tag, rows, tensors)
        lengths = headers[:, _ROWS].clone()
        counts = lengths.tolist()
        gathered = [_gather_rows(t, counts, rank, owner_rank, group) for t in tensors]
    return gathered, lengths


def _gather_sized_impl(tensors, lengths, total_rows, rank, world_size, owner_rank, tag, group_name):
    op = "gather_to_owner_sized"
    counts = lengths.tolist()
    group = _start(op, rank, world_size, owner_rank, group_name, tensors, counts[rank])
    if total_rows != (sum(counts) if rank == owner_rank else 0):
        raise ValueError(f"kt.{op}: total_rows={total_rows} on rank {rank} does not match lengths {counts}")
    with profiler_range(f"kt.{op}"):
        _exchange_headers(op, group, tag, counts[rank], tensors)
        return [_gather_rows(t, counts, rank, owner_rank, group) for t in tensors]


def _scatter_impl(tensors, lengths, local_rows, rank, world_size, owner_rank, tag, group_name):
    op = "scatter_from_owner"
    counts = lengths.tolist()
    group = _start(op, rank, world_size, owner_rank, group_name, tensors,
                   sum(counts) if rank == owner_rank else 0)
    if local_rows != counts[rank]:
        raise ValueError(f"kt.{op}: local_rows={local_rows} on rank {rank} does not match lengths {counts}")
    with profiler_range(f"kt.{op}"):
        _exchange_headers(op, group, tag, local_rows, tensors)
        return [_scatter_rows(t, counts, rank, owner_rank, group) for t in tensors]


def register_collectives(impls: dict) -> None:
    """``{op name: kernel}`` as the CPU and CUDA kernels of ``kt::<name>``, each reporting its
    failures to the other ranks, and marked side-effectful (see the module doc)."""
    for name, impl in impls.items():
        for key in ("CPU", "CUDA"):
            torch.library.impl(f"kt::{name}", key)(lambda *args, impl=impl: _run_reporting_failures(impl, *args))
        has_side_effect(getattr(torch.ops.kt, name).default)


register_collectives({"gather_to_owner": _gather_impl, "gather_to_owner_sized": _gather_sized_impl,
                      "scatter_from_owner": _scatter_impl})


# ---- autograd: each op's backward is its adjoint ------------------------------------------
#
# A backward takes the gradients of *all* differentiable tensors in one call, with zeros
# where a gradient is missing (an output unused on this rank). Two reasons: every rank then
# makes the same collectives whatever it used, and a collective that received only zeros
# would depend on no backward input, so AOTAutograd's partitioner could hoist it into the
# forward graph, putting the ranks out of step.

def _differentiable(tensors):
    return [t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex) for t in tensors]


def _grads_or_zeros(grads, outputs, wanted):
    return [(g if g is not None else torch.zeros_like(o)).contiguous()
            for g, o, w in zip(grads, outputs, wanted) if w]


def _spread(values, wanted):
    it = iter(values)
    return [next(it) if w else None for w in wanted]


def _save_list_op(ctx, tensors, outputs, comm_args, lengths):
    ctx.comm_args = comm_args
    ctx.input_rows = tensors[0].shape[0]
    ctx.wanted = _differentiable(tensors)
    ctx.save_for_backward(lengths, *outputs)


def _adjoint(ctx, grads, adjoint_op):
    """Gradients of a list op's inputs: its adjoint op applied to the outputs' gradients."""
    lengths, *outputs = ctx.saved_tensors
    if not any(ctx.wanted):
        return None
    g = adjoint_op(_grads_or_zeros(grads, outputs, ctx.wanted), lengths, ctx.input_rows, *ctx.comm_args)
    return _spread(g, ctx.wanted)


def _gather_setup(ctx, inputs, output):
    tensors, *comm_args = inputs
    _save_list_op(ctx, tensors, output[0], comm_args, output[1])


def _sized_setup(ctx, inputs, output):  # scatter_from_owner and gather_to_owner_sized
    tensors, lengths, _rows, *comm_args = inputs
    _save_list_op(ctx, tensors, output, comm_args, lengths)


def _gather_backward(ctx, grads, _grad_lengths):
    return (_adjoint(ctx, grads, torch.ops.kt.scatter_from_owner),) + (None,) * 5


def _scatter_backward(ctx, grads):
    return (_adjoint(ctx, grads, torch.ops.kt.gather_to_owner_sized),) + (None,) * 7


def _gather_sized_backward(ctx, grads):
    return (_adjoint(ctx, grads, torch.ops.kt.scatter_from_owner),) + (None,) * 7


torch.library.register_autograd("kt::gather_to_owner", _gather_backward, setup_context=_gather_setup)
torch.library.register_autograd("kt::scatter_from_owner", _scatter_backward, setup_context=_sized_setup)
torch.library.register_autograd("kt::gather_to_owner_sized", _gather_sized_backward, setup_context=_sized_setup)


# ---- Python API ---------------------------------------------------------------------------

def _resolve(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("kt_ops collectives need torch.distributed to be initialized "
                               "(init_process_group) or an explicit process group")
        group = dist.group.WORLD
    return group


def gather_to_owner(tensors: Sequence[Tensor], owner_rank: int = 0, *,
                    group: Optional[dist.ProcessGroup] = None, tag: int = 0):
    """Concatenates every rank's rows of each tensor on ``owner_rank``.

    Args:
        tensors: tensors with the same number of rows (dim 0) on this rank, any dtype and
            trailing shape (the same on every rank).
        owner_rank: rank (in ``group``) that receives the rows.
        group: process group (default: the world).
        tag: an id of the call site (e.g. the layer), checked to agree across ranks.

    Returns:
        ``(gathered, lengths)``: on the owner each ``gathered[i]`` is
        ``[sum(lengths), ...]`` in rank order, elsewhere ``[0, ...]``; ``lengths`` is the
        int64 ``[world_size]`` CPU tensor of every rank's row count.
    """
    group = _resolve(group)
    return torch.ops.kt.gather_to_owner(list(tensors), group.rank(), group.size(), owner_rank, tag,
                                        group.group_name)


def scatter_from_owner(tensors: Sequence[Tensor], lengths: Tensor, local_rows: int, owner_rank: int = 0, *,
                       group: Optional[dist.ProcessGroup] = None, tag: int = 0) -> list[Tensor]:
    """Sends each rank its rows back from the owner: the adjoint of :func:`gather_to_owner`.

    Each tensor is ``[sum(lengths), ...]`` on the owner and ``[0, ...]`` elsewhere; returns
    a list of ``[local_rows, ...]`` tensors on every rank (``local_rows == lengths[rank]``).
    """
    group = _resolve(group)
    return torch.ops.kt.scatter_from_owner(list(tensors), lengths, local_rows, group.rank(), group.size(),
                                           owner_rank, tag, group.group_name)
