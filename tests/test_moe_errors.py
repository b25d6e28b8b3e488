"""Bad input to kt.moe / kt.moe_backward raises a Python exception of the documented type whose
message names the offending argument, in eager CPU calls and under FakeTensorMode (the Meta
kernels validate too, so tracing fails the same way as running)."""
from typing import Callable, Dict, NamedTuple, Type

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kt_ops
from moe_samples import make_moe_inputs, positional

T, H, I, E, K, R = 4, 6, 5, 3, 2, 2


def base_inputs(**overrides) -> Dict[str, object]:
    """Valid inputs (with LoRA on all three projections) that the cases below break."""
    return make_moe_inputs(**{**dict(T_shape=(T,), H=H, I=I, E=E, K=K, r=R, mode="inference", seed=0),
                              **overrides})


class Case(NamedTuple):
    id: str
    mutate: Callable[[Dict[str, object]], None]
    exc: Type[Exception]
    match: str
    fake: bool = True  # also checked under FakeTensorMode (shape/dtype problems)


def reshaped(name, *shape):
    def mutate(kw):
        kw[name] = torch.zeros(shape, dtype=kw[name].dtype)
    return mutate


def retyped(name, dtype):
    def mutate(kw):
        kw[name] = kw[name].to(dtype)
    return mutate


def dropped(name):
    def mutate(kw):
        kw[name] = None
    return mutate


def on_meta(name):
    def mutate(kw):
        kw[name] = kw[name].to("meta")
    return mutate


def set_id(value):
    def mutate(kw):
        kw["topk_ids"][1, 1] = value
    return mutate


def setting(name, value):
    def mutate(kw):
        kw[name] = value
    return mutate


def both(*mutations):
    def mutate(kw):
        for m in mutations:
            m(kw)
    return mutate


