"""A non-owner rank of a distributed KTMoE allocates no expert memory.

In a fresh process with RANK=1, WORLD_SIZE=2 (no process group: KTMoE discovers its rank
from the environment, as when a model is built before init_process_group), a Qwen3-30B-A3B
shaped layer KTMoE(2048, 768, E, 8) holds only the router's E*2048 parameters, for E = 8 and
E = 256: nothing grows with the experts. The owner's experts at E = 256 would be
3*256*768*2048 bf16 values = 2.25 GiB; the peak RSS growth of building the layer is printed
and bounded far below that (not a tight bound: allocator noise must not fail the test).
"""
import json
import os
import subprocess
import sys

import pytest

H, I, TOP_K = 2048, 768, 8

_SCRIPT = r"""
import json, sys
import torch
import kt_ops
from kt_ops.layer import KTMoE

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB -> bytes

H, I, E, K = (int(a) for a in sys.argv[1:5])
before_rss, before_peak = status("VmRSS"), status("VmHWM")
layer = KTMoE(H, I, E, K)
after_rss, after_peak = status("VmRSS"), status("VmHWM")
print(json.dumps(dict(
    rank=layer.rank, world_size=layer.world_size, is_owner=layer.is_owner,
    params={n: list(p.shape) for n, p in layer.named_parameters()},
    numel=sum(p.numel() for p in layer.parameters()),
    buffers=sum(b.numel() for b in layer.buffers()),
    rss_delta=after_rss - before_rss, peak_delta=after_peak - before_peak,
    peak_before=before_peak)))
"""


def _build_in_subprocess(num_experts):
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", OMP_NUM_THREADS="1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(H), str(I), str(num_experts), str(TOP_K)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("num_experts", [8, 256])
def test_non_owner_holds_only_the_router(num_experts):
    res = _build_in_subprocess(num_experts)
    expert_bytes = 3 * num_experts * I * H * 2  # bf16 gate/up/down of the owner
    mib = 1 << 20
    print(f"\nnon-owner KTMoE({H}, {I}, {num_experts}, {TOP_K}): {res['numel']} parameters, "
          f"RSS +{res['rss_delta'] / mib:.2f} MiB, peak RSS +{res['peak_delta'] / mib:.2f} MiB "
          f"(after import: {res['peak_before'] / mib:.0f} MiB; the owner's experts: {expert_bytes / mib:.0f} MiB)")
    assert (res["rank"], res["world_size"], res["is_owner"]) == (1, 2, False)
    assert res["params"] == {"gate.weight": [num_experts, H], "grad_anchor": [0], "expert_grad_norm": [1]}
    assert res["numel"] == num_experts * H + 1 and res["buffers"] == 0
    assert res["peak_delta"] < 64 * mib  # the owner would add 72 MiB (E=8) / 2304 MiB (E=256)
