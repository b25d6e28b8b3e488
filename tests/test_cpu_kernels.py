"""The hand-written CPU kernels (csrc/kernels/small_gemm.cpp, swiglu.cpp) on every instruction-set
path this CPU runs, against float64 formulas and against each other, plus the path switch:
kt.moe itself on each path, KT_OPS_CPU_ISA, and errors for unknown or unsupported paths."""
import os
import subprocess
import sys

import pytest
import torch

import kt_ops
from kt_ops.cpu_isa import ISAS, best_cpu_isa, supported_cpu_isas
from moe_samples import make_moe_inputs
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


def isa_param(isa):
    marks = [] if isa in supported_cpu_isas() else [pytest.mark.skip(reason=f"this CPU cannot run {isa}")]
    return pytest.param(isa, marks=marks, id=isa)


ALL_ISAS = [isa_param(isa) for isa in ISAS]


def rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(dtype)


def assert_close_to(out, ref_f64, dtype, what):
    """out within the rounding of its dtype of the float64 result (per element, scaled)."""
    assert out.dtype == dtype, what
    scale = ref_f64.abs().max().item() + 1e-30
    atol = {f32: 2e-5, bf16: 1.6e-2, f64: 1e-12}[dtype] * scale
    err = (out.double() - ref_f64).abs().max().item()
    assert err <= atol, f"{what}: max abs err {err:.3g} > {atol:.3g}"


# ---- small_gemm: out = c + alpha·a·b ----------------------------------------------------------

# Column counts around the tile widths (16, 32) so the SIMD tiles and the reference tail run;
# row counts around the row tiles (4, 8).
GEMM_SHAPES = [(1, 1, 1), (3, 5, 17), (8, 8, 32), (13, 8, 2069), (4, 16, 48), (64, 17, 96), (9, 64, 768)]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ab_dtype,out_dtype,c_dtype", [
    (bf16, bf16, bf16), (bf16, f32, None), (f32, f32, f32), (f32, bf16, None), (bf16, bf16, None),
    (f64, f64, f64)])
def test_small_gemm_matches_float64(isa, shape, ab_dtype, out_dtype, c_dtype):
    M, Kd, N = shape
    seed = M * 1000 + Kd * 10 + N
    a = rand(Kd, M, dtype=ab_dtype, seed=seed).t()  # strided a, as the kernels pass qᵀ
    b = rand(Kd, N, dtype=ab_dtype, seed=seed + 1)
    c = rand(M, N, dtype=c_dtype, seed=seed + 2) if c_dtype else None
    out = torch.ops.kt._small_gemm(c, a, b, 0.75, out_dtype, isa)
    ref = 0.75 * a.double() @ b.double() + (c.double() if c is not None else 0)
    assert_close_to(out, ref, out_dtype, f"small_gemm {isa}")


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS if i != "portable"])
def test_small_gemm_simd_paths_agree_with_the_reference_loop(isa):
    """Same inputs, the reference loop vs a SIMD path: float32 results agree to accumulation
    order, bf16 results to one bf16 rounding."""
    a = rand(37, 8, dtype=bf16, seed=1)
    b = rand(8, 2048 + 40, dtype=bf16, seed=2)
    c = rand(37, 2048 + 40, dtype=bf16, seed=3)
    for out_dtype, tol in ((f32, 1e-5), (bf16, 8e-3)):
        ref = torch.ops.kt._small_gemm(c, a, b, 1.25, out_dtype, "portable").double()
        out = torch.ops.kt._small_gemm(c, a, b, 1.25, out_dtype, isa).double()
        assert ((out - ref).abs() <= tol * (ref.abs() + 1)).all(), out_dtype


# ---- thin_gemm_nt: out = x·wᵀ with a thin output ----------------------------------------------

