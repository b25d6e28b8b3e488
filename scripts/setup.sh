#!/usr/bin/env bash
# Sets up a fresh checkout: a virtual environment in .venv with the pinned CPU torch and the
# test tools, then builds kt_ops' C++ extension against that torch (no build isolation: an
# isolated build would fetch another torch). Run again, it redoes only what changed: packages
# when their list changes, the extension's changed sources (a kept build/ folder).
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
# The packages, installed only when this list changed since the last run (the stamp in .venv).
REQUIREMENTS="torch==2.13.0 pybind11 ninja expecttest pytest setuptools wheel transformers==5.23.0 peft==0.21.2 accelerate==1.15.0 safetensors==0.8.0 matplotlib==3.11.2 trl==1.16.0 datasets==5.2.0 compressed-tensors==0.20.1"
if [ "$(cat .venv/.kt_ops_requirements 2> /dev/null)" != "$REQUIREMENTS" ]; then
    # shellcheck disable=SC2086
    .venv/bin/python -m pip install -q --disable-pip-version-check $REQUIREMENTS
    echo "$REQUIREMENTS" > .venv/.kt_ops_requirements
fi
# The C++ extension, incrementally: ninja keeps its objects in build/ and recompiles only what a
# changed source, header or flag needs; a different torch starts the folder afresh.
TORCH_VERSION="$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
if [ "$(cat build/.kt_ops_torch 2> /dev/null)" != "$TORCH_VERSION" ]; then
    rm -rf build
fi
MAX_JOBS="${MAX_JOBS:-2}" .venv/bin/python setup.py -q build_ext --inplace > /dev/null
echo "$TORCH_VERSION" > build/.kt_ops_torch
# The package itself, editable (the source tree, with the extension just built in place), once.
# KT_OPS_SKIP_EXTENSION: that install must not build the extension again in a temporary folder.
# --use-pep517: setuptools' PEP 660 hook (the legacy `setup.py develop` path of current
# setuptools re-invokes pip with isolation).
# Again when setup.py changed (its packages and their folders are what the install maps).
SETUP_HASH="$(sha256sum setup.py | cut -d' ' -f1)"
if [ "$(cat .venv/.kt_ops_setup 2> /dev/null)" != "$SETUP_HASH" ] || \
        ! .venv/bin/python -m pip show -q kt_ops > /dev/null 2>&1; then
    KT_OPS_SKIP_EXTENSION=1 .venv/bin/python -m pip install -q --disable-pip-version-check \
        --no-build-isolation --use-pep517 -e .
    echo "$SETUP_HASH" > .venv/.kt_ops_setup
fi
