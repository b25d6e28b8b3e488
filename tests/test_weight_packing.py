"""Pre-packed expert weights (csrc/gemm/packed_weights.h): packed after three calls with the
same weights, results equal to the unpacked op and the float64 reference, never stale after
an in-place update, never packed when weights change every step, dropped when freed or
switched off.

Packing is oneDNN's bf16 reorder, used on the avx512_bf16 path only: these tests run there
(forced with use_cpu_isa, whatever KT_OPS_CPU_ISA says) and skip on CPUs without AVX512-BF16.
That no other path ever packs is tested in test_base_gemm.py on every CPU."""
import gc

import pytest
import torch

import kt_ops
from kt_ops.cpu_isa import best_cpu_isa, supported_cpu_isas
from kt_ops.weight_packing import (packed_weights_info, release_packed_weights, set_weight_packing,
                                   weight_packing_enabled)
from moe_samples import make_moe_inputs
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

PACK_AFTER = 3  # kPackAfterCalls

pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in supported_cpu_isas(),
    reason=f"weight packing needs AVX512-BF16 (oneDNN's bf16 reorder); this CPU's best path is {best_cpu_isa()}")


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test starts on the avx512_bf16 path with packing on and an empty cache."""
    set_weight_packing(False)
    set_weight_packing(True)
    with kt_ops.use_cpu_isa("avx512_bf16"):
        yield
    set_weight_packing(False)
    set_weight_packing(True)


def inputs(mode="lora", dtype=torch.bfloat16, seed=0):
    return make_moe_inputs(T_shape=(40,), H=64, I=48, E=4, K=2, r=0 if mode == "full" else 4, dtype=dtype,
                           mode=mode, seed=seed)


def assert_matches_reference(kwargs):
    grad_out = grad_output_for(kwargs)
    out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    tol = TOLERANCE[kwargs["hidden_states"].dtype]
    assert rel_err(out, ref_out) < tol
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < tol, name
    return out


def test_packed_after_three_calls_and_results_unchanged():
    kwargs = inputs()
    outs = []
    for call in range(PACK_AFTER + 2):
        assert packed_weights_info()["sets"] == (1 if call >= PACK_AFTER else 0), call
        outs.append(assert_matches_reference(kwargs))
    assert packed_weights_info()["sets"] == 1
    assert packed_weights_info()["bytes"] >= sum(kwargs[n].numel() * 2 for n in ("gate_proj", "up_proj", "down_proj"))
    # packed (calls 4, 5) vs unpacked (call 1): the same math, one bf16 rounding apart at most
    assert rel_err(outs[-1], outs[0]) < 1e-2
    assert rel_err(outs[-1], outs[-2]) == 0  # packed calls are deterministic


def test_decode_sized_calls_never_pack():
    """Calls whose experts all get at most 4 rows (kGemvMaxRows) run row dot products on the
    plain weights; they must not pack (a copy they would never use)."""
    kwargs = inputs(mode="inference")
    decode = {**kwargs, "hidden_states": kwargs["hidden_states"][:1], "topk_ids": kwargs["topk_ids"][:1],
              "topk_weights": kwargs["topk_weights"][:1]}
    for _ in range(PACK_AFTER + 2):
        assert_matches_reference(decode)
    assert packed_weights_info()["sets"] == 0
    for _ in range(PACK_AFTER):  # 40 tokens over 4 experts: GEMM-sized blocks
        assert_matches_reference(kwargs)
    assert packed_weights_info()["sets"] == 1
    assert_matches_reference(decode)  # still right with the packed copies around


def test_in_place_update_is_never_served_stale():
    kwargs = inputs()
    for _ in range(PACK_AFTER + 1):
        kt_ops.moe(**kwargs)
    assert packed_weights_info()["sets"] == 1
    with torch.no_grad():
        kwargs["up_proj"].mul_(-1.5)  # an optimizer-like in-place step on one of the three
    assert_matches_reference(kwargs)
    assert packed_weights_info()["sets"] == 0  # dropped at once
    for _ in range(PACK_AFTER):
        kt_ops.moe(**kwargs)
    assert packed_weights_info()["sets"] == 1  # and packed again once stable
    assert_matches_reference(kwargs)


def test_weights_changing_every_step_are_never_packed():
    kwargs = inputs(mode="full")
    opt = torch.optim.SGD([kwargs[n] for n in ("gate_proj", "up_proj", "down_proj")], lr=1e-3)
    for _ in range(PACK_AFTER + 3):
        kt_ops.moe(**kwargs).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert packed_weights_info()["sets"] == 0
    assert_matches_reference(kwargs)


def test_freed_weights_are_forgotten():
    kwargs = inputs()
    for _ in range(PACK_AFTER + 1):
        kt_ops.moe(**kwargs)
    assert packed_weights_info()["sets"] == 1
    del kwargs
    gc.collect()
    assert packed_weights_info()["sets"] == 0
    other = inputs(seed=1)  # may reuse the freed addresses: must not be mistaken for them
    assert_matches_reference(other)


def test_release_drops_copies_and_repacks():
    kwargs = inputs()
    for _ in range(PACK_AFTER):
        kt_ops.moe(**kwargs)
    assert packed_weights_info()["sets"] == 1
    release_packed_weights()
    assert packed_weights_info() == {"sets": 0, "bytes": 0}
    for _ in range(PACK_AFTER):
        assert_matches_reference(kwargs)
    assert packed_weights_info()["sets"] == 1


def test_switched_off_and_non_bf16_are_not_packed():
    set_weight_packing(False)
    assert not weight_packing_enabled()
    kwargs = inputs()
    for _ in range(PACK_AFTER + 1):
        kt_ops.moe(**kwargs)
    assert packed_weights_info()["sets"] == 0
    set_weight_packing(True)
    f32 = inputs(dtype=torch.float32)
    for _ in range(PACK_AFTER + 1):
        assert_matches_reference(f32)
    assert packed_weights_info()["sets"] == 0


def test_inference_tensors_work_and_are_not_packed():
    with torch.inference_mode():
        kwargs = inputs(mode="inference")
        outs = [kt_ops.moe(**kwargs) for _ in range(PACK_AFTER + 1)]
    assert packed_weights_info()["sets"] == 0
    ref_out, _ = run_reference(inputs(mode="inference"), None)
    assert rel_err(outs[-1], ref_out) < TOLERANCE[torch.bfloat16]


def test_budget_zero_never_packs():
    import subprocess
    import sys
    code = ("import kt_ops, sys; sys.path.insert(0, 'tests'); from moe_samples import make_moe_inputs\n"
            "kw = make_moe_inputs(T_shape=(8,), H=64, I=48, E=4, K=2, r=2, dtype=__import__('torch').bfloat16, mode='lora')\n"
            "[kt_ops.moe(**kw) for _ in range(5)]\n"
            "print(kt_ops.packed_weights_info()['sets'])")
    env = dict(__import__("os").environ, KT_OPS_PACK_WEIGHTS_BUDGET_MB="0", KT_OPS_CPU_ISA="avx512_bf16")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0"