# K around the vector widths (8, 16, 32) and their tails; R around the rank tile (8); odd M.
THIN_SHAPES = [(1, 1, 1), (3, 5, 7), (2, 8, 32), (5, 9, 33), (4, 3, 100), (65, 8, 2048), (7, 16, 768)]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("shape", THIN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_dtype,out_dtype", [(bf16, bf16), (bf16, f32), (f32, f32), (f32, bf16), (f64, f64)])
def test_thin_gemm_matches_float64(isa, shape, in_dtype, out_dtype):
    M, R, K = shape
    seed = M * 1000 + R * 10 + K
    x = rand(M, K + 3, dtype=in_dtype, seed=seed)[:, 2:K + 2]  # rows with a larger stride
    w = rand(R, K, dtype=in_dtype, seed=seed + 1)
    out = torch.ops.kt._thin_gemm_nt(x, w, out_dtype, isa)
    assert out.shape == (M, R)
    assert_close_to(out, x.double() @ w.double().t(), out_dtype, f"thin_gemm {isa}")


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS if i != "portable"])
def test_thin_gemm_simd_paths_agree_with_the_reference_loop(isa):
    x, w = rand(33, 2048 + 7, dtype=bf16, seed=7), rand(8, 2048 + 7, dtype=bf16, seed=8)
    ref = torch.ops.kt._thin_gemm_nt(x, w, f32, "portable").double()
    out = torch.ops.kt._thin_gemm_nt(x, w, f32, isa).double()
    assert ((out - ref).abs() <= 1e-5 * (ref.abs() + 1)).all()


# ---- swiglu forward / backward ------------------------------------------------------------------

def swiglu_reference(g, u, dh, w):
    g, u, dh, w = g.double(), u.double(), dh.double(), w.double()[:, None]
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dhw = w * dh
    return dict(h=h, dg=dhw * u * (sig + silu * (1 - sig)), du=dhw * silu, hw=w * h, dw=(dh * h).sum(1))


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("n,pad,I", [(1, 0, 1), (5, 3, 15), (4, 0, 16), (7, 1, 33), (3, 13, 768)])
def test_swiglu_matches_float64(isa, dtype, n, pad, I):
    seed = n * 100 + I
    g = rand(n, I, dtype=dtype, seed=seed, scale=3.0)
    u = rand(n, I, dtype=dtype, seed=seed + 1)
    dh = torch.cat([rand(n, I, dtype=dtype, seed=seed + 2), torch.full((pad, I), 7.0, dtype=dtype)])  # tail: garbage
    w = torch.rand(n + pad, generator=torch.Generator().manual_seed(seed), dtype=f64).to(f64 if dtype == f64 else f32)
    ref = swiglu_reference(g, u, dh[:n], w[:n])
    assert_close_to(torch.ops.kt._swiglu_forward(g, u, isa), ref["h"], dtype, "h")
    dg, du, hw, dw = torch.ops.kt._swiglu_backward(g, u, dh, w, True, True, isa)
    for name, t in (("dg", dg), ("du", du), ("hw", hw)):
        assert t.shape == (n + pad, I), name
        assert_close_to(t[:n], ref[name], dtype, name)
        assert (t[n:] == 0).all(), f"{name}: padding rows must be zero"
    assert dw.dtype == w.dtype and dw.shape == (n,)
    assert_close_to(dw, ref["dw"], w.dtype if dtype != bf16 else f32, "dw")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_swiglu_extremes_and_nan(isa):
    """Large |g| gives silu's limits (no inf/NaN from exp overflow); NaN propagates to its own
    element only."""
    g = torch.tensor([[-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0, float("nan")] + [0.5] * 22])
    u = torch.ones_like(g)
    h = torch.ops.kt._swiglu_forward(g, u, isa)
    ref = torch.nn.functional.silu(g.double())
    finite = ~torch.isnan(g)
    assert torch.isnan(h[~finite]).all()
    assert torch.allclose(h[finite].double(), ref[finite], rtol=1e-5, atol=1e-30)
    dg, du, hw, dw = torch.ops.kt._swiglu_backward(g, u, torch.ones_like(g), torch.ones(1), True, True, isa)
    assert torch.isnan(dg[~finite]).all() and torch.isfinite(dg[finite]).all()
    assert torch.isnan(dw).all()


