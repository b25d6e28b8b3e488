"""csrc/ is layered: platform (ISA detection, SIMD helpers, intrinsics, allocation) < kernels
(small / thin GEMMs, SwiGLU, dequantization, decode GEMVs) < gemm (the base-weight GEMM
backends: ATen / packed / AMX) < ops (schemas, argument checks, the kt.moe kernels); a file
includes only its own layer and the ones below it. meta_kernels/ sits at the ops layer."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["platform", "kernels", "gemm", "ops"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _sources():
    for folder in [os.path.join("csrc", layer) for layer in LAYERS] + ["meta_kernels"]:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith((".h", ".cpp")):
                yield os.path.join(folder, name)


def _layer_of(path):
    parts = path.split(os.sep)
    return "ops" if parts[0] == "meta_kernels" else parts[1]


def test_csrc_has_only_the_layer_folders():
    assert sorted(os.listdir(os.path.join(ROOT, "csrc"))) == sorted(LAYERS)


@pytest.mark.parametrize("path", list(_sources()))
def test_includes_stay_in_their_layer_or_below(path):
    rank = LAYERS.index(_layer_of(path))
    text = open(os.path.join(ROOT, path)).read()
    for include in INCLUDE.findall(text):
        assert os.path.exists(os.path.join(ROOT, "csrc", include)), f"{path}: {include} is not under csrc/"
        layer = include.split("/")[0]
        assert layer in LAYERS, f"{path}: {include} names no layer folder"
        assert LAYERS.index(layer) <= rank, f"{path} ({_layer_of(path)}) includes {include} from the layer above"


def test_source_names_are_unique():
    # torch.utils.cpp_extension.load (the tests' emulated build) names each object file after
    # its source's base name: two sources of one name would overwrite each other's object.
    cpps = [os.path.basename(p) for p in _sources() if p.endswith(".cpp")]
    assert len(cpps) == len(set(cpps)), sorted(n for n in cpps if cpps.count(n) > 1)
