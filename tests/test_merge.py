"""Merging an adapter into its base checkpoint (``kt_ops.hf.merge_adapter``, ``python -m kt_ops.merge``).

For tiny Qwen3-MoE bases in bf16 / fp32 / FP8 blocks / compressed-tensors INT4 / GPTQ (and a
DeepSeek-V3 in bf16), with an adapter holding random nonzero LoRA on the routed experts and on
the attention (tests/merge_samples.py):

* the merged checkpoint, loaded by stock transformers in a process that never imports kt_ops
  (GPTQ: by ``kt_ops.hf.from_pretrained``, transformers needs gptqmodel / optimum for it), gives
  the logits of the patched model with the adapter: bf16 within 1e-2 relative, fp32 within 1e-5,
  a quantized format within 3x the base's own quantization error (the relative logits difference
  between the quantized base and the float model it was quantized from, measured here; the merged
  float weights requantized by checkpoint_samples' own quantizers gave 1.7-2.1x it, the merge
  2.0-2.1x); the adapter moves the logits by far more than that (10x the tolerance for float outputs,
  4x for quantized ones: a tiny model's logits pass a final norm, so no adapter moves them by more
  than ~1.4 relative, and the quantization error grows with the merged weights);
* every tensor the merge does not list as merged is byte for byte the base's;
* an adapter that does not fit the base, an existing out_dir, a NaN in the adapter are refused
  (ValueError naming the key / tensor) and leave no out_dir nor a temporary folder;
* a merge killed mid-way leaves no out_dir; peak memory stays within the largest input shard +
  one layer's experts in float32 + 256 MiB over the process's baseline (1.5 GiB base, 6 shards);
* the CLI merges and exits 0, and names a missing adapter directory.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

import kt_ops  # noqa: E402
import merge_samples as ms  # noqa: E402
from moe_testing import rel_err  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.join(HERE, "merge_samples.py")
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
ENV = {**os.environ, "OMP_NUM_THREADS": "2"}
QUANT_FACTOR = 3.0  # tolerance of a quantized output, x the base's own quantization error
SHARDS = {"bf16": 3, "fp8": 2}  # these bases sharded (save_pretrained's max_shard_size), the rest one file


def _run(*args, timeout=300):
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def stock_logits(path, tmp) -> torch.Tensor:
    """Logits of AutoModelForCausalLM.from_pretrained(path) in a fresh process without kt_ops."""
    out = os.path.join(os.fspath(tmp), f"stock-{abs(hash(os.fspath(path)))}.pt")
    _run(SAMPLES, "stock-logits", path, out)
    return torch.load(out)


def load_logits(path, fmt, tmp) -> torch.Tensor:
    """A checkpoint's logits: stock transformers, or kt_ops.hf.from_pretrained for GPTQ."""
    return ms.kt_logits(os.fspath(path)) if fmt == "gptq" else stock_logits(path, tmp)


def merge(*args, **kwargs):
    return kt_ops.hf.merge_adapter(*map(os.fspath, args), progress=False, **kwargs)


def tensor_hashes(path) -> dict:
    """{key: sha256 of dtype, shape and raw bytes} over a checkpoint's shards."""
    hashes = {}
    for shard in ms.shard_paths(path):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key).contiguous()
                h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                hashes[key] = h.hexdigest()
    return hashes


def weight_map(path) -> dict:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        return json.load(open(index))["weight_map"]
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def config_of(path) -> dict:
    return json.load(open(os.path.join(path, "config.json")))


def assert_nothing_written(out):
    """No out_dir, and no temporary folder (or anything else) beside it."""
    parent = os.path.dirname(os.fspath(out))
    assert not os.path.lexists(out)
    assert os.listdir(parent) == [], os.listdir(parent)


