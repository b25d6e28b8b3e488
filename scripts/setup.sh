#!/usr/bin/env bash
# Sets up a fresh checkout: a virtual environment in .venv with the pinned CPU torch and the
# test tools, then builds kt_ops' C++ extension against that torch (no build isolation: an
# isolated build would fetch another torch). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# SIMDe's headers, for the tests' AVX-512 emulation on CPUs without it (tests/avx512_emulation.py);
# header-only, never linked into the library.
if [ ! -e /usr/include/simde/x86/avx512.h ] && command -v apt-get > /dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q libsimde-dev > /dev/null || \
        { $SUDO apt-get update -q > /dev/null && $SUDO apt-get install -y -q libsimde-dev > /dev/null; } || \
        echo "setup.sh: could not install libsimde-dev; tests/test_avx512_emulation.py fails until it is" >&2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check \
    torch==2.13.0 pybind11 ninja expecttest pytest setuptools wheel \
    transformers==5.23.0 peft==0.21.2 accelerate==1.15.0 safetensors==0.8.0 matplotlib==3.11.2
# --use-pep517: an editable install through setuptools' PEP 660 hook in this environment
# (the legacy `setup.py develop` path of current setuptools re-invokes pip with isolation).
MAX_JOBS="${MAX_JOBS:-2}" .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-build-isolation --use-pep517 -e .
