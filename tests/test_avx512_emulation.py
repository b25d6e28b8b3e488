"""The avx512 and avx512_bf16 kernels (AMX's too) on CPUs without them: every test of those paths (the
tests whose id names avx512), run in a child process on the emulated build of the native library
(tests/avx512_emulation.py, csrc/platform/avx512_emulation.h), so that CI checks them against their
reference loops and float64 whatever CPU it gets. On CPUs with AVX512-BF16 and AMX the suite runs
them natively and this skips; with AVX512-BF16 alone, it runs the AMX tests.

AMX's tiles are emulated too (amx_gemm.cpp's strips run). Left out there: tests marked
onednn_bf16 (oneDNN's own bf16 reorder and packed layouts, which emulating our intrinsics does not
give; the kernels into those layouts are checked through _dequantize_into_layout)."""
import os
import re
import subprocess
import sys

import pytest
import torch

import avx512_emulation
from kt_ops.cpu_isa import supported_cpu_isas

REPO = avx512_emulation.ROOT

NATIVE_BF16 = "avx512_bf16" in supported_cpu_isas()
NATIVE_AMX = NATIVE_BF16 and torch.ops.kt._amx_supported()

pytestmark = [
    pytest.mark.skipif(NATIVE_AMX, reason="this CPU runs the avx512 paths and AMX natively: the suite tests them"),
    pytest.mark.skipif("avx2" not in supported_cpu_isas(), reason="the emulation runs on AVX2"),
    pytest.mark.skipif(bool(os.environ.get("KT_OPS_TEST_LIBRARY")), reason="already in the emulated run"),
]

# What the suite cannot run natively here: with AVX512-BF16 but no AMX (Zen 4), the AMX tests;
# otherwise every test of the avx512 paths. And how many of them pass emulated at least (when
# written: 871 and 92 on the Zen 3 of 2026-12-03), since far fewer means that they stopped being
# selected or started skipping, and the check would pass on nothing.
SELECTION, MIN_PASSED = ("amx", 80) if NATIVE_BF16 else ("avx512", 850)


def test_avx512_paths_pass_their_tests_emulated():
    library = avx512_emulation.build()
    env = dict(os.environ, KT_OPS_TEST_LIBRARY=library)
    # The emulated library offers its paths itself: a recipe emulating a CPU without AVX-512 (KT_OPS_CPU_ISA,
    # oneDNN's and MKL's caps, which take the avx512_bf16 path away) would leave it nothing to test.
    for cap in ("KT_OPS_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(cap, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests",
           "--ignore", os.path.join("tests", os.path.basename(__file__)),
           "-k", SELECTION, "-m", "not onednn_bf16"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"the emulated run failed:\n{out[-12000:]}"
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= MIN_PASSED, f"only {passed} tests of the avx512 paths passed emulated:\n{out[-4000:]}"
    # Nothing skipped for want of the instructions: the emulated library must offer both paths and AMX.
    for want in ("cannot run avx512", "needs AVX512", "no AMX"):
        assert want not in out, f"skipped: {want}\n{out[-4000:]}"
