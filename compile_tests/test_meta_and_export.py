"""Lazy construction on the meta device and torch.export of the layer."""
import torch

import kt_ops
from tiny_moe_model import TinyMoELM


def test_layer_on_meta_device_runs_shape_only_forward():
    with torch.device("meta"):
        layer = kt_ops.KTMoE(2048, 768, 128, 8, lora_rank=8)  # Qwen3-30B-A3B-sized, no memory
        x = torch.randn(3, 5, 2048, dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in layer.parameters())
    y = layer(x)
    assert y.shape == (3, 5, 2048) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_model_on_meta_device_forward_and_backward():
    with torch.device("meta"):
        model = TinyMoELM(layers=2)
        tokens = torch.zeros(2, 7, dtype=torch.long)
    logits = model(tokens)
    assert logits.shape == (2, 7, 64) and logits.device.type == "meta"
    logits.sum().backward()
    lora = model.blocks[0].moe.gate_lora_a
    assert lora.grad is not None and lora.grad.shape == lora.shape and lora.grad.device.type == "meta"


def test_export_inference_graph_contains_kt_op():
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(32, 24, 6, 2, lora_rank=4, dtype=torch.float32).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        program = torch.export.export(layer, (x,))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        # export's default (training) IR keeps the public op itself
        assert "kt.moe.default" in targets, targets
        torch.testing.assert_close(program.module()(x), layer(x))
