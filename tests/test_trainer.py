"""A stock ``transformers.Trainer`` on a patched tiny Qwen3-MoE, in one process and under
``torch.distributed.run`` with 2 gloo ranks (accelerate wraps the model in DDP, which works
because patch_model marked the owner-only expert tensors; see kt_ops.distributed): the same
logged losses and trained tensors (fp32, SGD), with the expert LoRA alone and with the routers
and attention q_proj as well, the latter with HF gradient checkpointing and the kt policy given
through ``TrainingArguments(activation_checkpointing_kwargs=...)``, and with gradient clipping
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
    if proc.returncode != 0:  # a plain string: pytest would cut a long tuple repr in the middle
        pytest.fail(f"exit status {proc.returncode}\n--- stderr (end) ---\n{proc.stderr[-8000:]}\n"
                    f"--- stdout (end) ---\n{proc.stdout[-2000:]}", pytrace=False)
    return torch.load(os.path.join(out, "result.pt"))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("extra", [[], ["--train-router", "--checkpointing"], ["--train-router", "--max-grad-norm", "1.0"],
                                   ["--attention-lora", "--max-grad-norm", "1.0"]],
                         ids=["expert-lora", "lora+router-ckpt", "lora+router-clipped", "lora+peft-attention-clipped"])
def test_trainer_under_torchrun_equals_one_process(tmp_path, extra):
    single = run(tmp_path / "single", extra, 1)
    multi = run(tmp_path / "multi", extra, 2)
    assert single["world"] == 1 and multi["world"] == 2 and len(single["losses"]) == 3
    assert list(single["losses"]) == list(multi["losses"]) == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(list(multi["losses"].values())), torch.tensor(list(single["losses"].values())),
                               rtol=1e-5, atol=1e-5)
    assert single["state"].keys() == multi["state"].keys() and any("lora" in n for n in single["state"])
    assert any("mlp.gate" in n for n in single["state"]) == ("--train-router" in extra)
    assert any("q_proj.lora_A" in n for n in single["state"]) == ("--attention-lora" in extra)
    for name, want in single["state"].items():
        assert rel_err(multi["state"][name], want) <= 1e-5, name
    other = torch.load(tmp_path / "multi" / "replicated_rank1.pt")
    assert not any(".experts." in n for n in other)  # rank 1 holds no expert tensor
    for name, t in other.items():
        assert rel_err(t, multi["state"][name]) <= 1e-6, name


@pytest.mark.parametrize("extra", [["--train-router", "--max-grad-norm", "1.0"], ["--train-router", "--checkpointing"]],
                         ids=["lora+router-clipped", "lora+router-ckpt"])
def test_trainer_with_two_expert_shards_equals_one_process(tmp_path, extra):
    """expert_shards=2 on 2 ranks under the Trainer (clipping by the global norm: both ranks see
    the norm of all experts' gradients; kt checkpointing): the losses and trained tensors of one
    process, rank 0 holding experts 0-3 of each layer and rank 1 experts 4-7."""
    single = run(tmp_path / "single", extra, 1)
    sharded = run(tmp_path / "sharded", extra + ["--expert-shards", "2"], 2)
    torch.testing.assert_close(torch.tensor(list(sharded["losses"].values())),
                               torch.tensor(list(single["losses"].values())), rtol=1e-5, atol=1e-5)
    other = torch.load(tmp_path / "sharded" / "replicated_rank1.pt")
    experts = [n for n in single["state"] if ".experts." in n]
    assert experts and set(sharded["state"]) == set(other) == set(single["state"])
    for name, want in single["state"].items():
        got = torch.cat([sharded["state"][name], other[name]]) if name in experts else sharded["state"][name]
        assert rel_err(got, want) <= 1e-5, name


def test_checkpoints_resume_the_same_loss_curve_and_hold_a_peft_adapter(tmp_path):
    """4 steps with a checkpoint every 2, then a new run resumed from checkpoint-2: steps 3-4 log
    the same losses and end with the same tensors. Each checkpoint holds the model without its
    frozen expert base weights (the tied gate/up LoRA A saved once) and, through
    KTAdapterCallback, the expert adapter in PEFT format, which kt_ops.load_adapter reads back
    into a freshly patched model."""
    import safetensors.torch

    import kt_ops
    from test_ddp_fsdp import build_model

    full = run(tmp_path / "full", ["--steps", "4", "--save-steps", "2"], 1)
    ckpt = tmp_path / "full" / "checkpoint-2"
    resumed = run(tmp_path / "resumed", ["--steps", "4", "--resume", str(ckpt)], 1)
    # The resumed run's log history holds the checkpoint's steps 1-2 and its own 3-4; it ran 2
    # steps (2 MoE layers: 4 expert forwards), not 4.
    assert list(full["losses"]) == list(resumed["losses"]) == [1, 2, 3, 4]
    assert full["kernel_calls"]["moe_forward"] == 8 and resumed["kernel_calls"]["moe_forward"] == 4
    for step in (3, 4):
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step]), step
    for name, want in full["state"].items():
        assert rel_err(resumed["state"][name], want) <= 1e-6, name

    saved = safetensors.torch.load_file(ckpt / "model.safetensors")
    a_key = "model.layers.0.mlp.experts.adapters.lora.default.gate_lora_a"
    assert a_key in saved and a_key.replace("gate_lora_a", "up_lora_a") not in saved
    # the frozen expert base weights are not in the checkpoints (KTAdapterCallback): resuming
    # above kept the ones in memory
    assert not any(k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) for k in saved)
    assert "model.layers.0.mlp.gate.weight" in saved
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    fresh = build_model()
    kt_ops.load_adapter(fresh, str(ckpt))
    params = dict(fresh.named_parameters())
    for name, tensor in saved.items():
        if "lora" in name:
            torch.testing.assert_close(params[name], tensor, rtol=0, atol=0, msg=name)


def test_peft_attention_lora_checkpoints_resume_and_load_in_plain_peft(tmp_path):
    """With PEFT LoRA on attention (kt_ops.hf.get_peft_model) the Trainer's checkpoints are one
    adapter holding both LoRAs: resuming from checkpoint-2 continues the loss curve (PEFT's
    load_adapter on that model also restores the experts' LoRA), and the checkpoint loads into
    the unpatched model with plain PEFT, and into a patched one with kt_ops.load_adapter, with
    the same logits."""
    import peft

    import kt_ops
    from test_ddp_fsdp import build_model
    from test_quantized_layer import input_ids, tiny_qwen3_moe

    full = run(tmp_path / "full", ["--attention-lora", "--steps", "4", "--save-steps", "2"], 1)
    ckpt = tmp_path / "full" / "checkpoint-2"
    resumed = run(tmp_path / "resumed", ["--attention-lora", "--steps", "4", "--resume", str(ckpt)], 1)
    for step in (3, 4):
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step]), step
    for name, want in full["state"].items():
        assert rel_err(resumed["state"][name], want) <= 1e-6, name

    plain = peft.PeftModel.from_pretrained(tiny_qwen3_moe(torch.float32), str(ckpt))
    ours = kt_ops.load_adapter(build_model(), str(ckpt))
    ids = input_ids(seed=5)
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        assert rel_err(ours.eval()(input_ids=ids).logits, want) <= 1e-5
        assert rel_err(tiny_qwen3_moe(torch.float32)(input_ids=ids).logits, want) > 1e-3  # the adapter matters
