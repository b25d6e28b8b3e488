"""kt.linear under torch.compile(fullgraph=True): a bf16 block of KTLinear layers compiles without
a graph break, its forward graph holds one kt.linear per layer and its backward graph their
gradient ops, and loss and gradients equal eager."""
import copy

import torch
from torch import nn

import kt_ops  # noqa: F401
from graph_capture import GraphCapture
from kt_ops.linear import use_kt_linear


def test_kt_linear_block_compiles_without_graph_break():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 32, bias=False)).to(torch.bfloat16)
    use_kt_linear(block)
    compiled_block = copy.deepcopy(block)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    capture = GraphCapture()
    compiled = torch.compile(compiled_block, fullgraph=True, backend=capture.backend)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    eager_loss = block(xs[0]).float().square().sum()
    eager_loss.backward()
    loss = compiled(xs[1]).float().square().sum()
    loss.backward()
    assert GraphCapture.kt_calls(capture.forward_graphs) == "kt.linear.default\nkt.linear.default"
    backward = GraphCapture.kt_calls(capture.backward_graphs).splitlines()
    assert sorted(backward) == ["kt.linear_input_grad.default"] * 2 + ["kt.linear_weight_grad.default"] * 2
    assert torch.equal(loss, eager_loss)
    assert torch.equal(xs[1].grad, xs[0].grad)
    for p, q in zip(compiled_block.parameters(), block.parameters()):
        assert torch.equal(p.grad, q.grad)
