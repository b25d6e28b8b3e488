"""kt_ops: torch.library custom ops for MoE fine-tuning with CPU-resident experts.

``import kt_ops`` loads the native library (schemas, C++ CPU and Meta kernels) and
registers the Python parts (fault-reporting kernel wrappers, collectives, fake kernels,
autograd formulas), after which ``torch.ops.kt.*`` are differentiable ops.
"""
import os

import torch  # noqa: F401  (the extension needs libtorch loaded first)


def _import_meta_kernels_from_source_tree() -> None:
    """``kt_ops.meta_kernels`` from the repository's ``meta_kernels/`` when this package runs from a
    source tree on ``sys.path`` without being installed (an older build in a worktree, say)."""
    import importlib.util
    import sys

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meta_kernels")
    spec = importlib.util.spec_from_file_location("kt_ops.meta_kernels", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kt_ops.meta_kernels"] = module
    spec.loader.exec_module(module)


if os.environ.get("KT_OPS_TEST_LIBRARY"):
    # A test build of the native library in place of the installed one: the AVX-512 kernels emulated on CPUs
    # without AVX-512 (tests/avx512_emulation.py).
    torch.ops.load_library(os.environ["KT_OPS_TEST_LIBRARY"])
else:
    from kt_ops import _C  # noqa: F401  (registers torch.ops.kt.* schemas and C++ kernels)
from kt_ops import _kernels  # noqa: F401
from kt_ops import _autograd  # noqa: F401
try:
    import kt_ops.meta_kernels  # noqa: F401  (installed: setup.py maps meta_kernels/ to kt_ops.meta_kernels)
except ModuleNotFoundError as error:
    if error.name != "kt_ops.meta_kernels":
        raise
    _import_meta_kernels_from_source_tree()
from kt_ops import collectives  # noqa: F401
from kt_ops import shard_collectives  # noqa: F401
from kt_ops import scale_grad  # noqa: F401
from kt_ops import linear as _linear  # noqa: F401  (kt.linear's autograd)
from kt_ops.cpu_isa import cpu_isa, set_cpu_isa, use_cpu_isa
from kt_ops.weight_packing import (packed_weights_info, release_packed_weights, set_weight_packing,
                                   weight_packing_enabled)
from kt_ops.buffer_cache import cached_buffers_info, release_cached_buffers
from kt_ops.checkpoint import checkpoint, checkpoint_context_fn
from kt_ops.collectives import gather_to_owner, scatter_from_owner
from kt_ops.layer import KTMoE
from kt_ops.distributed import expert_parameter_names, expert_parameters, prepare_ddp
from kt_ops.moe import moe
from kt_ops.hf import load_adapter, patch_model, save_adapter  # transformers/peft imported lazily

__all__ = ["moe", "KTMoE", "gather_to_owner", "scatter_from_owner", "checkpoint", "checkpoint_context_fn",
           "patch_model", "save_adapter", "load_adapter", "cpu_isa", "set_cpu_isa", "use_cpu_isa",
           "set_weight_packing", "weight_packing_enabled", "packed_weights_info",
           "release_packed_weights", "cached_buffers_info", "release_cached_buffers", "prepare_ddp",
           "expert_parameters", "expert_parameter_names"]