class Case:
    """A base, its adapter, and the logits of the base and of the patched model with the adapter."""

    def __init__(self, root, fmt, family="qwen3_moe", target_modules=None, **adapter_kwargs):
        self.root, self.fmt = root, fmt
        paths = ms.write_base(root, fmt, shards=SHARDS.get(fmt, 1), family=family)
        self.base, self.float, self.adapter = paths["base"], paths["float"], os.path.join(root, "adapter")
        ms.write_adapter(self.base, self.adapter, target_modules=target_modules, **adapter_kwargs)
        self.ref = ms.reference_logits(self.base, self.adapter)
        self.base_logits = ms.reference_logits(self.base)
        self._q_err = None

    def quantization_error(self, tmp) -> float:
        """The quantized base's logits vs those of the float model it was quantized from."""
        if self._q_err is None:
            self._q_err = rel_err(load_logits(self.base, self.fmt, tmp), load_logits(self.float, "float", tmp))
        return self._q_err


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(fmt, family="qwen3_moe", **kwargs):
        key = (fmt, family, repr(sorted(kwargs.items())))
        if key not in made:
            made[key] = Case(tmp_path_factory.mktemp(f"merge_{fmt}_{family}"), fmt, family, **kwargs)
        return made[key]

    return get


def check_merged(case, out, summary, output_format, tmp, tolerance=None) -> float:
    """Everything a merge output must satisfy; returns the logits' relative error."""
    base, fmt = case.base, case.fmt
    assert os.path.isdir(out)
    base_map, out_map = weight_map(base), weight_map(out)
    assert sorted(set(out_map.values())) == sorted(set(base_map.values()))  # the same shard files
    assert os.path.exists(os.path.join(base, "model.safetensors.index.json")) == \
        os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(out, "generation_config.json"))
    merged = set(summary.merged)
    assert merged
    assert any(re.search(r"self_attn\.(q_proj|q_b_proj)\.", k) for k in merged), sorted(merged)[:8]
    assert any(re.search(r"self_attn\.o_proj\.", k) for k in merged), sorted(merged)[:8]
    assert any(re.search(r"mlp\.experts\.(\d+\.(gate|up|down)_proj|gate_up_proj|down_proj)", k) for k in merged), \
        sorted(merged)[:8]

    # untouched tensors byte for byte
    base_hashes, out_hashes = tensor_hashes(base), tensor_hashes(out)
    kept = [k for k in base_hashes if k in out_hashes and k not in merged]
    assert kept
    changed = [k for k in kept if base_hashes[k] != out_hashes[k]]
    assert not changed, f"not listed as merged, yet changed: {changed[:8]}"
    assert any(base_hashes[k] != out_hashes[k] for k in merged if k in base_hashes and k in out_hashes)

    quantized_out = output_format == "same" and fmt in ms.QUANTIZED
    if output_format == "same":
        assert out_map == base_map
        # copied: the tensors of no merged weight (a merged quantized weight's own unchanged
        # parts, GPTQ's qzeros / g_idx, compressed-tensors' weight_shape, may be rewritten)
        assert 0 < summary.copied <= len(kept), (summary.copied, len(kept))
        assert config_of(out).get("quantization_config") == config_of(base).get("quantization_config")
    else:
        assert "quantization_config" not in config_of(out)
        with torch.no_grad():
            for shard in ms.shard_paths(out):
                for key, t in load_file(shard).items():
                    assert not key.endswith(("weight_scale_inv", "weight_packed", "qweight")), key
                    assert t.dtype not in (torch.float8_e4m3fn, torch.int32) or key.endswith("weight_shape"), \
                        (key, t.dtype)

    got = load_logits(out, fmt if quantized_out else "float", tmp)
    err, effect = rel_err(got, case.ref), rel_err(case.base_logits, case.ref)
    if tolerance is None:
        if quantized_out:
            q_err = case.quantization_error(tmp)
            tolerance = QUANT_FACTOR * q_err
        else:
            tolerance = 1e-5 if fmt == "fp32" and output_format == "same" else 1e-2
    margin = 4 if quantized_out else 10
    print(f"\nmerge {fmt} -> {output_format}: logits vs patched+adapter {err:.3e} (tolerance {tolerance:.3e}"
          + (f" = {QUANT_FACTOR} x base quantization error {case.quantization_error(tmp):.3e}" if quantized_out else "")
          + f"); adapter's effect {effect:.3e}; {len(merged)} merged, {summary.copied} copied")
    assert err <= tolerance, (err, tolerance)
    assert effect > margin * tolerance, (effect, tolerance)
    return err


