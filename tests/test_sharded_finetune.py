"""The main job with sharded experts (kt_ops.finetune --expert-shards 2), as users launch it:

* an owner computes with the CPUs its affinity mask allows (split between the node's owners);
* 2 ranks, S = 2 (rank 0 holds experts 0-3, rank 1 experts 4-7 of each layer) logs the
  one-owner job's losses and writes the same adapter (fp32 noise); its Trainer checkpoint
  holds the gathered adapter and no expert tensor in the model file (each owner holds other
  experts under the same names), and resuming it from step 2 ends as the uninterrupted run;
* two torchrun commands, each one "node" of 2 ranks, --owners per-node --expert-shards 2
  (each node's two ranks own a shard each, shard s's owners on the two nodes averaging their
  gradients) log the losses of the same 4 ranks with one owner;
* an exception in kt.moe on the second shard's owner, in forward or in backward (2 ranks; and
  on node 1 with per-node owners), ends every rank non-zero, with the owner's message, the whole
  job (startup included) under the FAULT_LIMIT_S `timeout` that bounds it (a hang fails); the
  time from the failing step's start to the end is printed (-s), not asserted: wall-clock
  times are measured, never asserted.
"""
import json
import os
import re
import shutil
import time

import pytest
import torch

from test_finetune import TINY
from test_per_node_torchrun import all_ok, two_node_commands
from test_resume_and_faults import FAULT_LIMIT_S, STEPS, TIMED_OUT, adapter, assert_same_adapter, losses, ok, torchrun

pytest.importorskip("transformers")
SHARDED = ["--expert-shards", "2"]


def assert_close_adapters(got, want):
    assert got.keys() == want.keys() and got
    for name in want:  # AdamW turns reduction-order noise in tiny gradients into steps: by norm
        assert (got[name] - want[name]).norm() <= 1e-4 * want[name].norm(), name


@pytest.fixture(scope="module")
def one_owner_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_owner")
    ok(torchrun(TINY + STEPS, out, ranks=2))
    return out


@pytest.fixture(scope="module")
def sharded_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    ok(torchrun(TINY + STEPS + SHARDED + ["--save-steps", "2"], out, ranks=2))
    return out


def threads_of_rank0(out) -> int:
    return json.loads((out / "summary.json").read_text())["threads_per_process"]


def test_owners_compute_with_the_cpus_their_affinity_allows(one_owner_two_ranks, sharded_two_ranks):
    """torchrun starts the ranks with OMP_NUM_THREADS=1 (the tests set it too); the main job gives
    an owner the CPUs of its affinity mask, split between the node's owners when nothing bound
    them apart: rank 0 alone owns with one owner, it shares the machine with rank 1 with 2 shards."""
    cpus = len(os.sched_getaffinity(0))  # the ranks inherit this process's mask
    whole = cpus >= (os.cpu_count() or cpus)
    assert threads_of_rank0(one_owner_two_ranks) == cpus
    assert threads_of_rank0(sharded_two_ranks) == (max(1, cpus // 2) if whole else cpus)


def test_two_shards_log_the_one_owner_losses_and_adapter(one_owner_two_ranks, sharded_two_ranks):
    (first_a, a), (first_b, b) = losses(one_owner_two_ranks), losses(sharded_two_ranks)
    assert first_a == first_b == 1 and len(a) == len(b) == 4
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)
    assert_close_adapters(adapter(sharded_two_ranks), adapter(one_owner_two_ranks))


def test_two_shards_checkpoint_and_resume(sharded_two_ranks, tmp_path):
    from safetensors import safe_open

    ckpt = sharded_two_ranks / "checkpoint-2"
    record = json.loads((ckpt / "kt_checkpoint.json").read_text())
    assert record["world_size"] == 2 and record["expert_owners"] == [0, 1]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if ".experts." in k and ("lora" in k or "proj" in k)]
        assert [k for k in f.keys() if ".experts.grad_anchor" in k]  # the replicated ones stay
    saved = adapter(ckpt)  # all 8 experts' LoRA: [r·E, H] = [8·8, 64] for gate_up's A
    a_keys = [k for k in saved if k.endswith("experts.base_layer.lora_A.weight")]
    assert a_keys and all(saved[k].shape == (8 * 8, 64) for k in a_keys)

    out = tmp_path / "resumed"
    shutil.copytree(ckpt, out / "checkpoint-2")
    ok(torchrun(TINY + STEPS + SHARDED + ["--resume", str(out / "checkpoint-2")], out, ranks=2))
    first, resumed = losses(out)
    _, full = losses(sharded_two_ranks)
    assert first == 3 and len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[2:]), rtol=1e-5, atol=0)
    assert_same_adapter(adapter(out), adapter(sharded_two_ranks))


