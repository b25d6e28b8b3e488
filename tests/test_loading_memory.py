"""Loading memory (issue 15): kt_ops.hf.from_pretrained with expert_format="int4" on a saved
Qwen3-MoE whose bf16 size is over 1 GiB peaks at most at the final resident size + 2 x the
largest layer's bf16 experts + 256 MiB (VmHWM of a fresh process), and gives the logits of
from_pretrained + patch_model, whose peak is reported beside it; patch_model alone peaks at
most one layer's bf16 experts over its start."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "loading_memory_run.py")
MiB = 1 << 20


def _run(*args, timeout=600):
    done = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-4000:]


def test_streaming_load_peak_memory(tmp_path):
    checkpoint = tmp_path / "model"
    _run("make", checkpoint)
    size = sum(os.path.getsize(checkpoint / f) for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    assert size >= 1 << 30
    reports = {}
    for kind in ("kt", "hf"):
        _run(kind, checkpoint, tmp_path / f"{kind}.json")
        reports[kind] = json.load(open(tmp_path / f"{kind}.json"))
    kt, hf = reports["kt"], reports["hf"]
    bound = kt["final"] + 2 * kt["layer_bf16_experts"] + 256 * MiB
    print(f"\ncheckpoint {size / MiB:.0f} MiB (bf16); int4 experts {kt['expert_bytes'] / MiB:.0f} MiB\n"
          f"kt_ops.hf.from_pretrained: peak {kt['peak'] / MiB:.0f} MiB, final {kt['final'] / MiB:.0f} MiB, "
          f"bound {bound / MiB:.0f} MiB, {kt['seconds']:.1f} s, resident before loading {kt['baseline'] / MiB:.0f} MiB\n"
          f"from_pretrained + patch_model: peak {hf['peak'] / MiB:.0f} MiB, final {hf['final'] / MiB:.0f} MiB, "
          f"{hf['seconds']:.1f} s")
    assert kt["expert_bytes"] == hf["expert_bytes"] and kt["expert_bytes"] <= 0.3 * kt["bf16_expert_bytes"]
    assert kt["peak"] <= bound, (kt, bound)
    assert kt["peak"] < hf["peak"]
    # patch_model of a model already in memory: at most one experts module's bf16 on top while
    # it quantizes (it drops each module's float copy before the next), and the bf16 it drops
    # is given back (at least half of bf16 minus int4: the allocator may keep some).
    patch_extra = hf["patch_peak"] - hf["before_patch"]
    print(f"patch_model alone: {patch_extra / MiB:.0f} MiB over its start (one layer's bf16 experts: "
          f"{hf['layer_bf16_experts'] / MiB:.0f} MiB), {(hf['before_patch'] - hf['after_patch']) / MiB:.0f} MiB given back")
    assert patch_extra <= hf["layer_bf16_experts"] + 64 * MiB, hf
    assert hf["before_patch"] - hf["after_patch"] >= (hf["bf16_expert_bytes"] - hf["expert_bytes"]) / 2, hf
    ours, ref = (torch.load(tmp_path / f"{k}.pt") for k in ("kt", "hf"))
    assert torch.equal(ours, ref)