@pytest.mark.parametrize("fmt,output_format", [("bf16", "same"), ("fp32", "same"), ("fp8", "same"), ("int4", "same"),
                                               ("gptq", "same"), ("fp8", "bf16"), ("int4", "bf16")])
def test_merged_checkpoint_gives_the_adapters_logits(cases, tmp_path, fmt, output_format):
    case = cases(fmt)
    out = tmp_path / "out" / "merged"
    summary = merge(case.base, case.adapter, out, output_format=output_format)
    assert os.listdir(tmp_path / "out") == ["merged"]  # no temporary folder left beside it
    check_merged(case, out, summary, output_format, tmp_path)


def test_rslora_scale(cases, tmp_path):
    """use_rslora: s = lora_alpha / sqrt(r) (4 here, lora_alpha / r = 2)."""
    case = cases("fp32", use_rslora=True)
    assert ms.read_adapter_config(case.adapter)["use_rslora"]
    out = tmp_path / "merged"
    check_merged(case, out, merge(case.base, case.adapter, out), "same", tmp_path)


def test_deepseek_v3(cases, tmp_path):
    # adapter scale 0.1: with 0.15 the merged weights' bf16 rounding alone moves DeepSeek-V3's
    # logits by 1.05e-2 (measured writing W + s·B·A computed in fp32, rounded to bf16: the merge's
    # output equals it bit for bit); 0.1 gives 4.1e-3
    case = cases("bf16", family="deepseek_v3", target_modules=ms.DEEPSEEK_ATTENTION, scale=0.1)
    out = tmp_path / "merged"
    summary = merge(case.base, case.adapter, out)
    check_merged(case, out, summary, "same", tmp_path)
    # the dense layer's MLP and the shared experts have no LoRA: copied
    assert not any("shared_experts" in k or "layers.0.mlp" in k for k in summary.merged)


# ---------------------------------------------------------------------------------------------
# Refusals, before anything is written


def _edited_adapter(src, dst, *, tensors=None, config=None):
    """A copy of adapter ``src`` in ``dst`` with ``tensors(state) -> state`` and ``config(dict)``
    applied."""
    shutil.copytree(src, dst)
    if tensors is not None:
        path = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path, metadata={"format": "pt"})
    if config is not None:
        path = os.path.join(dst, "adapter_config.json")
        c = json.load(open(path))
        config(c)
        json.dump(c, open(path, "w"))
    return dst


def _refused(base, adapter, tmp_path, match):
    out = tmp_path / "out" / "merged"
    os.makedirs(out.parent)
    with pytest.raises(ValueError, match=match) as info:
        merge(base, adapter, out)
    assert_nothing_written(out)
    print(f"\nrefused: {info.value}")
    return str(info.value)


@pytest.mark.parametrize("overrides", [dict(num_experts=8), dict(hidden_size=128)], ids=["experts", "hidden"])
def test_adapter_of_another_model_is_refused(cases, tmp_path, overrides):
    case = cases("bf16")
    other = ms.write_base(tmp_path / "other", "bf16", **overrides)
    ms.write_adapter(other["base"], tmp_path / "other_adapter")
    pattern = r"experts\.(base_layer\.)?lora_[AB]\.weight" if "num_experts" in overrides else r"lora_[AB]\.weight"
    _refused(case.base, tmp_path / "other_adapter", tmp_path / "x", pattern)


