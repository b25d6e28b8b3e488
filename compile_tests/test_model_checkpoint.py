"""A whole MoE language model (embedding, RMSNorm, attention, KT MoE blocks, LM head) under
torch.compile(fullgraph=True), with and without activation checkpointing.

With kt_ops' checkpoint policy the CPU experts run exactly once per layer per step
(counted outside the compiled code, at the kernel) and the gradients equal the run without
checkpointing; plain checkpointing re-runs them (allowed in one process, where there is no
collective to replay)."""
import pytest
import torch

from kt_ops import _kernels
from tiny_moe_model import TinyMoELM, make_lora_trainable

LAYERS = 2


def train_step(checkpointing, backend, seed=0):
    """One forward + backward; returns (loss, grads by name, kt kernel calls)."""
    torch.manual_seed(seed)
    model = TinyMoELM(layers=LAYERS, checkpointing=checkpointing)
    make_lora_trainable(model)
    loss_fn = model.loss if backend == "eager" else torch.compile(model.loss, backend=backend, fullgraph=True)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(seed + 1))
    _kernels.calls.clear()
    loss = loss_fn(tokens)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, dict(_kernels.calls)


@pytest.fixture(scope="module")
def reference():
    return train_step(None, "eager")


def assert_same_training_step(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert got[1][name] is not None, name
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("checkpointing", [None, "kt", "plain"])
def test_experts_run_once_per_layer_with_kt_policy(reference, checkpointing, backend):
    got = train_step(checkpointing, backend)
    assert_same_training_step(got, reference)
    forward_runs = got[2]["moe_forward"]
    assert forward_runs == (2 * LAYERS if checkpointing == "plain" else LAYERS), got[2]
    assert got[2]["moe_backward"] == LAYERS
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_inductor_with_kt_policy(reference):
    got = train_step("kt", "inductor")
    assert_same_training_step(got, reference)
    assert got[2] == {"moe_forward": LAYERS, "moe_backward": LAYERS}
