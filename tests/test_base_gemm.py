"""kt.moe's base-weight GEMMs on CPUs without native bf16 GEMMs (csrc/gemm/base_gemm.h): the
bf16-to-float32 panel GEMMs and their conversion kernels against float64 and torch on every
instruction-set path, the path each ISA chooses, and bf16 kt.moe called many times in a row
(packing never entered off the avx512_bf16 path) in every training mode, on every path."""
import os
import subprocess
import sys

import pytest
import torch

import kt_ops
from kt_ops.cpu_isa import ISAS, supported_cpu_isas
from kt_ops.weight_packing import packed_weights_info, release_packed_weights
from moe_samples import make_moe_inputs
from moe_testing import TOLERANCE, grad_output_for, rel_err, run_op, run_reference

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def isa_param(isa):
    marks = [] if isa in supported_cpu_isas() else [pytest.mark.skip(reason=f"this CPU cannot run {isa}")]
    return pytest.param(isa, marks=marks, id=isa)


ALL_ISAS = [isa_param(isa) for isa in ISAS]


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=f64).to(dtype)


def assert_close(out, ref_f64, dtype, what):
    assert out.dtype == dtype, what
    tol = {f32: 1e-5, bf16: 8e-3, f64: 1e-12}[dtype]
    err = rel_err(out, ref_f64)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


# ---- conversion kernels ---------------------------------------------------------------------