def test_wrong_shape_key_is_named(cases, tmp_path):
    case = cases("bf16")
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"

    def widen(state):
        assert key in state
        state[key] = torch.randn(state[key].shape[0], state[key].shape[1] + 8)
        return state

    adapter = _edited_adapter(case.adapter, tmp_path / "adapter", tensors=widen)
    _refused(case.base, adapter, tmp_path / "x", r"layers\.1\.self_attn\.k_proj\.lora_A")


def test_rank_other_than_config_is_refused(cases, tmp_path):
    case = cases("bf16")
    adapter = _edited_adapter(case.adapter, tmp_path / "adapter", config=lambda c: c.update(r=2))
    _refused(case.base, adapter, tmp_path / "x", r"lora_[AB]\.weight")


def test_module_the_base_lacks_is_named(cases, tmp_path):
    case = cases("bf16")
    prefix = "base_model.model.model.layers.0.mlp.shared_expert.up_proj."

    def add(state):
        state[prefix + "lora_A.weight"] = torch.randn(ms.R, 64)
        state[prefix + "lora_B.weight"] = torch.randn(32, ms.R)
        return state

    adapter = _edited_adapter(case.adapter, tmp_path / "adapter", tensors=add)
    _refused(case.base, adapter, tmp_path / "x", r"layers\.0\.mlp\.shared_expert\.up_proj")


def test_nan_is_refused_by_name(cases, tmp_path):
    case = cases("bf16")
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"

    def poison(state):
        state[key][0, 0] = float("nan")
        return state

    adapter = _edited_adapter(case.adapter, tmp_path / "adapter", tensors=poison)
    _refused(case.base, adapter, tmp_path / "x", r"layers\.1\.self_attn\.q_proj")


def test_too_little_free_space_is_refused(cases, tmp_path, monkeypatch):
    import kt_ops.hf.merge as merge_module

    case = cases("bf16")
    monkeypatch.setattr(merge_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1000))
    _refused(case.base, case.adapter, tmp_path, r"needs .* GB; .* has 0\.00 GB free")


def test_existing_out_dir(cases, tmp_path):
    case = cases("bf16")
    out = tmp_path / "merged"
    os.makedirs(out)
    (out / "marker").write_text("old")
    with pytest.raises(ValueError, match="exist"):
        merge(case.base, case.adapter, out)
    assert os.listdir(out) == ["marker"] and sorted(os.listdir(tmp_path)) == ["merged"]
    summary = merge(case.base, case.adapter, out, overwrite=True)
    assert not (out / "marker").exists() and sorted(os.listdir(tmp_path)) == ["merged"]
    assert tensor_hashes(out).keys() == tensor_hashes(case.base).keys() and summary.merged


# ---------------------------------------------------------------------------------------------
# Interruption, memory, CLI


