"""PEFT's adapter switches on a patched model under torch.compile(fullgraph=True) and the kt
checkpoint policy (kt_ops.hf.peft_experts).

* Compiled, each switch state (adapter on, ``disable_adapter()``, a second named adapter)
  gives eager's logits, fp32 within 1e-5, and compiles at most one graph per state: the
  state is read in the forward (a guard), not baked into one graph.
* DPO's pattern: the policy's forward with activation checkpointing (the kt policy), the
  reference's forward under ``disable_adapter()`` and no_grad, then the policy's backward:
  the gradients equal those of a step without the reference pass in between, eager and
  compiled (the recomputation in backward sees the adapter on again).
"""
import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
from moe_testing import randomize_lora, rel_err  # noqa: E402

R, ALPHA = 4, 8


def _adapter(base, folder, seed):
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    randomize_lora(model, lambda name: "lora_B" in name, seed=seed, scale=0.3)
    model.save_pretrained(folder)


@pytest.fixture
def patched(tmp_path):
    base = samples.tiny_qwen3_moe()
    _adapter(base, tmp_path / "first", seed=1)
    _adapter(base, tmp_path / "second", seed=2)
    model = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                str(tmp_path / "first"))
    model.load_adapter(str(tmp_path / "second"), adapter_name="second")
    return base, model


def test_each_switch_state_compiles_once_and_equals_eager(patched):
    from torch._dynamo.testing import CompileCounter

    base, model = patched
    ids = samples.input_ids()
    # One round of switches first: PEFT's first disable / set_adapter settles flags that the
    # graphs guard on (seen as one extra graph for the first state otherwise).
    with model.disable_adapter():
        model.set_adapter("second")
        model.set_adapter("default")
    counter = CompileCounter()
    compiled = torch.compile(model.get_base_model(), backend=counter, fullgraph=True)

    def both():
        with torch.no_grad():
            return compiled(input_ids=ids).logits, model(input_ids=ids).logits

    results, graphs = {}, []
    for _ in range(2):  # each state twice: the second visit must reuse its graph
        results["on"] = both()
        graphs.append(counter.frame_count)
        with model.disable_adapter():
            results["off"] = both()
        graphs.append(counter.frame_count)
        model.set_adapter("second")
        results["second"] = both()
        graphs.append(counter.frame_count)
        model.set_adapter("default")
    for state, (got, want) in results.items():
        assert rel_err(got, want) <= 1e-5, state
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    assert rel_err(results["off"][0], base_logits) <= 1e-5
    assert rel_err(results["on"][0], base_logits) > 1e-2 and rel_err(results["second"][0], results["on"][0]) > 1e-2
    assert graphs == [1, 2, 3, 3, 3, 3], graphs  # one graph per state, reused on the second visit
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def _dpo_like_step(model, fn, ids, reference_between: bool):
    """Policy forward (checkpointed), optionally a reference forward with the adapter
    disabled, then the policy's backward; the expert and attention LoRA gradients."""
    model.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
    if reference_between:
        with model.disable_adapter(), torch.no_grad():
            fn(input_ids=ids, use_cache=False)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_reference_pass_between_forward_and_backward(patched, compiled):
    _, model = patched
    model.train()
    model.get_base_model().activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    # transformers makes the embeddings' output require grad for a PEFT model (a requires_grad_
    # hook, which torch.compile refuses); non-reentrant checkpointing needs no such input.
    model.get_base_model().disable_input_require_grads()
    ids = samples.input_ids()
    fn = torch.compile(model.get_base_model(), backend="aot_eager", fullgraph=True) if compiled \
        else model.get_base_model()
    want = _dpo_like_step(model, model.get_base_model(), ids, reference_between=False)
    got = _dpo_like_step(model, fn, ids, reference_between=True)
    assert any(".experts.adapters.lora.default." in n for n in want) and any("q_proj.lora_A" in n for n in want)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert rel_err(got[name], g) <= 1e-5, name