def test_two_nodes_with_two_shards_each_log_the_one_owner_losses(tmp_path):
    one_owner, per_node = tmp_path / "one_owner", tmp_path / "per_node"
    ok(torchrun(TINY + STEPS, one_owner, ranks=4))
    all_ok(two_node_commands([*TINY, *STEPS, "--owners", "per-node", *SHARDED, "--save-steps", "4",
                              "--output-dir", str(per_node)], ranks_per_node=2, module=("-m", "kt_ops.finetune")))
    record = json.loads((per_node / "checkpoint-4" / "kt_checkpoint.json").read_text())
    assert record["world_size"] == 4 and record["expert_owners"] == [0, 1, 2, 3]
    (_, a), (_, b) = losses(one_owner), losses(per_node)
    assert len(a) == len(b) == 4
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)
    assert_close_adapters(adapter(per_node), adapter(one_owner))


def seconds_after_the_fault(stderr: str, ended: float) -> float:
    """From the test hook's "armed at" line (the step that fails begins) to the job's end."""
    armed = re.search(r"KT_OPS_FINETUNE_FAULT: armed at ([0-9.]+)", stderr)
    assert armed, stderr[-4000:]
    return ended - float(armed.group(1))


@pytest.mark.parametrize("what", ["kt", "kt-backward"])
def test_a_failure_on_the_second_shards_owner_ends_every_rank_fast(what, tmp_path):
    proc = torchrun(TINY + STEPS + SHARDED, tmp_path / "out", ranks=2, fault=f"{what}@1:2", timeout=FAULT_LIMIT_S)
    after = seconds_after_the_fault(proc.stderr, time.time())
    print(f"\n{what}: every rank ended {after:.1f} s after the failing step began")  # reported, not asserted
    assert proc.returncode not in (0, *TIMED_OUT), (proc.returncode, proc.stderr[-4000:])
    message = f"injected {what} failure at step 2 on rank 1"
    assert f"[rank1]: RuntimeError: {message}" in proc.stderr, proc.stderr[-4000:]
    assert f"[rank0]: kt_ops.faults.RemoteRankFailure: kt_ops: rank 1 failed: RuntimeError: {message}" in proc.stderr \
        or "SIGTERM" in proc.stderr, proc.stderr[-4000:]


def test_a_failure_on_node_1s_second_shard_ends_both_nodes_fast(tmp_path):
    runs = two_node_commands([*TINY, *STEPS, "--owners", "per-node", *SHARDED, "--output-dir", str(tmp_path / "out")],
                             ranks_per_node=2, module=("-m", "kt_ops.finetune"), fault="kt-backward@3:2",
                             timeout=FAULT_LIMIT_S)
    after = seconds_after_the_fault(runs[1][2], time.time())
    print(f"\nper-node: both nodes ended {after:.1f} s after the failing step began")  # reported, not asserted
    message = "injected kt-backward failure at step 2 on rank 3"
    for node, (proc, _, err) in enumerate(runs):
        assert proc.returncode not in (0, *TIMED_OUT), (node, proc.returncode, err[-4000:])
    assert f"RuntimeError: {message}" in runs[1][2], runs[1][2][-4000:]
    node0 = runs[0][2]
    assert f"kt_ops: rank 3 failed: RuntimeError: {message}" in node0 or "SIGTERM" in node0, node0[-4000:]