def _stop_merge_at_its_first_shard(tmp_path, sig):
    """Runs ``python -m kt_ops.merge`` on a synthetic base and sends it ``sig`` once its first
    output shard is in the temporary folder; returns (base, adapter, out_dir's parent, out_dir,
    the temporary folder seen, the exit status)."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    c = ms.write_synthetic_base(base, shards=8, hidden_size=512, moe_intermediate_size=512, num_experts=32,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    ms.write_synthetic_adapter(c, adapter)
    parent = tmp_path / "out"
    os.makedirs(parent)
    out = parent / "merged"
    proc = subprocess.Popen([sys.executable, "-m", "kt_ops.merge", "--base", base, "--adapter", adapter, "--out", out,
                             "--no-progress"], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, deadline = None, time.monotonic() + 120
    try:
        while seen is None and proc.poll() is None and time.monotonic() < deadline:
            for entry in os.listdir(parent):
                folder = parent / entry
                if folder != out and folder.is_dir() and any(f.endswith(".safetensors") for f in os.listdir(folder)):
                    seen = folder
                    break
            else:
                time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert seen is not None, f"the merge ended (rc {proc.returncode}) before an output shard was seen: {err[-2000:]}"
    return base, adapter, parent, out, seen, proc.returncode


def test_killed_merge_leaves_no_out_dir(tmp_path):
    """SIGKILL once the first output shard is in the temporary folder: no out_dir (a killed
    process cannot clean up; the next merge to the same out_dir works and removes its folder)."""
    base, adapter, _, out, seen, status = _stop_merge_at_its_first_shard(tmp_path, signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert not os.path.lexists(out)
    summary = merge(base, adapter, out)
    assert summary.merged and os.path.isdir(out)
    assert not os.path.lexists(seen)  # the killed merge's folder, removed by the next merge to out_dir


def test_terminated_merge_cleans_up_as_after_ctrl_c(tmp_path):
    """SIGTERM (``kill``) once the first output shard is in the temporary folder: the merge removes
    that folder, writes no out_dir and exits with status 143 (128 + SIGTERM)."""
    _, _, parent, _, _, status = _stop_merge_at_its_first_shard(tmp_path, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM
    assert os.listdir(parent) == []  # neither out_dir nor the temporary folder


def test_merge_peak_memory(tmp_path):
    """A 1.5 GiB bf16 Qwen3-MoE in 6 shards (experts per expert), merged in a fresh process:
    peak resident (VmHWM after the imports) <= baseline + largest shard + one layer's experts
    in float32 + 256 MiB."""
    base, adapter, out, report = (tmp_path / n for n in ("base", "adapter", "merged", "report.json"))
    try:
        _run(SAMPLES, "synthetic", base, adapter, 6, timeout=300)
        _run(SAMPLES, "merge-memory", base, adapter, out, report, timeout=300)
        r = json.load(open(report))
        size = sum(os.path.getsize(p) for p in ms.shard_paths(base))
        assert size >= 1.5 * (1 << 30) and len(ms.shard_paths(base)) >= 4
        bound = r["baseline"] + r["largest_shard"] + r["layer_fp32_experts"] + 256 * MiB
        print(f"\nmerge of {size / MiB:.0f} MiB in {len(ms.shard_paths(base))} shards: peak {r['peak'] / MiB:.0f} MiB "
              f"(baseline {r['baseline'] / MiB:.0f} MiB, +{(r['peak'] - r['baseline']) / MiB:.0f} MiB), bound "
              f"{bound / MiB:.0f} MiB (largest shard {r['largest_shard'] / MiB:.0f} MiB, a layer's fp32 experts "
              f"{r['layer_fp32_experts'] / MiB:.0f} MiB); {r['merged']} merged, {r['copied']} copied")
        assert r["peak"] <= bound, r
        assert sorted(os.path.basename(p) for p in ms.shard_paths(out)) == \
            sorted(os.path.basename(p) for p in ms.shard_paths(base))
    finally:
        for d in (base, out):
            shutil.rmtree(d, ignore_errors=True)


def test_cli(cases, tmp_path):
    case = cases("bf16")
    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "kt_ops.merge", "--base", case.base, "--adapter", case.adapter,
                           "--out", out, "--no-progress"], capture_output=True, text=True, timeout=180, env=ENV,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert tensor_hashes(out).keys() == tensor_hashes(case.base).keys()
    assert rel_err(stock_logits(out, tmp_path), case.ref) <= 1e-2

    missing = tmp_path / "no_such_adapter"
    out2 = tmp_path / "merged2"
    done = subprocess.run([sys.executable, "-m", "kt_ops.merge", "--base", case.base, "--adapter", missing,
                           "--out", out2, "--no-progress"], capture_output=True, text=True, timeout=180, env=ENV,
                          cwd=ROOT)
    assert done.returncode != 0
    assert str(missing) in done.stdout + done.stderr, done.stderr[-2000:]
    assert not os.path.lexists(out2)
