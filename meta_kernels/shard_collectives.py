"""Fake (shape-only) kernels of the sharded layer's collectives (kt_ops/shard_collectives.py).

What an owner receives is known only at run time: a fresh unbacked SymInt, shared by every
output of one dispatch (so that kt.moe's inputs agree symbolically); a rank past the S
owners receives nothing. The way back has the token's own row count.
"""
import torch


@torch.library.register_fake("kt::dispatch_to_shards")
def dispatch_to_shards_fake(rows, slots, topk_ids, expert_starts, rank, world_size, tag, group_name):
    n = torch.library.get_ctx().new_dynamic_size() if rank < len(expert_starts) - 1 else 0
    rows_out = [t.new_empty((n,) + tuple(t.shape[1:])) for t in rows]
    slots_out = [t.new_empty((n,) + tuple(t.shape[1:])) for t in slots]
    local_ids = topk_ids.new_empty((n, topk_ids.shape[1]), dtype=torch.int64)
    recv_counts = torch.empty(world_size, dtype=torch.int64, device="cpu")
    return rows_out, slots_out, local_ids, recv_counts


@torch.library.register_fake("kt::dispatch_to_shards_sized")
def dispatch_to_shards_sized_fake(rows, slots, topk_ids, recv_counts, total_rows, expert_starts, rank, world_size,
                                  tag, group_name):
    return ([t.new_empty((total_rows,) + tuple(t.shape[1:])) for t in rows],
            [t.new_empty((total_rows,) + tuple(t.shape[1:])) for t in slots])


@torch.library.register_fake("kt::combine_from_shards")
def combine_from_shards_fake(rows, slots, topk_ids, recv_counts, expert_starts, rank, world_size, tag, group_name):
    T = topk_ids.shape[0]
    return ([t.new_empty((T,) + tuple(t.shape[1:])) for t in rows],
            [t.new_empty((T,) + tuple(t.shape[1:])) for t in slots])
