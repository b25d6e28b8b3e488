"""Large per-call buffers kept for reuse (the native side is ``csrc/platform/large_alloc.h``).

kt.moe's weight gradients, saved activations and outputs of 8 MiB or more live in memory
mappings that are recycled when the tensors are freed (``zero_grad(set_to_none=True)``, the
next step): memory fresh from the kernel costs a page fault and a zero fill at its first
write, which took up to a quarter of a full fine-tuning step (``benchmarks/buffer_reuse.py``).
Idle buffers stay mapped within a budget (default a quarter of RAM; ``KT_OPS_BUFFER_CACHE_MB``,
0 keeps none):
``cached_buffers_info()`` reports them, ``release_cached_buffers()`` unmaps them.
"""
from typing import Dict

import torch


def release_cached_buffers() -> None:
    """Unmap every idle buffer kept for reuse (buffers in use are not affected)."""
    torch.ops.kt._release_cached_buffers()


def cached_buffers_info() -> Dict[str, int]:
    """``{"buffers": idle buffers kept for reuse, "bytes": their size}``."""
    buffers, nbytes = torch.ops.kt._cached_buffers_info()
    return {"buffers": buffers, "bytes": nbytes}
