"""kt_ops: torch.library custom ops for MoE fine-tuning with CPU-resident experts.

``import kt_ops`` loads the native library (schemas, CPU and Meta kernels) and registers
the autograd formulas, after which ``torch.ops.kt.moe`` is a differentiable op.
"""
import torch  # noqa: F401  (the extension needs libtorch loaded first)

from kt_ops import _C  # noqa: F401  (registers torch.ops.kt.*)
from kt_ops import _autograd  # noqa: F401  (registers autograd of kt.moe_forward)
from kt_ops.moe import moe

__all__ = ["moe"]
