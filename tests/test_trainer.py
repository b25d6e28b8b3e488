"""A stock ``transformers.Trainer`` on a patched tiny Qwen3-MoE, in one process and under
``torch.distributed.run`` with 2 gloo ranks (accelerate wraps the model in DDP, which works
because patch_model marked the owner-only expert tensors; see kt_ops.distributed): the same
logged losses and trained tensors (fp32, SGD), with the expert LoRA alone and with the routers
and attention q_proj as well, the latter with HF gradient checkpointing and the kt policy given
through ``TrainingArguments(gradient_checkpointing_kwargs=...)``, and with gradient clipping
(``max_grad_norm=1.0``: every rank clips by the global norm, the experts' included, because
each KT layer shares its owner's expert-gradient norm). Both ranks end with the same replicated
tensors."""
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "trainer_run.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out, extra, ranks):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port())]
    proc = subprocess.run(["timeout", "-k", "10", "240", *launcher, SCRIPT, str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    return torch.load(os.path.join(out, "result.pt"))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("extra", [[], ["--train-router", "--checkpointing"], ["--train-router", "--max-grad-norm", "1.0"]],
                         ids=["expert-lora", "lora+router-ckpt", "lora+router-clipped"])
def test_trainer_under_torchrun_equals_one_process(tmp_path, extra):
    single = run(tmp_path / "single", extra, 1)
    multi = run(tmp_path / "multi", extra, 2)
    assert single["world"] == 1 and multi["world"] == 2 and len(single["losses"]) == 3
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    assert single["state"].keys() == multi["state"].keys() and any("lora" in n for n in single["state"])
    assert any("mlp.gate" in n for n in single["state"]) == bool(extra)
    for name, want in single["state"].items():
        assert rel_err(multi["state"][name], want) <= 1e-5, name
    other = torch.load(tmp_path / "multi" / "replicated_rank1.pt")
    assert not any("lora" in n for n in other)  # rank 1 holds no expert tensor
    for name, t in other.items():
        assert rel_err(t, multi["state"][name]) <= 1e-6, name
