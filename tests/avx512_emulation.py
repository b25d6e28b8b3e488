"""The test build of kt_ops' native library that runs the avx512 and avx512_bf16 kernels on CPUs
without AVX-512 (csrc/platform/avx512_emulation.h: SIMDe's AVX-512 intrinsics over AVX2), so that every
path's kernels are checked against their reference loops whatever CPU runs the tests.

It is the same sources compiled with -DKT_OPS_EMULATE_AVX512 -mavx2 -mfma -mf16c into
build/avx512_emulated/ (ninja rebuilds only what changed), at -O1: SIMDe's inlined emulation makes
-O3 builds 1.4x as slow, and these kernels are only checked, never timed. A process uses it in
place of kt_ops._C when KT_OPS_TEST_LIBRARY names it; both cannot share a process, as both
register torch.ops.kt.

    .venv/bin/python tests/avx512_emulation.py            # build; prints the library's path
    KT_OPS_TEST_LIBRARY=$(that path) .venv/bin/python -m pytest tests/test_cpu_kernels.py -k avx512
"""
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_DIR = os.path.join(ROOT, "build", "avx512_emulated")
NAME = "kt_ops_avx512_emulated"
SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"  # Debian's libsimde-dev (scripts/setup.sh installs it)
FLAGS = ["-O1", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DKT_OPS_EMULATE_AVX512",
         "-Wno-ignored-attributes", "-Wno-psabi"]


def library_path() -> str:
    return os.path.join(BUILD_DIR, NAME + ".so")


def build() -> str:
    """Builds (or brings up to date) the emulated library in a child process, since building loads
    it and it must not be loaded beside kt_ops._C; returns its path. Raises with the compiler's
    output on failure."""
    if not os.path.exists(SIMDE_HEADER):
        raise RuntimeError(f"the AVX-512 emulation needs SIMDe ({SIMDE_HEADER}): apt-get install libsimde-dev "
                           "(scripts/setup.sh does)")
    proc = subprocess.run([sys.executable, __file__, "--in-child"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the AVX-512 emulation failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return library_path()


# Parsing ATen's and torch.library's headers is most of each file's compile time (14 s of it on the
# Zen 3 of 2026-12-03): the build includes them precompiled, once for all 26 files.
TORCH_HEADERS = "#include <ATen/ATen.h>\n#include <torch/library.h>\n"


def _precompile_torch_headers() -> str:
    """The header every file of the build includes first (-include), with its precompiled form beside it,
    made with the flags torch.utils.cpp_extension.load compiles with and remade when torch or those
    flags change (the header records both; rewriting it also makes ninja rebuild every file). Should
    load's own flags change, GCC ignores the .gch and parses the headers: slower, never wrong."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import include_paths

    cflags = [f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{ROOT}/csrc"]
    for path in include_paths() + [sysconfig.get_paths()["include"]]:
        cflags += ["-isystem", path]
    cflags += ["-fPIC", "-std=c++20"] + FLAGS
    header = os.path.join(BUILD_DIR, "torch_headers.h")
    pch = header + ".gch"
    stamp = f"// torch {torch.__version__}, {' '.join(cflags)}\n" + TORCH_HEADERS
    if os.path.exists(pch) and os.path.exists(header) and open(header).read() == stamp:
        return header
    with open(header, "w") as f:
        f.write(stamp)
    subprocess.run(["c++"] + cflags + ["-x", "c++-header", header, "-o", pch], check=True)
    return header


def _build_here() -> None:
    from torch.utils.cpp_extension import load

    os.makedirs(BUILD_DIR, exist_ok=True)
    header = _precompile_torch_headers()
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc/*/*.cpp"))) + \
        sorted(glob.glob(os.path.join(ROOT, "meta_kernels/*.cpp")))
    load(name=NAME, sources=sources, extra_cflags=FLAGS + ["-include", header, "-Winvalid-pch"],
         extra_ldflags=["-fopenmp"], extra_include_paths=[os.path.join(ROOT, "csrc")], build_directory=BUILD_DIR,
         is_python_module=False)


if __name__ == "__main__":
    if sys.argv[1:] == ["--in-child"]:
        _build_here()
    else:
        print(build())
