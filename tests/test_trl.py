"""TRL's trainers, unmodified, on a kt-patched model (tests/trl_run.py runs them).

* DPO (``DPOTrainer``, ``ref_model=None``): the logged loss, chosen and rejected rewards and
  margins of 3 steps equal those of the unpatched model under plain PEFT from the same adapter
  (fp32, relative 1e-4 over the 3 steps), on a model already wrapped with PEFT (TRL adds a
  ``"ref"`` copy of the adapter and computes the reference under ``set_adapter("ref")``) and
  on one TRL wraps from ``peft_config`` (reference under ``disable_adapter()``; kt's expert
  LoRA must be off there and must train: PEFT's ``get_peft_model`` once froze it).
* SFT (``SFTTrainer``), plain and packed (padding-free), and through TRL's ``peft_config``
  path: the same losses as plain PEFT.
* Under torchrun with 2 gloo ranks (one expert owner), DPO on both paths and SFT padded and
  packed equal one process on the same global batch.

The starting adapter has nonzero B factors everywhere, so a reference that kept kt's expert
LoRA on (the bug this guards against) gives other rewards from step 1 or 2 on.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "trl_run.py")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict = {}


def run(tmp_path_factory, ranks: int, *args) -> dict:
    """trl_run.py's logs for these arguments (each configuration run once per session)."""
    key = (ranks,) + args
    if key not in _RESULTS:
        out = tmp_path_factory.mktemp("trl")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        launcher = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(_free_port())]
        proc = subprocess.run(["timeout", "-k", "10", "300", *launcher, SCRIPT, str(out), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"exit status {proc.returncode}\n--- stderr (end) ---\n{proc.stderr[-8000:]}", pytrace=False)
        with open(out / "result.json") as f:
            result = json.load(f)
        assert result["world"] == ranks and len(result["logs"]) == 3
        _RESULTS[key] = result["logs"]
    return _RESULTS[key]


def assert_same_logs(got, want, rtol):
    for metric in METRICS if "rewards/chosen" in want[0] else ("loss",):
        a = [step[metric] for step in got]
        b = [step[metric] for step in want]
        diff = sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5
        norm = sum(y ** 2 for y in b) ** 0.5
        assert diff <= rtol * norm, f"{metric}: {a} vs {b}"


@pytest.mark.parametrize("wrap", ["model", "peft_config"])
def test_dpo_equals_plain_peft(tmp_path_factory, wrap):
    kt = run(tmp_path_factory, 1, "--side", "kt", "--trainer", "dpo", "--wrap", wrap)
    plain = run(tmp_path_factory, 1, "--side", "plain", "--trainer", "dpo", "--wrap", wrap)
    assert_same_logs(kt, plain, 1e-4)
    assert abs(plain[-1]["rewards/margins"]) > 1e-3  # the policy moved away from the reference
    if wrap == "peft_config":  # reference = the base model, policy = the adapter: rewards from step 1
        assert abs(plain[0]["rewards/chosen"]) > 1e-2


@pytest.mark.parametrize("extra", [(), ("--packing",), ("--wrap", "peft_config")],
                         ids=["padded", "packed", "peft_config"])
def test_sft_equals_plain_peft(tmp_path_factory, extra):
    """SFT on a model already wrapped with PEFT, padded and packed, and through TRL's own
    peft_config path (where kt's expert LoRA once stayed frozen: plain PEFT's losses need it)."""
    kt = run(tmp_path_factory, 1, "--side", "kt", "--trainer", "sft", *extra)
    plain = run(tmp_path_factory, 1, "--side", "plain", "--trainer", "sft", *extra)
    assert_same_logs(kt, plain, 1e-5)


@pytest.mark.parametrize("args", [("--trainer", "dpo", "--wrap", "model"), ("--trainer", "dpo", "--wrap", "peft_config"),
                                  ("--trainer", "sft"), ("--trainer", "sft", "--packing")],
                         ids=["dpo-model", "dpo-peft_config", "sft-padded", "sft-packed"])
def test_under_torchrun_equals_one_process(tmp_path_factory, args):
    one = run(tmp_path_factory, 1, "--side", "kt", *args)
    two = run(tmp_path_factory, 2, "--side", "kt", *args)
    assert_same_logs(two, one, 1e-4)


def test_grpo_generates_and_trains_the_expert_lora(tmp_path):
    """GRPOTrainer (TRL's peft_config path, generation with transformers' generate through
    kt.moe, a rule-based reward): it runs on the CPU, logs rewards, and kt's expert LoRA moves.
    (Sampled completions make an exact comparison with plain PEFT moot.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(["timeout", "-k", "10", "300", sys.executable, SCRIPT, str(tmp_path), "--side", "kt",
                           "--trainer", "grpo", "--wrap", "peft_config"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-8000:]
    with open(tmp_path / "result.json") as f:
        result = json.load(f)
    assert len(result["logs"]) == 3 and all("reward" in step for step in result["logs"])
    assert all(0.0 <= step["reward"] <= 1.0 for step in result["logs"])
    assert result["expert_lora_change"] > 1e-4
