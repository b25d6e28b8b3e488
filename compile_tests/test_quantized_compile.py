"""Quantized experts (fp8 / int8 / int4) under torch.compile(fullgraph=True): the layer with
the kt checkpoint policy (the quantized kt.moe_forward / moe_backward in the graphs, no graph
break, equal to eager, the CPU experts once per step), inductor on fp8, and a patched
transformers model with int4 experts and HF gradient checkpointing."""
import pytest
import torch
from expecttest import assert_expected_inline
from torch._inductor.utils import run_and_get_code

import kt_ops
from kt_ops import _kernels
from graph_capture import GraphCapture


class Block(torch.nn.Module):
    """norm -> checkpointed (linear -> KT experts with LoRA) -> residual."""

    def __init__(self, expert_format, group_size=None):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(64)
        self.proj = torch.nn.Linear(64, 64)
        self.moe = kt_ops.KTMoE(64, 32, 6, 2, lora_rank=4, dtype=torch.float32, expert_format=expert_format,
                                group_size=group_size)
        with torch.no_grad():
            for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
                getattr(self.moe, name).normal_(0, 0.1)

    def forward(self, x):
        return x + kt_ops.checkpoint(lambda h: self.moe(self.proj(h)), self.norm(x))


def step(block, fn, x):
    block.zero_grad(set_to_none=True)
    _kernels.calls.clear()
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, dict(_kernels.calls)


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys() and any("lora" in n for n in want[2])
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert not any(n.endswith(("_proj", "_scale")) for n in got[2])  # the quantized base (global scales too) is frozen


@pytest.mark.parametrize("expert_format,group_size", [("fp8", None), ("int8", None), ("int4", 32), ("mxfp4", None),
                                                     ("nvfp4", None)],
                         ids=["fp8", "int8", "int4", "mxfp4", "nvfp4"])
def test_checkpointed_layer_compiles_without_graph_breaks(expert_format, group_size):
    block = Block(expert_format, group_size)
    x = torch.randn(2, 9, 64)
    eager = step(block, block, x)
    capture = GraphCapture()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, backend=capture.backend, fullgraph=True)
    got = step(block, compiled, x)
    assert_same(got, eager)
    assert got[3] == {"moe_forward": 1, "moe_backward": 1}  # the policy saved the experts' outputs
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert_expected_inline(GraphCapture.kt_calls(capture.forward_graphs), """kt.moe_forward.default""")
    assert_expected_inline(GraphCapture.kt_calls(capture.backward_graphs), """kt.moe_backward.default""")
    (node,) = [n for gm in capture.forward_graphs for n in gm.graph.nodes if str(n.target) == "kt.moe_forward.default"]
    assert node.kwargs.get("gate_scale") is not None or len(node.args) > 14  # the scales reach the op


def test_inductor_on_fp8_experts():
    block = Block("fp8")
    x = torch.randn(3, 5, 64)
    eager = step(block, block, x)
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    got, code = run_and_get_code(lambda: step(block, compiled, x))
    assert_same(got, eager)
    all_code = "\n".join(code)
    assert "torch.ops.kt.moe_forward.default" in all_code and "torch.ops.kt.moe_backward.default" in all_code


def test_patched_model_with_int4_experts_compiles_with_hf_checkpointing():
    pytest.importorskip("transformers")
    from test_hf_compile import step as model_step
    from test_hf_patching import rel_err
    from test_quantized_layer import input_ids, tiny_qwen3_moe
    from kt_ops.hf.patch import patched_blocks

    model = kt_ops.patch_model(tiny_qwen3_moe(torch.float32), lora_rank=4, lora_alpha=8, expert_format="int4").train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.2)
    ids = input_ids(4)
    eager = model_step(model, model, ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = model_step(model, compiled, ids)
    n_moe = len(patched_blocks(model))
    assert rel_err(got[0], eager[0]) <= 1e-5
    assert got[1].keys() == eager[1].keys() and any("lora" in n for n in eager[1])
    for name, grad in eager[1].items():
        assert rel_err(got[1][name], grad) <= 1e-5, name
    assert got[2] == {"moe_forward": n_moe, "moe_backward": n_moe}
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
