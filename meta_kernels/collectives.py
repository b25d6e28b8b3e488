"""Fake (shape-only) kernels of the kt collectives, for FakeTensor tracing.

The gather's row count on the owner is the sum of every rank's count, known only at run
time: it is a fresh unbacked SymInt, shared by all gathered tensors of one call (they have
the same rows, so the shapes of kt.moe's inputs agree symbolically).
"""
import torch


@torch.library.register_fake("kt::gather_to_owner")
def gather_to_owner_fake(tensors, rank, world_size, owner_rank, tag, group_name):
    rows = torch.library.get_ctx().new_dynamic_size() if rank == owner_rank else 0
    gathered = [t.new_empty((rows,) + tuple(t.shape[1:])) for t in tensors]
    lengths = torch.empty(world_size, dtype=torch.int64, device="cpu")
    return gathered, lengths


@torch.library.register_fake("kt::gather_to_owner_sized")
def gather_to_owner_sized_fake(tensors, lengths, total_rows, rank, world_size, owner_rank, tag, group_name):
    return [t.new_empty((total_rows,) + tuple(t.shape[1:])) for t in tensors]


@torch.library.register_fake("kt::scatter_from_owner")
def scatter_from_owner_fake(tensors, lengths, local_rows, rank, world_size, owner_rank, tag, group_name):
    return [t.new_empty((local_rows,) + tuple(t.shape[1:])) for t in tensors]