def clamped_swiglu_reference(g, u, dh, w, limit):
    """swiglu_reference on the clamped g and u (transformers' clamped SwiGLU), with dg and du
    zero where torch.clamp's gradient is: outside [.., limit] / [-limit, limit], and at NaN."""
    g, u = g.double(), u.double()
    ref = swiglu_reference(g.clamp(max=limit), u.clamp(-limit, limit), dh, w)
    ref["dg"] = torch.where(g <= limit, ref["dg"], 0.0)
    ref["du"] = torch.where((u >= -limit) & (u <= limit), ref["du"], 0.0)
    return ref


GPT_OSS_ALPHA = 1.702


def gated_reference(g, u, dh, w, limit, activation, alpha=None):
    """Forward and backward of act(g)·u (act SiLU or GELU-tanh), or of swigluoai's
    g·σ(α·g)·(u + 1), clamped when limit is not None, by float64 autograd: torch's own formulas
    and clamp gradients."""
    forms = {"silu": lambda g, u: torch.nn.functional.silu(g) * u,
             "gelu_tanh": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u,
             "swigluoai": lambda g, u: g * torch.sigmoid(alpha * g) * (u + 1)}
    g, u = (t.double().requires_grad_() for t in (g, u))
    gc, uc = (g.clamp(max=limit), u.clamp(-limit, limit)) if limit is not None else (g, u)
    h = forms[activation](gc, uc)
    w64 = w.double()[:, None]
    dg, du = torch.autograd.grad(h, [g, u], w64 * dh.double())
    h = h.detach()
    return dict(h=h, dg=dg, du=du, hw=w64 * h, dw=(dh.double() * h).sum(1))


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("limit", [None, 2.5], ids=["unclamped", "clamped"])
@pytest.mark.parametrize("n,pad,I", [(1, 0, 1), (5, 3, 15), (7, 1, 33), (3, 13, 768)])
@pytest.mark.parametrize("activation", ["gelu_tanh", "swigluoai"])
def test_gated_activation_matches_float64(isa, dtype, limit, n, pad, I, activation):
    """activation="gelu_tanh" (GELU's tanh approximation, Gemma 4's experts) and "swigluoai"
    (gpt-oss's g·σ(α·g)·(u + 1)) on every path, against float64 autograd, clamped or not, in
    the SIMD steps and the tails."""
    alpha = GPT_OSS_ALPHA if activation == "swigluoai" else None
    seed = n * 100 + I + 11
    g = rand(n, I, dtype=dtype, seed=seed, scale=3.0)
    u = rand(n, I, dtype=dtype, seed=seed + 1, scale=3.0)
    dh = torch.cat([rand(n, I, dtype=dtype, seed=seed + 2), torch.full((pad, I), 7.0, dtype=dtype)])
    w = torch.rand(n + pad, generator=torch.Generator().manual_seed(seed), dtype=f64).to(f64 if dtype == f64 else f32)
    ref = gated_reference(g, u, dh[:n], w[:n], limit, activation, alpha)
    assert_close_to(torch.ops.kt._swiglu_forward(g, u, isa, limit, activation, alpha), ref["h"], dtype, "h")
    dg, du, hw, dw = torch.ops.kt._swiglu_backward(g, u, dh, w, True, True, isa, limit, activation, alpha)
    for name, t in (("dg", dg), ("du", du), ("hw", hw)):
        assert_close_to(t[:n], ref[name], dtype, name)
        assert (t[n:] == 0).all(), f"{name}: padding rows must be zero"
    assert_close_to(dw, ref["dw"], w.dtype if dtype != bf16 else f32, "dw")


def test_unknown_activation_refused_by_the_kernel_ops():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="activation must be 'silu' \\(SwiGLU\\), 'gelu_tanh'"):
        torch.ops.kt._swiglu_forward(g, g, "portable", None, "gelu")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("n,pad,I", [(1, 0, 1), (5, 3, 15), (7, 1, 33), (3, 13, 768)])
