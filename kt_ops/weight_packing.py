"""Pre-packed expert weights (oneDNN's blocked layout) for kt.moe's forward GEMMs.

Once a set of bfloat16 expert weights has been passed unchanged to three kt.moe calls (LoRA
training, inference), the op packs it once, with gate and up fused into one GEMM, and reuses
the packed copy until the weights change (their version counter: any in-place update such
as an optimizer step) or are freed. Full fine-tuning changes the weights every step, so they
are never packed there. The packed copies (forward and backward layouts) cost about twice the weights' size in
memory, within a budget (default a quarter of RAM; ``KT_OPS_PACK_WEIGHTS_BUDGET_MB``):
``packed_weights_info()`` reports it, ``release_packed_weights()`` frees it; ``set_weight_packing(False)`` (or the environment
variable ``KT_OPS_PACK_WEIGHTS=0``) turns packing off and frees every packed copy.
"""
from typing import Dict

import torch


def set_weight_packing(enabled: bool) -> None:
    """Turn packing on or off (off also frees every packed copy)."""
    torch.ops.kt._set_weight_packing(bool(enabled))


def weight_packing_enabled() -> bool:
    return torch.ops.kt._weight_packing_enabled()


def release_packed_weights() -> None:
    """Free every packed copy now (weights still in use are packed again after three calls).
    Copies of freed weights go by themselves at the next kt.moe call or packed_weights_info()."""
    torch.ops.kt._release_packed_weights()


def packed_weights_info() -> Dict[str, int]:
    """``{"sets": packed (gate, up, down) sets held, "bytes": their approximate size}``."""
    sets, nbytes = torch.ops.kt._packed_weights_info()
    return {"sets": sets, "bytes": nbytes}
