"""Multi-rank jobs that survive: resume under torchrun, and a failure on any rank ends the job.

* Resume: the main job (kt_ops.finetune, AdamW) on 2 ranks with one owner, and a KTTrainer run
  on 2 "nodes" of 2 ranks with one owner each, resumed from an intermediate checkpoint, log the
  uninterrupted run's losses for the remaining steps and end with its adapter (each rank
  restores its own optimizer state: rank 1 trains the norms only, rank 0 the experts too).
* Faults: an exception on the owner (in kt.moe) or on the other rank (in the model's forward, in
  data loading), a SIGKILL of either rank, and a resume from a truncated optimizer file or a
  checkpoint without its adapter each end the 2-rank job with a non-zero exit and the original
  message within 30 s: each runs under `timeout 30`, so a job that does not end by then (a hang,
  as before the fix) is killed and fails the test.
* A job killed while saving leaves a partial newest checkpoint: ``--resume latest`` skips it
  with a warning and continues from the last complete one; resuming on another layout is refused.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from test_finetune import ROOT, TINY, _free_port

STEPS = ["--steps", "4", "--lr", "1e-2", "--backend", "none", "--also-train", "norm"]
FAULT_LIMIT_S = 30  # the bound on such a job, startup included: the `timeout` it runs under
TIMED_OUT = (124, 137)  # timeout's exit status, after SIGTERM / SIGKILL


def torchrun(args, out, ranks=2, fault=None, timeout=240, module=("-m", "kt_ops.finetune")):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "KT_OPS_FINETUNE_FAULT"):
        env.pop(name, None)
    if fault:
        env["KT_OPS_FINETUNE_FAULT"] = fault
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *module, *args]
    if module[0] == "-m":
        cmd += ["--output-dir", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def losses(out):
    summary = json.loads((out / "summary.json").read_text())["kt_ops"]
    return summary["first_step"], summary["losses"]


def adapter(folder):
    return safetensors.torch.load_file(folder / "adapter_model.safetensors")


def assert_same_adapter(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """The uninterrupted 2-rank job, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("two_ranks") / "full"
    ok(torchrun(TINY + STEPS + ["--save-steps", "2"], out))
    return out


def test_two_ranks_resume_equals_the_uninterrupted_run(two_rank_run, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(two_rank_run / "checkpoint-2", out / "checkpoint-2")
    ckpt = out / "checkpoint-2"
    assert {"optimizer.pt", "optimizer_1.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(ckpt))
    record = json.loads((ckpt / "kt_checkpoint.json").read_text())
    assert record["world_size"] == 2 and record["expert_owners"] == [0]
    # rank 1's optimizer holds the norms' state only, rank 0's the experts' LoRA too
    rank0 = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    rank1 = torch.load(ckpt / "optimizer_1.pt", weights_only=True)["state"]
    assert len(rank1) < len(rank0) and len(rank1) > 0

    ok(torchrun(TINY + STEPS + ["--resume", str(ckpt)], out))
    first, resumed = losses(out)
    _, full = losses(two_rank_run)
    assert first == 3 and len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[2:]), rtol=1e-5, atol=0)
    assert_same_adapter(adapter(out), adapter(two_rank_run))