def test_clamped_swiglu_matches_float64(isa, dtype, n, pad, I):
    """With swiglu_limit = 2.5 on g, u spread over ±4 standard deviations of 3: both clamps cut,
    in the SIMD steps and in the tails."""
    seed = n * 100 + I + 7
    g = rand(n, I, dtype=dtype, seed=seed, scale=3.0)
    u = rand(n, I, dtype=dtype, seed=seed + 1, scale=3.0)
    dh = torch.cat([rand(n, I, dtype=dtype, seed=seed + 2), torch.full((pad, I), 7.0, dtype=dtype)])
    w = torch.rand(n + pad, generator=torch.Generator().manual_seed(seed), dtype=f64).to(f64 if dtype == f64 else f32)
    ref = clamped_swiglu_reference(g, u, dh[:n], w[:n], 2.5)
    assert_close_to(torch.ops.kt._swiglu_forward(g, u, isa, 2.5), ref["h"], dtype, "h")
    dg, du, hw, dw = torch.ops.kt._swiglu_backward(g, u, dh, w, True, True, isa, 2.5)
    for name, t in (("dg", dg), ("du", du), ("hw", hw)):
        assert_close_to(t[:n], ref[name], dtype, name)
        assert (t[n:] == 0).all(), f"{name}: padding rows must be zero"
    assert_close_to(dw, ref["dw"], w.dtype if dtype != bf16 else f32, "dw")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_clamped_swiglu_at_the_bounds_and_nan(isa):
    """torch.clamp's semantics exactly: the bounds pass the gradient, beyond them it is 0; NaN
    stays NaN in h and its gradient is 0. 32 columns: the SIMD steps and the tail both see
    every case."""
    L = 4.0
    vals = [-L - 1, -L, -L + 0.5, 0.0, L - 0.5, L, L + 1, float("nan")]
    g = torch.tensor([vals * 4])
    u = torch.tensor([vals[::-1] * 4])
    h = torch.ops.kt._swiglu_forward(g, u, isa, L)
    ref = clamped_swiglu_reference(g, u, torch.ones_like(g), torch.ones(1), L)
    assert torch.equal(torch.isnan(h), torch.isnan(ref["h"]))
    finite = ~torch.isnan(ref["h"])
    assert torch.allclose(h[finite].double(), ref["h"][finite], rtol=1e-6, atol=1e-6)
    dg, du, _, _ = torch.ops.kt._swiglu_backward(g, u, torch.ones_like(g), torch.ones(1), False, False, isa, L)
    g_passes, u_passes = g <= L, (u >= -L) & (u <= L)  # False at NaN, as torch.clamp's gradient
    assert (dg[~g_passes] == 0).all() and (du[~u_passes] == 0).all()
    both = g_passes & u_passes
    assert torch.allclose(dg[both].double(), ref["dg"][both], rtol=1e-6, atol=1e-6)
    assert torch.allclose(du[both].double(), ref["du"][both], rtol=1e-6, atol=1e-6)
    assert (dg[both & (u != 0)] != 0).all()  # the bounds themselves pass


def test_swiglu_limit_refused_by_the_kernel_ops():
    g = torch.randn(2, 8)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="swiglu_limit must be None or a number > 0"):
            torch.ops.kt._swiglu_forward(g, g, "portable", bad)


def test_swiglu_without_optional_outputs():
    g, u, dh = (rand(4, 40, dtype=bf16, seed=s) for s in (1, 2, 3))
    w = torch.rand(4)
    dg, du, hw, dw = torch.ops.kt._swiglu_backward(g, u, dh, w, False, False, kt_ops.cpu_isa())
    assert hw.numel() == 0 and dw.numel() == 0
    ref = swiglu_reference(g, u, dh, w)
    assert_close_to(dg, ref["dg"], bf16, "dg")


# ---- kt.moe on every path ---------------------------------------------------------------------

@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype,mode", [(bf16, "lora"), (bf16, "full"), (f32, "hybrid"), (bf16, "hybrid")],
                         ids=["bf16-lora", "bf16-full", "fp32-hybrid", "bf16-hybrid"])
