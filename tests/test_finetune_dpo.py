"""The main job's DPO mode (``python -m kt_ops.finetune --trainer dpo``, kt_ops/finetune/dpo.py):
TRL's DPOTrainer on the built-in demo model with the shipped preference pairs. A short run
writes its summary (per-step and held-out metrics) and one adapter holding both LoRAs, which
plain PEFT loads into the *unpatched* demo model with the patched model's logits (fp32, 1e-5)."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("trl")

import kt_ops  # noqa: E402
from kt_ops.finetune.cli import build_base_model  # noqa: E402
from moe_testing import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dpo_mode_trains_and_writes_an_adapter_plain_peft_loads(tmp_path):
    out = tmp_path / "dpo"
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "kt_ops.finetune", "--trainer", "dpo", "--steps", "4",
                           "--batch-size", "4", "--output-dir", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "kt_ops DPO: 4 steps" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["logs"]) == 4 and summary["logs"][0]["rewards/margins"] == 0.0
    assert summary["logs"][-1]["rewards/margins"] != 0.0  # the policy moved away from its reference
    assert set(summary["held_out"]) == {"before", "after"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}

    demo = argparse.Namespace(model=None, model_config=None, dtype="float32", seed=0)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    plain = peft.PeftModel.from_pretrained(build_base_model(demo), str(out)).eval()
    patched = kt_ops.load_adapter(kt_ops.patch_model(build_base_model(demo), lora_rank=8, lora_alpha=16),
                                  str(out)).eval()
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, patched(input_ids=ids).logits
        with plain.disable_adapter():
            base = plain(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5
    assert rel_err(want, base) > 1e-4  # the adapter is not a no-op


def test_trainer_option_is_refused_for_unknown_values(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kt_ops.finetune", "--trainer", "ppo", "--steps", "1",
                           "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--trainer" in proc.stderr and "ppo" in proc.stderr
