"""Patched transformers models under torch.compile(fullgraph=True) (backend aot_eager).

* GLM-4-MoE, OLMoE and ERNIE-4.5-MoE (covered through the generic experts path only) with
  HF gradient checkpointing and the kt policy: no graph break, same loss and gradients as
  eager, the CPU experts once per MoE layer per step.

* DeepSeek-V3 (the most involved router: sigmoid, correction bias, grouped top-k,
  scaling; shared experts) with expert LoRA: forward + backward compile without a graph
  break, the forward graph holds one kt.moe_forward per MoE layer and the backward graph one
  kt.moe_backward per layer, and loss and gradients equal eager.
* Qwen2-MoE (gated shared expert) with HF gradient checkpointing and
  kt_ops.checkpoint_context_fn, compiled: gradients equal eager without checkpointing and the
  CPU experts run once per MoE layer per step.

``use_cache=False`` is passed in training: with checkpointing enabled, transformers itself
logs a warning about use_cache (a logger call, which is a graph break under fullgraph).
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import kt_ops  # noqa: E402
from kt_ops import _kernels  # noqa: E402
from kt_ops.hf.patch import patched_blocks  # noqa: E402
from graph_capture import GraphCapture  # noqa: E402
from moe_testing import randomize_lora  # noqa: E402
from test_hf_patching import input_ids, rel_err, tiny_model  # noqa: E402


def lora_model(arch):
    return with_lora(tiny_model(arch))


def with_lora(model):
    """``model`` patched with rank-4 expert LoRA whose B factors are random (not PEFT's zeros),
    in training mode."""
    model = kt_ops.patch_model(model, lora_rank=4, lora_alpha=8).train()
    randomize_lora(model, lambda name: name.endswith("lora_b"), seed=3)
    return model


def step(model, fn, ids):
    model.zero_grad(set_to_none=True)
    _kernels.calls.clear()
    loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, dict(_kernels.calls)


def assert_same(got, want, tol=1e-5):
    assert rel_err(got[0], want[0]) <= tol
    assert got[1].keys() == want[1].keys()
    assert any("lora" in n for n in want[1]) and any(n.endswith("mlp.gate.weight") for n in want[1])
    for name, g in want[1].items():
        assert rel_err(got[1][name], g) <= tol, name


def test_deepseek_v3_fullgraph_forward_backward():
    model = lora_model("deepseek_v3")
    ids = input_ids()
    eager = step(model, model, ids)
    capture = GraphCapture()
    compiled = torch.compile(model, backend=capture.backend, fullgraph=True)
    got = step(model, compiled, ids)
    assert_same(got, eager)
    n_moe = len(patched_blocks(model))
    assert GraphCapture.kt_calls(capture.forward_graphs).split() == ["kt.moe_forward.default"] * n_moe
    assert GraphCapture.kt_calls(capture.backward_graphs).split() == ["kt.moe_backward.default"] * n_moe
    assert got[2] == {"moe_forward": n_moe, "moe_backward": n_moe}
    again = step(model, compiled, input_ids(1, seq=9))  # another length: a dynamic-shape recompile
    assert_same(again, step(model, model, input_ids(1, seq=9)))
    assert again[2] == {"moe_forward": n_moe, "moe_backward": n_moe}
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_qwen2_moe_compiled_with_gradient_checkpointing():
    model = lora_model("qwen2_moe")
    ids = input_ids()
    eager = step(model, model, ids)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    compiled = torch.compile(checkpointed, backend="aot_eager", fullgraph=True)
    n_moe = len(patched_blocks(model))
    for _ in range(2):
        got = step(checkpointed, compiled, ids)
        assert_same(got, eager)
        assert got[2] == {"moe_forward": n_moe, "moe_backward": n_moe}
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


@pytest.mark.parametrize("name", ["glm4_moe", "olmoe", "ernie4_5_moe"])
def test_new_families_compiled_with_kt_checkpointing(name):
    """Families covered only through the generic experts path (tests/hf_families.py builds
    them from their own configs): fullgraph with HF gradient checkpointing and the kt policy;
    loss and gradients equal eager, the CPU experts run once per MoE layer per step."""
    from hf_families import discover
    from hf_families import tiny_model as family_model

    family = next(f for f in discover() if f.name == name)
    model = with_lora(family_model(family))
    ids = input_ids()
    eager = step(model, model, ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    n_moe = len(patched_blocks(model))
    got = step(model, compiled, ids)
    assert rel_err(got[0], eager[0]) <= 1e-5
    assert got[1].keys() == eager[1].keys() and any("lora" in n for n in eager[1])
    for pname, grad in eager[1].items():
        assert rel_err(got[1][pname], grad) <= 1e-5, pname
    assert got[2] == {"moe_forward": n_moe, "moe_backward": n_moe}
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_kt_experts_implementation_compiles_fullgraph():
    """``set_experts_implementation("kt")`` (the unchanged experts modules on kt.moe) under
    torch.compile(fullgraph=True): the gating check (kt_ops.hf.experts) traces, its probe of a
    family's own ``_apply_gate`` having run eagerly, and the logits equal eager."""
    kt_ops.hf.register_kt_experts()
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("kt")
    ids = input_ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids).logits
    assert rel_err(out, ref) <= 1e-6