CASES = [
    # Expert ids out of range (values: not visible to a fake kernel).
    Case("ids-too-large", set_id(E), IndexError, "topk_ids", fake=False),
    Case("ids-negative", set_id(-2), IndexError, "topk_ids", fake=False),  # -1 is an empty slot
    Case("ids-far-too-large", set_id(10**9), IndexError, "topk_ids", fake=False),
    # Shapes of routing tensors.
    Case("ids-wrong-T", reshaped("topk_ids", T + 1, K), ValueError, "topk_ids"),
    Case("ids-wrong-ndim", reshaped("topk_ids", 1, T, K), ValueError, "topk_ids"),
    Case("weights-wrong-K", reshaped("topk_weights", T, K + 1), ValueError, "topk_weights"),
    Case("weights-wrong-T", reshaped("topk_weights", T - 1, K), ValueError, "topk_weights"),
    # Shapes of base weights.
    Case("gate-wrong-H", reshaped("gate_proj", E, I, H + 1), ValueError, "gate_proj"),
    Case("gate-2d", reshaped("gate_proj", I, H), ValueError, "gate_proj"),
    Case("up-wrong-E", reshaped("up_proj", E + 1, I, H), ValueError, "up_proj"),
    Case("up-wrong-I", reshaped("up_proj", E, I + 1, H), ValueError, "up_proj"),
    Case("up-wrong-H", reshaped("up_proj", E, I, H - 1), ValueError, "up_proj"),
    Case("down-wrong-I", reshaped("down_proj", E, H, I + 1), ValueError, "down_proj"),
    Case("down-transposed", reshaped("down_proj", E, I, H), ValueError, "down_proj"),
    Case("down-wrong-E", reshaped("down_proj", E - 1, H, I), ValueError, "down_proj"),
    Case("down-4d", reshaped("down_proj", 1, E, H, I), ValueError, "down_proj"),
    # Shapes of LoRA tensors.
    Case("gate_a-wrong-in", reshaped("gate_lora_a", E, R, H + 1), ValueError, "gate_lora_a"),
    Case("gate_a-wrong-E", reshaped("gate_lora_a", E + 1, R, H), ValueError, "gate_lora_a"),
    Case("gate_b-wrong-out", reshaped("gate_lora_b", E, I + 1, R), ValueError, "gate_lora_b"),
    Case("up_a-wrong-in", reshaped("up_lora_a", E, R, I), ValueError, "up_lora_a"),
    Case("up_b-wrong-out", reshaped("up_lora_b", E, H, R), ValueError, "up_lora_b"),
    Case("down_a-wrong-in", reshaped("down_lora_a", E, R, H), ValueError, "down_lora_a"),
    Case("down_b-wrong-out", reshaped("down_lora_b", E, I, R), ValueError, "down_lora_b"),
    Case("down_b-wrong-E", reshaped("down_lora_b", E - 1, H, R), ValueError, "down_lora_b"),
    Case("lora_a-2d", reshaped("gate_lora_a", R, H), ValueError, "gate_lora_a"),
    Case("lora_b-2d", reshaped("up_lora_b", I, R), ValueError, "up_lora_b"),
    # Ranks that disagree: within a pair, and between projections.
    Case("rank-mismatch-in-pair", reshaped("gate_lora_b", E, I, R + 1), ValueError, "gate_lora_b"),
    Case("rank-mismatch-up", both(reshaped("up_lora_a", E, R + 1, H), reshaped("up_lora_b", E, I, R + 1)),
         ValueError, "up_lora_a"),
    Case("rank-mismatch-down", both(reshaped("down_lora_a", E, R + 1, I),
                                    reshaped("down_lora_b", E, H, R + 1)), ValueError, "down_lora_a"),
    # A LoRA half without the other half.
    Case("gate_a-without-b", dropped("gate_lora_b"), ValueError, "gate_lora_b"),
    Case("up_b-without-a", dropped("up_lora_a"), ValueError, "up_lora_a"),
    Case("down_a-without-b", dropped("down_lora_b"), ValueError, "down_lora_b"),
    # Dims of hidden_states.
    Case("hidden-0d", setting("hidden_states", torch.tensor(1.0)), ValueError, "hidden_states"),
    Case("hidden-wrong-T", reshaped("hidden_states", T + 2, H), ValueError, "topk_ids"),
    Case("hidden-extra-dim", reshaped("hidden_states", 1, T, H), ValueError, "topk_ids"),
    Case("hidden-wrong-H", reshaped("hidden_states", T, H + 1), ValueError, "gate_proj"),
    # Dtypes.
    Case("hidden-float16", retyped("hidden_states", torch.float16), TypeError, "hidden_states"),
    Case("hidden-int", retyped("hidden_states", torch.int64), TypeError, "hidden_states"),
    Case("ids-float", retyped("topk_ids", torch.float32), TypeError, "topk_ids"),
    Case("ids-int16", retyped("topk_ids", torch.int16), TypeError, "topk_ids"),
    Case("weights-float16", retyped("topk_weights", torch.float16), TypeError, "topk_weights"),
    Case("weights-int", retyped("topk_weights", torch.int64), TypeError, "topk_weights"),
    Case("gate-float64", retyped("gate_proj", torch.float64), TypeError, "gate_proj"),
    Case("up-bf16", retyped("up_proj", torch.bfloat16), TypeError, "up_proj"),
    Case("down-float64", retyped("down_proj", torch.float64), TypeError, "down_proj"),
    Case("gate_a-bf16", retyped("gate_lora_a", torch.bfloat16), TypeError, "gate_lora_a"),
    Case("down_b-float64", retyped("down_lora_b", torch.float64), TypeError, "down_lora_b"),
    # Non-finite lora_scale.
    Case("scale-nan", setting("lora_scale", float("nan")), ValueError, "lora_scale"),
    Case("scale-inf", setting("lora_scale", float("inf")), ValueError, "lora_scale"),
    Case("scale-neg-inf", setting("lora_scale", float("-inf")), ValueError, "lora_scale"),
    # Devices: one meta tensor among CPU tensors (meta kernel is picked, and checks devices).
    Case("meta-ids", on_meta("topk_ids"), RuntimeError, "topk_ids", fake=False),
    Case("meta-weights", on_meta("topk_weights"), RuntimeError, "topk_weights", fake=False),
    Case("meta-gate", on_meta("gate_proj"), RuntimeError, "gate_proj", fake=False),
    Case("meta-down", on_meta("down_proj"), RuntimeError, "down_proj", fake=False),
    Case("meta-up_b", on_meta("up_lora_b"), RuntimeError, "up_lora_b", fake=False),
    Case("meta-hidden", on_meta("hidden_states"), RuntimeError, "device of hidden_states", fake=False),
]


def _broken(case: Case) -> Dict[str, object]:
    kw = base_inputs()
    case.mutate(kw)
    return kw


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_naming_the_argument(case):
    """kt_ops.moe (and the raw op) raise case.exc mentioning the argument."""
    kw = _broken(case)
    with pytest.raises(case.exc, match=case.match):
        kt_ops.moe(**kw)
    with pytest.raises(case.exc, match=case.match):
        torch.ops.kt.moe(*positional(kw))