def test_two_nodes_of_two_ranks_resume_equals_the_uninterrupted_run(tmp_path):
    """One owner per node (ranks 0 and 2), AdamW; each of the 4 ranks restores its own state."""
    script = ("tests/trainer_run.py",)
    common = ["--nodes", "2", "--train-router", "--optim", "adamw_torch", "--lr", "1e-2", "--steps", "4"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    ok(torchrun([str(full), *common, "--save-steps", "2"], full, ranks=4, module=script))
    ckpt = full / "checkpoint-2"
    assert json.loads((ckpt / "kt_checkpoint.json").read_text())["expert_owners"] == [0, 2]
    ok(torchrun([str(resumed), *common, "--resume", str(ckpt)], resumed, ranks=4, module=script))
    a, b = torch.load(full / "result.pt"), torch.load(resumed / "result.pt")
    assert list(a["losses"]) == list(b["losses"]) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(b["losses"][step] - a["losses"][step]) <= 1e-5 * abs(a["losses"][step]), step
    for name, want in a["state"].items():
        torch.testing.assert_close(b["state"][name], want, rtol=1e-5, atol=1e-7, msg=name)
    # the second node's owner ends with the same experts as the first's
    node1 = torch.load(resumed / "replicated_rank2.pt")
    assert any("lora" in n for n in node1)
    for name, t in node1.items():
        torch.testing.assert_close(t, b["state"][name], rtol=1e-6, atol=1e-7, msg=name)


def test_one_process_resume_ends_with_the_uninterrupted_adapter(tmp_path):
    from kt_ops import finetune

    argv = TINY + STEPS + ["--save-steps", "2"]
    full = finetune.run(argv + ["--output-dir", str(tmp_path / "full")])
    resumed = finetune.run(argv + ["--output-dir", str(tmp_path / "full"), "--resume", "latest"])
    # latest = checkpoint-4, the end: nothing left to train; from checkpoint-2: steps 3-4
    assert resumed.kt.losses == []
    shutil.rmtree(tmp_path / "full" / "checkpoint-4")
    resumed = finetune.run(argv + ["--output-dir", str(tmp_path / "again"), "--resume",
                                   str(tmp_path / "full" / "checkpoint-2")])
    assert resumed.kt.first_step == 3
    torch.testing.assert_close(torch.tensor(resumed.kt.losses), torch.tensor(full.kt.losses[2:]), rtol=1e-5, atol=0)
    assert_same_adapter(adapter(tmp_path / "again"), adapter(tmp_path / "full"))


@pytest.mark.parametrize("fault,origin", [("kt@0:2", "owner, in kt.moe"), ("forward@1:2", "non-owner, forward"),
                                          ("data@1:2", "non-owner, data loading"), ("kill@0:2", "owner killed"),
                                          ("kill@1:2", "non-owner killed")])
def test_a_failure_on_one_rank_ends_the_job_fast(tmp_path, fault, origin):
    proc = torchrun(TINY + STEPS, tmp_path / "out", fault=fault, timeout=FAULT_LIMIT_S)
    assert proc.returncode not in (0, *TIMED_OUT), (origin, proc.returncode, proc.stderr[-4000:])
    if fault.startswith("kill"):
        assert "SIGKILL" in proc.stderr, proc.stderr[-4000:]
    else:
        what, rank = fault.split("@")[0], fault.split("@")[1].split(":")[0]
        message = f"injected {what} failure at step 2 on rank {rank}"
        failing = f"[rank{rank}]: RuntimeError: {message}"
        assert failing in proc.stderr, proc.stderr[-4000:]
        other = 1 - int(rank)  # raises with the original message (or was ended by torchrun first)
        assert f"[rank{other}]: kt_ops.faults.RemoteRankFailure: kt_ops: rank {rank} failed: RuntimeError: {message}" \
            in proc.stderr or "SIGTERM" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("damage", ["truncated optimizer", "adapter removed"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(two_rank_run, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(two_rank_run / "checkpoint-2", out / "checkpoint-2")
    ckpt = out / "checkpoint-2"
    if damage == "truncated optimizer":
        data = (ckpt / "optimizer_1.pt").read_bytes()
        (ckpt / "optimizer_1.pt").write_bytes(data[:len(data) // 2])
        expected = "rank 1: optimizer_1.pt is unreadable"
    else:
        (ckpt / "adapter_model.safetensors").unlink()
        expected = "adapter_model.safetensors missing"
    proc = torchrun(TINY + STEPS + ["--resume", str(ckpt)], out, timeout=FAULT_LIMIT_S)
    assert proc.returncode not in (0, *TIMED_OUT), (proc.returncode, proc.stderr[-4000:])
    for rank in (0, 1):  # every rank refuses, naming the file
        assert f"[rank{rank}]: ValueError: kt_ops: cannot resume from {ckpt}: {expected}" in proc.stderr, \
            proc.stderr[-4000:]
    assert not (out / "checkpoint-4").exists()  # no step was taken


def test_killed_while_saving_resumes_from_the_last_complete_checkpoint(two_rank_run, tmp_path):
    out = tmp_path / "out"
    proc = torchrun(TINY + STEPS + ["--save-steps", "2"], out, fault="kill-in-save@0:4", timeout=120)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr
    partial = out / "checkpoint-4"
    assert partial.is_dir() and not (partial / "kt_checkpoint.json").exists()  # the Trainer's files, not kt's

    proc = ok(torchrun(TINY + STEPS + ["--save-steps", "2", "--resume", "latest"], out))
    assert f"skipping incomplete checkpoint {partial}: kt_checkpoint.json is missing" in proc.stderr
    first, resumed = losses(out)
    _, full = losses(two_rank_run)
    assert first == 3
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[2:]), rtol=1e-5, atol=0)
    assert_same_adapter(adapter(out), adapter(two_rank_run))


def test_resuming_on_another_layout_is_refused(two_rank_run, tmp_path):
    from kt_ops import finetune

    with pytest.raises(ValueError, match=r"written by a job of 2 rank\(s\) with experts on rank\(s\) 0, this job "
                                         r"has 1 rank\(s\) with experts on rank\(s\) 0"):
        finetune.run(TINY + STEPS + ["--output-dir", str(tmp_path), "--resume", str(two_rank_run / "checkpoint-2")])


def test_latest_skips_incomplete_checkpoints_and_names_what_is_missing(two_rank_run, tmp_path):
    """In one process (checks only): the newest checkpoint without rank 1's optimizer file is
    skipped with a warning naming it; a named one is refused naming it; none complete: refused."""
    from kt_ops.hf import checkpoints

    for step in (2, 4):
        shutil.copytree(two_rank_run / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-4" / "optimizer_1.pt").unlink()
    layout = checkpoints.JobLayout(2, (0,))
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint .*checkpoint-4: optimizer_1.pt missing"):
        reader = checkpoints.open_for_resume("latest", str(tmp_path), layout)
    assert reader.folder == str(tmp_path / "checkpoint-2") and reader.optimizer_state is not None
    with pytest.raises(ValueError, match="checkpoint-4: optimizer_1.pt missing"):
        checkpoints.open_for_resume(str(tmp_path / "checkpoint-4"), str(tmp_path), layout)
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"trunc')
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no complete checkpoint in .*trainer_state.json "
                                                                    "is unreadable"):
        checkpoints.open_for_resume("latest", str(tmp_path), layout)
    data = (tmp_path / "checkpoint-4" / "model.safetensors").read_bytes()
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(data[:-100])
    shutil.copy(tmp_path / "checkpoint-2" / "optimizer_1.pt", tmp_path / "checkpoint-4")
    with pytest.raises(ValueError, match="model.safetensors is unreadable"):
        checkpoints.open_for_resume(str(tmp_path / "checkpoint-4"), str(tmp_path), layout)
