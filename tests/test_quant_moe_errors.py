"""kt.moe on quantized frozen experts given bad input (eager and under fake tensors): missing or
stray scales, wrong shapes and dtypes, quantized weights that require grad, and a backward asked
for a quantized weight's gradient."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kt_ops
from quantized_samples import BASE, SCALES, quantized_inputs

f32 = torch.float32


def int4_inputs():
    return quantized_inputs("int4", 32, T_shape=(4,), H=64, I=32, E=3, K=2, r=2, dtype=f32, seed=14)


def drop(name):
    def mutate(kw):
        kw[name] = None
    return mutate


def replace(name, make):
    def mutate(kw):
        kw[name] = make(kw)
    return mutate


BAD = [
    ("missing-scale", drop("up_scale"), ValueError, "up_proj is quantized \\(int4, Byte\\) so up_scale must be given"),
    ("scale-for-dense", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64)), ValueError,
     "gate_scale was given but gate_proj is Float"),
    ("wrong-int4-shape", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64, dtype=torch.uint8)), ValueError,
     r"gate_proj \(int4\) must have shape \[3, 32, 32\] \(two int4 values per byte\)"),
    ("bad-group", replace("gate_scale", lambda kw: torch.ones(3, 32, 4)), ValueError,
     "gate_scale has 4 groups per row of 64 values: group_size must be 32, 64 or 128"),
    ("int-scale", replace("down_scale", lambda kw: kw["down_scale"].to(torch.int32)), TypeError,
     "down_scale must be float32 or bfloat16"),
    ("fp16-weight", replace("gate_proj", lambda kw: torch.zeros(3, 32, 64, dtype=torch.float16)), TypeError,
     "gate_proj must have the dtype of hidden_states \\(Float\\) or be quantized"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_bad_quantized_input_raises(case, fake):
    _, mutate, exc, match = case
    kwargs = int4_inputs()
    mutate(kwargs)
    if case[0] == "scale-for-dense":
        kwargs["up_scale"] = kwargs["down_scale"] = None
        kwargs["up_proj"] = torch.zeros(3, 32, 64)
        kwargs["down_proj"] = torch.zeros(3, 64, 32)
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc, match=match):
            kt_ops.moe(**kwargs)
    else:
        with pytest.raises(exc, match=match):
            kt_ops.moe(**kwargs)


def test_fp8_scale_shape_is_checked():
    kwargs = quantized_inputs("fp8", None, T_shape=(4,), H=200, I=130, E=2, K=1, dtype=f32, seed=15)
    kwargs["gate_scale"] = torch.ones(2, 1, 2)
    with pytest.raises(ValueError, match=r"gate_scale must have shape \[E, ceil\(out/128\), ceil\(in/128\)\] = \[2, 2, 2\]"):
        kt_ops.moe(**kwargs)


@pytest.mark.parametrize("what", ["weight", "scale"])
def test_quantized_weights_cannot_require_grad(what):
    kwargs = quantized_inputs("fp8", None, T_shape=(4,), H=128, I=64, E=2, K=1, dtype=f32, seed=16)
    kwargs["gate_proj" if what == "weight" else "gate_scale"].requires_grad_(True)
    kwargs["hidden_states"].requires_grad_(True)
    with pytest.raises(ValueError, match="gate_proj is quantized .* cannot require grad"):
        kt_ops.moe(**kwargs)


def test_backward_refuses_a_quantized_weight_gradient():
    kwargs = int4_inputs()
    args = [kwargs.get(n) for n in ("hidden_states", "topk_ids", "topk_weights", *BASE, "gate_lora_a", "gate_lora_b",
                                    "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")]
    scales = [kwargs[s] for s in SCALES]
    _, act = torch.ops.kt.moe_forward(*args, kwargs["lora_scale"], True, *scales)
    mask = [True, True, False, True, False] + [True] * 6
    with pytest.raises(ValueError, match=r"output_mask\[3\] asks for the gradient of up_proj, which is quantized \(int4\)"):
        torch.ops.kt.moe_backward(torch.ones_like(args[0]), *args[:3], act, *args[3:], kwargs["lora_scale"], mask,
                                  *scales)
