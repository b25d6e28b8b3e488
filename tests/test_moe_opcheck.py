"""torch.library.opcheck on kt.moe, kt.moe_forward and kt.moe_backward: schema (no hidden
mutation or aliasing), autograd registration, fake/Meta kernels consistent with the CPU
kernels, and AOTAutograd with dynamic shapes (compiled forward + backward match eager)."""
import pytest
import torch

import kt_ops  # noqa: F401  (registers torch.ops.kt.*)
from moe_samples import SAMPLE_IDS, SAMPLES, positional

_BY_NAME = {s.name: s for s in SAMPLES}

# A few (sample, save_activations) cases for the inner forward (kt.moe's opcheck above
# already runs it over the whole matrix through AOTAutograd): every dtype, LoRA/full, K = 0,
# [B, S, H], non-contiguous inputs.
FORWARD_CASES = [
    ("fp32-hybrid", True), ("bf16-lora", True), ("BSH-hybrid", True), ("K0-hybrid", True),
    ("fp64-inference", False), ("noncontiguous-full-bf16", False),
]
# A few (sample, output_mask kind) cases for moe_backward.
BACKWARD_CASES = [
    ("fp32-hybrid", "all"), ("bf16-lora", "lora-only"), ("fp64-full", "base-only"),
    ("T0-hybrid", "all"), ("noncontiguous-hybrid", "hidden-only"),
    ("bf16-hidden-fp32-weights-hybrid", "all"),
]


def _detached(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_opcheck_moe(sample):
    """opcheck with all default test_utils on torch.ops.kt.moe, requires_grad per mode."""
    torch.library.opcheck(torch.ops.kt.moe, positional(sample.make()))


@pytest.mark.parametrize("name,save", FORWARD_CASES, ids=[f"{n}-{'save' if s else 'nosave'}"
                                                             for n, s in FORWARD_CASES])
def test_opcheck_moe_forward(name, save):
    """opcheck on torch.ops.kt.moe_forward, with and without saved activations."""
    args = positional(_BY_NAME[name].make())
    if not save:
        # Without saved activations the op has no backward: check it as inference.
        args = _detached(args)
    torch.library.opcheck(torch.ops.kt.moe_forward, args + (save,))


@pytest.mark.parametrize("name,mask", BACKWARD_CASES, ids=[f"{n}-{m}" for n, m in BACKWARD_CASES])
def test_opcheck_moe_backward(name, mask):
    """opcheck on torch.ops.kt.moe_backward with activations saved by moe_forward."""
    kwargs = _BY_NAME[name].make()
    args = _detached(positional(kwargs))
    _, activations = torch.ops.kt.moe_forward(*args, True)
    has_lora = kwargs.get("gate_lora_a") is not None
    output_mask = {
        "all": [True] * 5 + [has_lora] * 6,
        "lora-only": [True, True, False, False, False] + [has_lora] * 6,
        "base-only": [False, False, True, True, True] + [False] * 6,
        "hidden-only": [True] + [False] * 10,
    }[mask]
    grad_output = torch.randn(args[0].shape, dtype=torch.float64).to(args[0].dtype)
    torch.library.opcheck(
        torch.ops.kt.moe_backward,
        (grad_output, *args[:3], activations, *args[3:], output_mask),
    )
