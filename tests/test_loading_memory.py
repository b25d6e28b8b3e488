"""Loading memory (issue 15): kt_ops.hf.from_pretrained with expert_format="int4" on a saved
Qwen3-MoE whose bf16 size is over 1 GiB peaks at most at the final resident size + 2 x the
largest layer's bf16 experts + 256 MiB (VmHWM of a fresh process), and gives the logits of
from_pretrained + patch_model, whose peak is reported beside it; patch_model alone peaks at
most one layer's bf16 experts over its start. With expert_shards=2 each owner's resident memory
grows by at most 0.55x the one owner's while loading, and it reads only its experts."""
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("loading_memory") / "model"
    _run("make", path)
    return path


def test_streaming_load_peak_memory(checkpoint, tmp_path):
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


def test_each_shard_owner_loads_half_the_experts(checkpoint, tmp_path):
    """Peak growth of the process's own resident memory (RssAnon sampled every 2 ms over its start,
    a fresh process per rank; VmHWM also counts up to 256 MiB of mapped checkpoint pages, the same
    for every rank, and is printed beside it) of from_pretrained with the checkpoint's bf16
    experts: one owner, then each of 2 shard owners."""
    reports = {}
    for shards, rank in ((1, 0), (2, 0), (2, 1)):
        _run("shard", checkpoint, tmp_path / f"s{shards}r{rank}.json", shards, rank)
        reports[shards, rank] = json.load(open(tmp_path / f"s{shards}r{rank}.json"))
    one = reports[1, 0]
    print(f"\none owner: +{one['growth'] / MiB:.0f} MiB (VmHWM +{one['rss_growth'] / MiB:.0f} MiB; "
          f"{one['expert_bytes'] / MiB:.0f} MiB of experts); " + ", ".join(
              f"shard {r} of 2: +{reports[2, r]['growth'] / MiB:.0f} MiB ({reports[2, r]['growth'] / one['growth']:.3f}x; "
              f"VmHWM +{reports[2, r]['rss_growth'] / MiB:.0f} MiB)" for r in (0, 1)))
    assert one["expert_bytes"] >= 512 * MiB
    for rank in (0, 1):
        mine = reports[2, rank]
        assert mine["expert_bytes"] == one["expert_bytes"] // 2
        assert mine["expert_tensors_read"] == one["expert_tensors_read"] // 2
        assert mine["growth"] <= 0.55 * one["growth"], (rank, mine, one)
