"""The fine-tuning command (kt_ops.finetune) at tiny settings: the loss falls, the outputs are
written, the adapter loads back into a freshly patched model with the same logits, the
HF-experts + PEFT comparison run follows the same loss curve, and two processes under torchrun
give the single-process losses on the same global batch."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kt_ops import finetune
from kt_ops.finetune.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = ("num_hidden_layers=2,hidden_size=64,intermediate_size=128,moe_intermediate_size=32,"
              "num_experts=8,num_experts_per_tok=2,num_attention_heads=2,num_key_value_heads=1")
TINY = ["--model-config", TINY_MODEL, "--seq-len", "32", "--batch-size", "4", "--no-progress"]


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """One process (no RANK/WORLD_SIZE), fresh dynamo state, torch's thread count restored."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_train_compare_save_and_reload(tmp_path):
    out = tmp_path / "out"
    argv = TINY + ["--steps", "12", "--lr", "1e-2", "--backend", "aot_eager", "--compare-eager",
                   "--output-dir", str(out)]
    result = finetune.run(argv)

    losses = result.kt.losses
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2, losses  # it learns

    # HF's experts + PEFT from the same init on the same batches: the same curve.
    comparison = result.summary["comparison"]
    assert comparison["max_abs_diff"] < 1e-4, comparison
    assert comparison["speedup"] > 0

    for name in ("adapter_model.safetensors", "adapter_config.json", "loss_curve.png", "summary.json"):
        assert (out / name).is_file(), name
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kt_ops"]["losses"] == losses
    assert summary["kt_ops"]["tokens_per_s"] > 0 and summary["eager"]["tokens_per_s"] > 0
    assert summary["settings"]["lora_rank"] == 8 and summary["world_size"] == 1

    # The adapter loads into a freshly built, freshly patched model: same logits.
    fresh = finetune.build_kt_model(finetune.parse_args(argv))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    before = logits(fresh, ids)
    import kt_ops
    kt_ops.load_adapter(fresh, str(out))
    trained = logits(result.model, ids)
    assert not torch.allclose(before, trained)  # the adapter matters
    torch.testing.assert_close(logits(fresh, ids), trained, rtol=1e-5, atol=1e-5)


def test_inductor_backend_runs_experts_once_per_layer_and_step(tmp_path):
    """The default backend (inductor, fullgraph) with kt checkpointing: no graph break, and the
    CPU experts run once per layer and step in forward and in backward (never recomputed)."""
    from kt_ops import _kernels

    layers, steps = 1, 2  # one layer: inductor's compile time dominates this test
    argv = TINY + ["--model-config", TINY_MODEL.replace("num_hidden_layers=2", f"num_hidden_layers={layers}"),
                   "--steps", str(steps), "--output-dir", str(tmp_path)]
    _kernels.calls.clear()
    result = finetune.run(argv)
    assert result.summary["settings"]["backend"] == "inductor"
    assert len(result.kt.losses) == steps and all(map(torch.isfinite, torch.tensor(result.kt.losses)))
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert dict(_kernels.calls) == {"moe_forward": layers * steps, "moe_backward": layers * steps}


@pytest.mark.parametrize("expert_format", [None, "int8"])
def test_local_model_directory_without_checkpointing(tmp_path, monkeypatch, expert_format):
    """--model streams a saved model through kt_ops.hf.from_pretrained (never
    AutoModelForCausalLM.from_pretrained), optionally quantizing the experts (no tokenizer
    files: the byte tokenizer is used)."""
    base = finetune.build_base_model(finetune.parse_args(TINY))
    base.save_pretrained(tmp_path / "model")
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the unpatched model was materialised")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    fmt = ["--expert-format", expert_format] if expert_format else []
    result = finetune.run(["--model", str(tmp_path / "model"), "--seq-len", "16", "--batch-size", "2",
                           "--steps", "2", "--backend", "none", "--no-checkpointing", "--no-progress",
                           "--output-dir", str(tmp_path / "out"), *fmt])
    assert result.summary["tokenizer"]["type"] == "kt_ops.tokenizer.ByteTokenizer"
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert all(map(torch.isfinite, torch.tensor(result.kt.losses)))


def test_torchrun_two_processes_match_single_process(tmp_path):
    """2 ranks (the Trainer's gloo group and DDP, experts on rank 0, eager backend) on the same
    global batch: the rank-averaged losses equal the single-process losses. The RMSNorm weights
    train too (--also-train): DDP averages their gradients."""
    argv = TINY + ["--steps", "3", "--lr", "1e-2", "--backend", "eager", "--also-train", "norm"]
    single = finetune.run(argv + ["--output-dir", str(tmp_path / "single")]).kt.losses

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = ["timeout", "-k", "10", "240", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "kt_ops.finetune",
           *argv, "--output-dir", str(tmp_path / "multi")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["world_size"] == 2
    torch.testing.assert_close(torch.tensor(summary["kt_ops"]["losses"]), torch.tensor(single),
                               rtol=1e-5, atol=1e-5)
    assert summary["also_trained"] and all("norm" in n for n in summary["also_trained"])
    for name in ("adapter_model.safetensors", "also_trained.safetensors"):
        assert (tmp_path / "multi" / name).is_file()


def test_resume_continues_the_loss_curve(tmp_path):
    """--save-steps writes Trainer checkpoints (with the expert adapter); --resume from the one
    at step 2 gives steps 3-4 of the uninterrupted run."""
    argv = TINY + ["--steps", "4", "--lr", "1e-2", "--backend", "none", "--save-steps", "2"]
    full = finetune.run(argv + ["--output-dir", str(tmp_path / "full")])
    assert (tmp_path / "full" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    resumed = finetune.run(argv + ["--output-dir", str(tmp_path / "full"), "--resume",
                                   str(tmp_path / "full" / "checkpoint-2")])
    assert resumed.kt.first_step == 3 and len(resumed.kt.losses) == 2
    torch.testing.assert_close(torch.tensor(resumed.kt.losses), torch.tensor(full.kt.losses[2:]),
                               rtol=1e-6, atol=1e-6)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, wörld", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids) == "héllo, wörld"


def test_bad_arguments():
    with pytest.raises(SystemExit):
        finetune.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        finetune.parse_args(["--model", "x", "--model-config", "hidden_size=64"])
    assert finetune.parse_args(["--model-config", "hidden_size=64,norm_topk_prob=false"]).model_config == {
        "hidden_size": 64, "norm_topk_prob": False}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slow_bf16_note_only_for_bf16_on_cpus_without_avx512_bf16():
    bf16 = torch.bfloat16
    assert "without AVX512-BF16 (kt_ops path avx2)" in finetune.slow_bf16_note(bf16, "cpu", "avx2")
    assert finetune.slow_bf16_note(bf16, "cpu", "avx512") is not None
    assert finetune.slow_bf16_note(bf16, "cpu", "avx512_bf16") is None
    assert finetune.slow_bf16_note(bf16, "cuda", "avx2") is None  # the model's layers on a GPU
    assert finetune.slow_bf16_note(torch.float32, "cpu", "avx2") is None
