"""Large per-call buffers recycled across calls (csrc/platform/large_alloc.h): a recycled buffer
holds the previous call's values, so every element the op returns must be written or zeroed
again. Buffers here are poisoned with NaN before they are freed; the next call must give the
float64 reference's values (and exact zeros for the experts that got no rows), bit for bit
the same output as on fresh memory. Also: which idle buffer a request takes, which one goes
over budget, a budget of 0, a bad budget."""
import os
import subprocess
import sys

import pytest
import torch

import kt_ops
from moe_samples import make_moe_inputs, positional
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

LARGE = 8 << 20  # kLargeMinBytes: smaller tensors come from at::empty and are not recycled


@pytest.fixture(autouse=True)
def empty_cache():
    kt_ops.release_cached_buffers()
    yield
    kt_ops.release_cached_buffers()


def poison_and_free(tensors):
    for t in tensors:
        t.detach().fill_(float("nan"))
    tensors.clear()


@pytest.mark.parametrize("mode", ["full", "hybrid"])
def test_recycled_weight_gradients_are_zero_for_experts_without_rows(mode):
    # E*I*H*4 bytes = 9.2 MiB per base-weight gradient: recycled. An expert's slice is
    # 800,000 bytes, not a whole number of pages, so zeroing an idle expert must memset the partial
    # pages at its ends and leave its neighbours' values alone.
    E, H, I, K = 12, 1000, 200, 2
    kwargs = make_moe_inputs(T_shape=(16,), H=H, I=I, E=E, K=K, r=4 if mode == "hybrid" else 0,
                             dtype=torch.float32, mode=mode, seed=3)
    assert E * I * H * 4 >= LARGE
    grad_out = grad_output_for(kwargs)
    _, grads = run_op(kwargs, grad_out)  # every expert gets rows (seeded routing)
    assert torch.bincount(kwargs["topk_ids"].reshape(-1), minlength=E).min() > 0
    poison_and_free(list(grads.values()))
    grads = None
    idle = kt_ops.cached_buffers_info()
    assert idle["buffers"] >= 3 and idle["bytes"] >= 3 * E * I * H * 4, idle

    # Second call: only the even experts get rows, the odd ones (between them) none.
    T = kwargs["hidden_states"].shape[0]
    even = torch.arange(0, E, 2)
    kwargs["topk_ids"] = torch.stack([even[torch.randperm(len(even), generator=torch.Generator().manual_seed(t))[:K]]
                                      for t in range(T)])
    out, grads = run_op(kwargs, grad_out)
    assert kt_ops.cached_buffers_info()["buffers"] < idle["buffers"]  # the poisoned buffers were reused
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    tol = TOLERANCE[torch.float32]
    assert rel_err(out, ref_out) < tol
    for name, g in grads.items():
        assert not g.isnan().any(), name
        assert rel_err(g, ref_grads[name]) < tol, name
        if name.endswith("_proj") or name.endswith(("_a", "_b")):
            assert torch.equal(g[1::2], torch.zeros_like(g[1::2])), name


def test_recycled_forward_buffers_give_the_same_output_as_fresh_memory():
    # output [T, H] and saved activations [2, T*K, I]: 8 MiB and 8.4 MiB in float32
    kwargs = make_moe_inputs(T_shape=(2048,), H=1024, I=256, E=4, K=2, dtype=torch.float32, seed=5)
    out, act = torch.ops.kt.moe_forward(*positional(kwargs), save_activations=True)
    assert out.nbytes >= LARGE and act.nbytes >= LARGE
    expected = (out.clone(), act.clone())
    poison_and_free([out, act])
    out = act = None
    assert kt_ops.cached_buffers_info()["buffers"] == 2
    out, act = torch.ops.kt.moe_forward(*positional(kwargs), save_activations=True)
    assert kt_ops.cached_buffers_info()["buffers"] == 0
    assert torch.equal(out, expected[0]) and torch.equal(act, expected[1])


def test_release_cached_buffers_unmaps_idle_buffers():
    kwargs = make_moe_inputs(T_shape=(2048,), H=1024, I=8, E=2, K=1, dtype=torch.float32)
    out = kt_ops.moe(**kwargs)
    del out
    assert kt_ops.cached_buffers_info()["buffers"] == 1
    kt_ops.release_cached_buffers()
    assert kt_ops.cached_buffers_info() == {"buffers": 0, "bytes": 0}


def output_of_size(mib, seed=0):
    """A kt.moe output of `mib` MiB (float32, H=1024), large enough to live in a cached buffer."""
    g = torch.Generator().manual_seed(seed)
    T = mib * 256
    return kt_ops.moe(torch.randn(T, 1024, generator=g), torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1),
                      torch.randn(1, 8, 1024, generator=g), torch.randn(1, 8, 1024, generator=g),
                      torch.randn(1, 1024, 8, generator=g))


def test_a_request_up_to_a_quarter_smaller_reuses_an_idle_buffer():
    # batches of varying length ask for varying sizes
    expected = output_of_size(14).clone()
    kt_ops.release_cached_buffers()
    poison_and_free([output_of_size(16)])
    assert kt_ops.cached_buffers_info() == {"buffers": 1, "bytes": 16 << 20}
    small = output_of_size(10)  # 16 MiB > 10 MiB + a quarter: a fresh mapping
    assert kt_ops.cached_buffers_info()["buffers"] == 1
    small.fill_(float("nan"))
    del small
    out = output_of_size(14)  # takes the poisoned 16 MiB buffer, not the 10 MiB one
    assert kt_ops.cached_buffers_info() == {"buffers": 1, "bytes": 10 << 20}
    assert torch.equal(out, expected)


def run_in_subprocess(code, budget):
    code = ("import torch, kt_ops\n"
            "from test_buffer_cache import output_of_size\n") + code
    env = dict(os.environ, KT_OPS_BUFFER_CACHE_MB=budget,
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def run_with_budget(value):
    return run_in_subprocess("out = output_of_size(8)\n"
                             "del out\n"
                             "print(kt_ops.cached_buffers_info()['buffers'])\n", value)


def test_over_budget_the_longest_idle_buffer_is_unmapped():
    proc = run_in_subprocess("a = output_of_size(10)\n"
                             "b = output_of_size(12)\n"
                             "del a\n"
                             "del b\n"  # 22 MiB idle > 20: the 10 MiB one (idle longer) goes
                             "info = kt_ops.cached_buffers_info()\n"
                             "print(info['buffers'], info['bytes'] >> 20)\n", "20")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 12"


def test_budget_zero_keeps_no_buffer():
    proc = run_with_budget("0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"


def test_bad_budget_is_a_clear_error():
    proc = run_with_budget("lots")
    assert proc.returncode != 0
    # a Python exception from the op call, not a C++ terminate from a tensor's deleter
    assert "RuntimeError: KT_OPS_BUFFER_CACHE_MB must be a whole number of MiB >= 0, got 'lots'" in proc.stderr
    assert "terminate called" not in proc.stderr
