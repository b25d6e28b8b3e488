"""The avx512 and avx512_bf16 kernels on CPUs without AVX-512: every test of those paths (the
tests whose id names avx512), run in a child process on the emulated build of the native library
(tests/avx512_emulation.py, csrc/ops/avx512_emulation.h), so that CI checks them against their
reference loops and float64 whatever CPU it gets. On CPUs with AVX512-BF16 the suite runs them
natively and this skips.

Left out there: tests marked onednn_bf16 (oneDNN's own bf16 reorder and packed layouts, which
emulating our intrinsics does not give; the kernels into those layouts are checked through
_dequantize_into_layout) and AMX (amx_gemm.cpp's tiles)."""
import os
import re
import subprocess
import sys

import pytest

import avx512_emulation
from kt_ops.cpu_isa import supported_cpu_isas

REPO = avx512_emulation.ROOT

pytestmark = [
    pytest.mark.skipif("avx512_bf16" in supported_cpu_isas(),
                       reason="this CPU runs the avx512 paths natively: the suite tests them itself"),
    pytest.mark.skipif("avx2" not in supported_cpu_isas(), reason="the emulation runs on AVX2"),
    pytest.mark.skipif(bool(os.environ.get("KT_OPS_TEST_LIBRARY")), reason="already in the emulated run"),
]

# How many tests of the avx512 paths pass emulated (781 when written): far fewer means that
# they stopped being selected or started skipping, and the check would pass on nothing.
MIN_PASSED = 750


def test_avx512_paths_pass_their_tests_emulated():
    library = avx512_emulation.build()
    env = dict(os.environ, KT_OPS_TEST_LIBRARY=library)
    env.pop("KT_OPS_CPU_ISA", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests",
           "--ignore", os.path.join("tests", os.path.basename(__file__)),
           "-k", "avx512", "-m", "not onednn_bf16"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"the emulated run failed:\n{out[-12000:]}"
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= MIN_PASSED, f"only {passed} tests of the avx512 paths passed emulated:\n{out[-4000:]}"
    # Nothing skipped for want of the instructions: the emulated library must offer both paths.
    assert "cannot run avx512" not in out and "needs AVX512" not in out, out[-4000:]