def test_moe_on_each_path_matches_float64_reference(isa, dtype, mode):
    """Shapes wide enough for the SIMD tiles (H = 80, I = 48: full tiles plus tails)."""
    kwargs = make_moe_inputs(T_shape=(37,), H=80, I=48, E=6, K=3, r=0 if mode == "full" else 4, dtype=dtype,
                             mode=mode, empty_experts=True, seed=11)
    grad_out = grad_output_for(kwargs)
    with kt_ops.use_cpu_isa(isa):
        out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    tol = TOLERANCE[dtype]
    assert rel_err(out, ref_out) < tol
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < tol, name


# Rows per expert on both sides of forward's GEMV cut (kGemvMaxRows = 4 in moe_forward.cpp:
# blocks of <= 4 rows use row dot products on the plain weights, larger ones GEMMs), and one
# expert with none.
ROWS_PER_EXPERT = [1, 2, 3, 4, 5, 9, 20, 0]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype,mode", [(bf16, "lora"), (bf16, "full"), (f32, "hybrid")],
                         ids=["bf16-lora", "bf16-full", "fp32-hybrid"])
def test_moe_decode_sized_and_gemm_blocks_match_float64_reference(isa, dtype, mode):
    """Also backward's weight gradients, which are outer-product sums (small_gemm) for experts
    with at most 4 rows (kOuterProductMaxRows in moe_backward.cpp) and GEMMs above."""
    T = sum(ROWS_PER_EXPERT)
    kwargs = make_moe_inputs(T_shape=(T,), H=80, I=48, E=len(ROWS_PER_EXPERT), K=1, r=0 if mode == "full" else 4,
                             dtype=dtype, mode=mode, seed=5)
    ids = torch.repeat_interleave(torch.arange(len(ROWS_PER_EXPERT)), torch.tensor(ROWS_PER_EXPERT))
    kwargs["topk_ids"] = ids[torch.randperm(T, generator=torch.Generator().manual_seed(6))].view(T, 1)
    assert torch.bincount(kwargs["topk_ids"].view(-1), minlength=len(ROWS_PER_EXPERT)).tolist() == ROWS_PER_EXPERT
    grad_out = grad_output_for(kwargs)
    with kt_ops.use_cpu_isa(isa):
        out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    tol = TOLERANCE[dtype]
    for e, n in enumerate(ROWS_PER_EXPERT):  # per expert, so that one path cannot hide in the other's norm
        rows = kwargs["topk_ids"].view(-1) == e
        if n:
            assert rel_err(out[rows], ref_out[rows]) < tol, f"expert {e} with {n} rows"
    for name, g in grads.items():
        if name.endswith("_proj"):  # per expert, as for the output
            for e, n in enumerate(ROWS_PER_EXPERT):
                if n:
                    assert rel_err(g[e], ref_grads[name][e]) < tol, f"{name} of expert {e} with {n} rows"
        assert rel_err(g, ref_grads[name]) < tol, name


def test_use_cpu_isa_restores_and_rejects_bad_names():
    before = kt_ops.cpu_isa()
    with kt_ops.use_cpu_isa("portable"):
        assert kt_ops.cpu_isa() == "portable"
    assert kt_ops.cpu_isa() == before
    with pytest.raises(ValueError, match="expected one of auto, portable, avx2, avx512, avx512_bf16"):
        kt_ops.set_cpu_isa("sse9")
    assert kt_ops.cpu_isa() == before
    with kt_ops.use_cpu_isa("auto"):
        assert kt_ops.cpu_isa() == best_cpu_isa()


def _import_with_env(value):
    env = dict(os.environ, KT_OPS_CPU_ISA=value)
    return subprocess.run([sys.executable, "-c", "import kt_ops; print(kt_ops.cpu_isa())"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_environment_variable_forces_a_path():
    res = _import_with_env("portable")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "portable"


def test_environment_variable_with_a_bad_name_fails_at_import():
    res = _import_with_env("avx1024")
    assert res.returncode != 0
    assert "KT_OPS_CPU_ISA" in res.stderr and "avx1024" in res.stderr