SPECIALS = [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-42, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"),
            1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20]  # ties go to even


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("cols", [1, 7, 8, 17, 33, 100])
def test_conversion_kernels_equal_torch(isa, cols):
    """bf16 -> float is exact; float -> bf16 rounds to nearest even as torch does (NaN stays NaN)."""
    src = torch.cat([torch.tensor(SPECIALS, dtype=f32), rand(3 * cols, dtype=f32, seed=cols)])
    src = src[: (src.numel() // cols) * cols].view(-1, cols)
    wide = torch.zeros(src.size(0), cols + 5, dtype=f32)
    wide[:, :cols] = src  # rows further apart than their length
    to_bf16 = torch.ops.kt._convert_rows(wide[:, :cols], bf16, isa)
    ref = src.to(bf16)
    nan = torch.isnan(src)
    assert torch.isnan(to_bf16[nan].float()).all()
    assert torch.equal(to_bf16[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    back = torch.ops.kt._convert_rows(ref, f32, isa)
    assert torch.equal(back[~nan], ref.float()[~nan]) and torch.isnan(back[nan]).all()


# ---- panel GEMMs ------------------------------------------------------------------------------

# (M, N, K): K = 4100 makes a panel 16 rows (kPanelValues / K rounded down to 16), so N = 40
# runs panels of 16, 16 and 8 rows; K = 40 puts a whole N in one panel; zero-size edges too.
PANEL_SHAPES = [(5, 40, 4100), (64, 40, 4100), (3, 300, 40), (1, 1, 1), (0, 8, 16), (4, 0, 16), (6, 9, 0)]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("dtype", [bf16, f32, f64], ids=["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("shape", PANEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_panel_gemms_match_float64(isa, dtype, shape):
    M, N, K = shape
    seed = M * 7 + N * 13 + K
    x, w = rand(M, K, dtype=dtype, seed=seed), rand(N, K, dtype=dtype, seed=seed + 1)
    d, addend = rand(M, N, dtype=dtype, seed=seed + 2), rand(M, K, dtype=dtype, seed=seed + 3)
    with kt_ops.use_cpu_isa(isa):
        nt = torch.ops.kt._panel_mm_nt(x, w)
        nn = torch.ops.kt._panel_mm_nn(d, w, None)
        nn_add = torch.ops.kt._panel_mm_nn(d, w, addend)
        tn = torch.ops.kt._panel_mm_tn(d, x)
    assert nt.shape == (M, N) and nn.shape == (M, K) and tn.shape == (N, K)
    if M * N * K == 0:  # empty sums are zeros (and the addend itself)
        assert (nt == 0).all() and (nn == 0).all() and (tn == 0).all() and torch.equal(nn_add, addend)
        return
    assert_close(nt, x.double() @ w.double().t(), dtype, "x·wᵀ")
    assert_close(nn, d.double() @ w.double(), dtype, "d·w")
    assert_close(nn_add, addend.double() + d.double() @ w.double(), dtype, "addend + d·w")
    assert_close(tn, d.double().t() @ x.double(), dtype, "dᵀ·x")


def test_panel_gemm_reads_strided_weight_rows():
    """Weight slices as kt.moe passes them (rows of a larger stacked tensor) and a column slice."""
    stacked = rand(3, 40, 4100, dtype=bf16, seed=3)
    x = rand(9, 4100, dtype=bf16, seed=4)
    out = torch.ops.kt._panel_mm_nt(x[:, :4096], stacked[1][:, :4096])
    assert_close(out, x[:, :4096].double() @ stacked[1][:, :4096].double().t(), bf16, "strided")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_moe_with_several_weight_panels_matches_float64(isa, mode):
    """H = 4100: gate/up panels of 16 weight rows (three per expert, the last partial), down's
    [H, I] weight in two panels; every GEMM of forward and backward crosses panel edges."""
    kwargs = make_moe_inputs(T_shape=(30,), H=4100, I=40, E=3, K=2, r=0 if mode == "full" else 4, dtype=bf16,
                             mode=mode, seed=8)
    grad_out = grad_output_for(kwargs)
    with kt_ops.use_cpu_isa(isa):
        out, grads = run_op(kwargs, grad_out)
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    assert rel_err(out, ref_out) < TOLERANCE[bf16]
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < TOLERANCE[bf16], name


# ---- which path runs ----------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ALL_ISAS)
def test_base_gemm_path_follows_the_active_isa(isa):
    with kt_ops.use_cpu_isa(isa):
        expected = "onednn_bf16" if isa == "avx512_bf16" else "bf16_to_fp32_panels"
        assert torch.ops.kt._base_gemm_path(bf16) == expected
        assert torch.ops.kt._base_gemm_path(f32) == "mkl"


# ---- bf16 kt.moe, many calls in a row -------------------------------------------------------------

CALLS = 20


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("mode", ["lora", "full", "hybrid", "inference"])
def test_bf16_moe_twenty_calls_in_a_row(isa, mode):
    """Frozen weights (lora, inference) pack after three calls on the avx512_bf16 path only; full
    and hybrid update the weights in place between calls (as an optimizer does). Every call must
    run (on CPUs without AVX-512 the oneDNN bf16 reorder raised at the third), and the last one
    must match the float64 reference on the weights it saw."""
    release_packed_weights()
    kwargs = make_moe_inputs(T_shape=(40,), H=96, I=48, E=4, K=2, r=0 if mode == "full" else 4, dtype=bf16,
                             mode=mode, seed=21)
    trained = [n for n in ("gate_proj", "up_proj", "down_proj") if kwargs[n].requires_grad]
    # lr small: the test's linear loss makes larger steps diverge within the 20 calls
    opt = torch.optim.SGD([kwargs[n] for n in trained], lr=1e-4) if trained else None
    grad_out = grad_output_for(kwargs)
    with kt_ops.use_cpu_isa(isa):
        for _ in range(CALLS - 1):
            if mode == "inference":
                with torch.no_grad():
                    kt_ops.moe(**kwargs)
                continue
            out, grads = run_op(kwargs, grad_out)
            if opt:
                for n in trained:
                    kwargs[n].grad = grads[n]
                opt.step()  # in place: bumps the weights' versions
        out, grads = run_op(kwargs, grad_out)
        packed_sets = packed_weights_info()["sets"]
    ref_out, ref_grads = run_reference(kwargs, grad_out)
    assert rel_err(out, ref_out) < TOLERANCE[bf16]
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < TOLERANCE[bf16], name
    frozen = mode in ("lora", "inference")
    assert packed_sets == (1 if isa == "avx512_bf16" and frozen and kt_ops.weight_packing_enabled() else 0)
    release_packed_weights()


@pytest.mark.onednn_bf16
def test_onednn_capped_below_bf16_takes_the_avx512_bf16_path_away():
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 (the emulation recipe's AVX2) leaves oneDNN
    without native bf16 GEMMs and makes its bf16 weight reorder refuse: kt_ops then never takes
    the avx512_bf16 path (best path avx512 or lower, forcing it raises naming the variable), so
    bf16 calls keep working past the third (packing) call on any CPU."""
    code = ("import sys, torch, kt_ops; sys.path.insert(0, 'tests'); from moe_samples import make_moe_inputs\n"
            "from kt_ops.cpu_isa import best_cpu_isa, supported_cpu_isas\n"
            "kw = make_moe_inputs(T_shape=(40,), H=64, I=48, E=4, K=2, r=2, dtype=torch.bfloat16, mode='lora')\n"
            "for _ in range(6): kt_ops.moe(**kw).float().sum().backward()\n"
            "try:\n"
            "    kt_ops.set_cpu_isa('avx512_bf16'); print('accepted')\n"
            "except RuntimeError as e:\n"
            "    print('refused', 'ONEDNN_MAX_CPU_ISA=AVX512_CORE' in str(e))\n"
            "print(best_cpu_isa(), 'avx512_bf16' in supported_cpu_isas(), torch.ops.kt._base_gemm_path(torch.bfloat16))")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    env.pop("KT_OPS_CPU_ISA", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.split("\n")[:2]
    # The note names the cap where the CPU itself has AVX512-BF16 (the flag in /proc/cpuinfo).
    with open("/proc/cpuinfo") as f:
        cpu_has_bf16 = "avx512_bf16" in f.read().split()
    assert first == f"refused {cpu_has_bf16}", res.stdout
    best, bf16_listed, route = second.split()
    assert best != "avx512_bf16" and bf16_listed == "False" and route == "bf16_to_fp32_panels", res.stdout


def test_emulated_avx2_cpu_chooses_as_a_cpu_without_avx512():
    """The README's emulation recipe in a fresh process: kt_ops takes the AVX2 route (panels,
    no packing) whatever this CPU has, and bf16 LoRA calls keep working past the third."""
    code = ("import sys, torch, kt_ops; sys.path.insert(0, 'tests'); from moe_samples import make_moe_inputs\n"
            "kw = make_moe_inputs(T_shape=(40,), H=64, I=48, E=4, K=2, r=2, dtype=torch.bfloat16, mode='lora')\n"
            "for _ in range(6): kt_ops.moe(**kw).float().sum().backward()\n"
            "print(kt_ops.cpu_isa(), torch.ops.kt._base_gemm_path(torch.bfloat16), kt_ops.packed_weights_info()['sets'])")
    env = dict(os.environ, KT_OPS_CPU_ISA="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["avx2", "bf16_to_fp32_panels", "0"]
