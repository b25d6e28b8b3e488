"""owners="per-node" as a user launches it: two torchrun commands on this machine, each one
"node" of 2 ranks (--nnodes 2 --node-rank 0 / 1), the model patched before the Trainer sets up
the process group. It trains exactly as the same 4 ranks with the node groups built by hand
(trainer_run.py --nodes 2, itself checked against one process in test_trainer.py /
test_one_owner_per_node.py): the same losses, the same trained tensors, and node 1's owner ends
with node 0's experts. The main job (kt_ops.finetune --owners per-node) logs the one-owner job's
losses, and a failure on the second node's owner ends both nodes fast."""
import json
import os
import subprocess
import sys

import pytest
import torch

from test_finetune import ROOT, TINY, _free_port
from test_resume_and_faults import FAULT_LIMIT_S, STEPS, TIMED_OUT, adapter, losses, ok, torchrun

pytest.importorskip("transformers")
SCRIPT = ("tests/trainer_run.py",)
COMMON = ["--train-router", "--steps", "3"]


def two_node_commands(args, ranks_per_node, module=SCRIPT, fault=None, timeout=240):
    """``torchrun --nnodes 2 --node-rank {0,1} ... <module> <args>``, both at once, as two nodes
    of this machine would run them, each under ``timeout``; [(process, stdout, stderr)] per node."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "KT_OPS_FINETUNE_FAULT"):
        env.pop(name, None)
    if fault:
        env["KT_OPS_FINETUNE_FAULT"] = fault
    port = _free_port()
    procs = [subprocess.Popen(
        ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
         "--node-rank", str(node), "--nproc-per-node", str(ranks_per_node), "--master-addr", "127.0.0.1",
         "--master-port", str(port), *module, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    return [(p, *p.communicate()) for p in procs]


def all_ok(runs):
    for node, (proc, _, err) in enumerate(runs):
        assert proc.returncode == 0, f"node {node}: exit {proc.returncode}\n{err[-6000:]}"


def test_two_torchrun_nodes_train_as_the_groups_built_by_hand(tmp_path):
    by_hand, per_node = tmp_path / "by_hand", tmp_path / "per_node"
    ok(torchrun([str(by_hand), *COMMON, "--nodes", "2"], by_hand, ranks=4, module=SCRIPT))
    all_ok(two_node_commands([str(per_node), *COMMON, "--owners", "per-node"], ranks_per_node=2))
    a, b = torch.load(by_hand / "result.pt"), torch.load(per_node / "result.pt")
    assert a["world"] == b["world"] == 4
    assert list(a["losses"]) == list(b["losses"]) == [1, 2, 3]
    for step in a["losses"]:
        assert abs(b["losses"][step] - a["losses"][step]) <= 1e-6 * abs(a["losses"][step]), step
    assert any("lora" in n for n in b["state"]) and a["state"].keys() == b["state"].keys()
    for name, want in a["state"].items():
        torch.testing.assert_close(b["state"][name], want, rtol=1e-6, atol=1e-7, msg=name)
    node1 = torch.load(per_node / "replicated_rank2.pt")  # the second node's owner
    assert any("lora" in n for n in node1)
    for name, t in node1.items():
        torch.testing.assert_close(t, b["state"][name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_main_job_on_two_nodes_with_an_owner_each_logs_the_one_owner_losses(tmp_path):
    """kt_ops.finetune --owners per-node, two torchrun commands of one rank each (each rank its
    node's owner, the two averaging their expert gradients), against the same 2 ranks with one
    owner: the same losses and the same adapter (fp32 noise)."""
    one_owner, per_node = tmp_path / "one_owner", tmp_path / "per_node"
    ok(torchrun(TINY + STEPS, one_owner, ranks=2))
    all_ok(two_node_commands([*TINY, *STEPS, "--owners", "per-node", "--save-steps", "4",
                              "--output-dir", str(per_node)], ranks_per_node=1, module=("-m", "kt_ops.finetune")))
    record = json.loads((per_node / "checkpoint-4" / "kt_checkpoint.json").read_text())
    assert record["world_size"] == 2 and record["expert_owners"] == [0, 1]  # really an owner per node
    (first_a, a), (first_b, b) = losses(one_owner), losses(per_node)
    assert first_a == first_b == 1 and len(a) == len(b) == 4
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)
    got, want = adapter(per_node), adapter(one_owner)
    assert got.keys() == want.keys() and got
    for name in want:  # AdamW turns reduction-order noise in tiny gradients into steps: by norm
        assert (got[name] - want[name]).norm() <= 1e-4 * want[name].norm(), name


def test_a_failure_on_the_second_nodes_owner_ends_both_nodes_fast(tmp_path):
    """Node 1's owner raises inside kt.moe at step 2: both torchrun commands end non-zero within
    FAULT_LIMIT_S (each runs under `timeout`, so a hang fails here), node 1 with the original
    message and node 0 with the same message from kt_ops' fault channel (or ended by torchrun)."""
    runs = two_node_commands([*TINY, *STEPS, "--owners", "per-node", "--output-dir", str(tmp_path / "out")],
                             ranks_per_node=1, module=("-m", "kt_ops.finetune"), fault="kt@1:2",
                             timeout=FAULT_LIMIT_S)
    message = "injected kt failure at step 2 on rank 1"
    for node, (proc, _, err) in enumerate(runs):
        assert proc.returncode not in (0, *TIMED_OUT), (node, proc.returncode, err[-4000:])
    assert f"RuntimeError: {message}" in runs[1][2], runs[1][2][-4000:]
    node0 = runs[0][2]
    assert f"kt_ops.faults.RemoteRankFailure: kt_ops: rank 1 failed: RuntimeError: {message}" in node0 \
        or "SIGTERM" in node0, node0[-4000:]
