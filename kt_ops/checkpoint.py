"""Activation checkpointing that never recomputes kt ops.

Plain activation checkpointing re-runs the checkpointed forward during backward. For a
distributed KT layer that means re-running the gather/scatter collectives (and the CPU
experts): under torch.compile the ranks made different recompute choices, and the
collectives stopped matching (deadlocks, "Received data size doesn't match").

Selective activation checkpointing with a policy that saves the outputs of every kt op
(MUST_SAVE) fixes both: the GPU-side work (attention, router, norms) is recomputed as
usual, while the CPU experts run once per layer per step and no collective is replayed.
This is the torch-native form of KTransformers' "cache the first forward, reuse it in
recompute" machinery. Usage::

    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                      context_fn=kt_ops.checkpoint_context_fn)
    # or: kt_ops.checkpoint(block, x)
    # Hugging Face: model.activation_checkpointing_enable(activation_checkpointing_kwargs={
    #     "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})

Without the policy, a distributed KT layer raises (see kt_ops/collectives.py) instead of
hanging when checkpointing tries to recompute one of its collectives.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _save_kt_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if getattr(op, "namespace", None) == "kt":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_context_fn():
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    selective checkpointing that saves every kt op's outputs and recomputes the rest."""
    return create_selective_checkpoint_contexts(_save_kt_ops)


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` with the kt policy (non-reentrant)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=checkpoint_context_fn, **kwargs)
