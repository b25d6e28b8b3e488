"""KTMoE alone (one process) under torch.compile(fullgraph=True): no graph breaks, the kt
ops are in the compiled forward and backward graphs, results equal eager, and changing
sequence lengths do not recompile over and over."""
import pytest
import torch
from expecttest import assert_expected_inline
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import kt_ops
from graph_capture import GraphCapture
from tiny_moe_model import make_lora_trainable


def make_layer(train_base=False, lora_rank=4, swiglu_limit=None, activation="silu", swiglu_alpha=None):
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(32, 24, 6, 2, lora_rank=lora_rank, train_base=train_base, dtype=torch.float32,
                         swiglu_limit=swiglu_limit, activation=activation, swiglu_alpha=swiglu_alpha)
    make_lora_trainable(layer)
    return layer


def step(fn, layer, x):
    """Forward + backward; returns the output and the gradients of x and every parameter."""
    x = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    y = fn(x)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]


def assert_all_close(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_kt_ops_in_forward_and_backward_graphs():
    layer = make_layer()
    capture = GraphCapture()
    compiled = torch.compile(layer, backend=capture.backend, fullgraph=True)
    x = torch.randn(2, 5, 32)
    assert_all_close(step(compiled, layer, x), step(layer, layer, x))
    assert_expected_inline(GraphCapture.kt_calls(capture.forward_graphs), """kt.moe_forward.default""")
    assert_expected_inline(GraphCapture.kt_calls(capture.backward_graphs), """kt.moe_backward.default""")
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


@pytest.mark.parametrize("train_base,lora_rank", [(False, 4), (True, 0), (True, 4)],
                         ids=["lora", "full", "hybrid"])
def test_modes_aot_eager_match_eager(train_base, lora_rank):
    layer = make_layer(train_base, lora_rank)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(7, 32)
    assert_all_close(step(compiled, layer, x), step(layer, layer, x))


@pytest.mark.parametrize("activation,alpha", [("gelu_tanh", None), ("swigluoai", 1.702)], ids=["gelu_tanh", "swigluoai"])
def test_gating_arguments_reach_both_graphs(activation, alpha):
    """KTMoE(swiglu_limit=..., activation=..., swiglu_alpha=...) compiled: each is an argument of
    kt.moe_forward and of kt.moe_backward in the graphs, and forward and gradients equal eager
    with the clamp cutting."""
    gating = dict(activation=activation, swiglu_alpha=alpha)
    layer = make_layer(train_base=True, swiglu_limit=0.5, **gating)
    capture = GraphCapture()
    compiled = torch.compile(layer, backend=capture.backend, fullgraph=True)
    x = torch.randn(9, 32) * 4
    assert_all_close(step(compiled, layer, x), step(layer, layer, x))
    unclamped = make_layer(train_base=True, **gating)
    assert (layer(x) - unclamped(x)).abs().max() > 1e-3  # the clamp cut
    for graphs, op in ((capture.forward_graphs, "kt.moe_forward.default"), (capture.backward_graphs, "kt.moe_backward.default")):
        (node,) = [n for gm in graphs for n in gm.graph.nodes if str(n.target) == op]
        args = list(node.args) + list(node.kwargs.values())
        assert 0.5 in args and activation in args and (alpha is None or alpha in args), node.format_node()
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_inference_graph_saves_nothing():
    """Under no_grad the compiled forward asks kt.moe_forward to save no activations."""
    layer = make_layer()
    capture = GraphCapture()
    compiled = torch.compile(layer, backend=capture.backend, fullgraph=True)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x))
    (node,) = [n for gm in capture.forward_graphs for n in gm.graph.nodes if str(n.target) == "kt.moe_forward.default"]
    # save_activations is argument 13; FX omits trailing arguments left at their default (False).
    assert len(node.args) <= 13 or node.args[13] is False, node.format_node()
    assert node.kwargs.get("save_activations", False) is False


def test_changing_sequence_lengths_compile_at_most_twice():
    layer = make_layer()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for seq in (3, 8, 5, 17, 11):
        x = torch.randn(2, seq, 32)
        assert_all_close(step(compiled, layer, x), step(layer, layer, x))
    assert counter.frame_count <= 2, counter.frame_count


def test_inductor_forward_backward_match_eager_and_call_kt_ops():
    layer = make_layer()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    x = torch.randn(2, 6, 32)
    want = step(layer, layer, x)
    got, code = run_and_get_code(lambda: step(compiled, layer, x))
    assert_all_close(got, want)
    all_code = "\n".join(code)
    assert "torch.ops.kt.moe_forward.default" in all_code
    assert "torch.ops.kt.moe_backward.default" in all_code