@pytest.mark.parametrize("case", [c for c in CASES if c.fake], ids=[c.id for c in CASES if c.fake])
def test_fake_tensor_mode_raises_the_same_error(case):
    """Under FakeTensorMode the Meta kernel rejects the same input with the same message."""
    kw = _broken(case)
    with pytest.raises(case.exc, match=case.match) as eager:
        torch.ops.kt.moe(*positional(kw))
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        with pytest.raises(case.exc, match=case.match) as traced:
            torch.ops.kt.moe(*positional(fake))
    assert str(traced.value).splitlines()[0] == str(eager.value).splitlines()[0]


@pytest.mark.parametrize("case", [c for c in CASES if c.fake][:12], ids=[c.id for c in CASES if c.fake][:12])
def test_bad_input_with_grad_raises_before_autograd(case):
    """The same validation when inputs require grad (the autograd path of moe_forward)."""
    kw = _broken(case)
    for name in ("hidden_states", "gate_proj"):
        if isinstance(kw.get(name), torch.Tensor) and kw[name].is_floating_point():
            kw[name].requires_grad_(True)
    with pytest.raises(case.exc, match=case.match):
        kt_ops.moe(**kw)


def test_moe_forward_validates_too():
    """moe_forward (the inner op) checks like kt.moe does."""
    kw = _broken(CASES[0])
    with pytest.raises(IndexError, match="topk_ids"):
        torch.ops.kt.moe_forward(*positional(kw), True)
    kw = base_inputs()
    reshaped("down_lora_b", E, H + 1, R)(kw)
    with pytest.raises(ValueError, match="down_lora_b"):
        torch.ops.kt.moe_forward(*positional(kw), False)


# ----- kt.moe_backward -----

def _backward_args(kw):
    """(grad_output, hidden, ids, weights, activations, gate, up, down, 6 lora, scale) from
    a valid forward with saved activations."""
    args = positional(kw)
    _, act = torch.ops.kt.moe_forward(*args, True)
    return [torch.randn(T, H)] + list(args[:3]) + [act] + list(args[3:])


GOOD_MASK = [True] * 11


BACKWARD_CASES = [
    ("activations-wrong-rows", lambda a: a.__setitem__(4, torch.zeros(2, T * K + 1, I)), ValueError,
     "activations"),
    ("activations-unsaved", lambda a: a.__setitem__(4, torch.zeros(2, 0, I)), ValueError, "activations"),
    ("activations-wrong-I", lambda a: a.__setitem__(4, torch.zeros(2, T * K, I + 1)), ValueError,
     "activations"),
    ("activations-2d", lambda a: a.__setitem__(4, torch.zeros(T * K, I)), ValueError, "activations"),
    ("activations-dtype", lambda a: a.__setitem__(4, a[4].double()), TypeError, "activations"),
    ("grad_output-shape", lambda a: a.__setitem__(0, torch.zeros(T, H + 1)), ValueError, "grad_output"),
    ("grad_output-dtype", lambda a: a.__setitem__(0, a[0].double()), TypeError, "grad_output"),
    ("gate-shape", lambda a: a.__setitem__(5, torch.zeros(E, I, H + 1)), ValueError, "gate_proj"),
    ("weights-shape", lambda a: a.__setitem__(3, torch.zeros(T, K + 1)), ValueError, "topk_weights"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("mutate,exc,match", [c[1:] for c in BACKWARD_CASES],
                         ids=[c[0] for c in BACKWARD_CASES])
def test_moe_backward_bad_input(mutate, exc, match, fake):
    """moe_backward rejects inconsistent activations / grad_output / weights, eager and fake."""
    args = _backward_args(base_inputs())
    mutate(args)
    if fake:
        with FakeTensorMode() as mode:
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(exc, match=match):
                torch.ops.kt.moe_backward(*args, GOOD_MASK)
    else:
        with pytest.raises(exc, match=match):
            torch.ops.kt.moe_backward(*args, GOOD_MASK)


def test_moe_backward_ids_out_of_range():
    """moe_backward routes again and rejects out-of-range ids with IndexError."""
    args = _backward_args(base_inputs())
    args[2] = args[2].clone()
    args[2][0, 0] = E
    with pytest.raises(IndexError, match="topk_ids"):
        torch.ops.kt.moe_backward(*args, GOOD_MASK)


@pytest.mark.parametrize("size", [0, 10, 12])
def test_moe_backward_output_mask_wrong_size(size):
    """An output_mask without exactly 11 entries is rejected with a message naming it."""
    args = _backward_args(base_inputs())
    with pytest.raises(ValueError, match=r"output_mask must have 11 entries"):
        torch.ops.kt.moe_backward(*args, [True] * size)
