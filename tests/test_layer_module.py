"""KTMoE as an nn.Module: moving it moves the router, never the experts; dtype changes apply."""
import torch

import kt_ops


def test_to_device_keeps_experts_on_cpu_and_moves_router():
    layer = kt_ops.KTMoE(16, 8, 4, 2, lora_rank=2, dtype=torch.float32)
    layer.to("meta")  # any device: the router follows, the experts stay in CPU memory
    assert layer.gate.weight.device.type == "meta"
    experts = [p for n, p in layer.named_parameters() if not n.startswith("gate.")
               and n not in ("grad_anchor", "expert_grad_norm")]
    assert len(experts) == 9 and all(p.device.type == "cpu" for p in experts)
    assert layer.grad_anchor.device.type == "meta"  # the 0-element grad anchor moves like the router


def test_dtype_change_applies_to_experts_and_keeps_results():
    torch.manual_seed(0)
    layer = kt_ops.KTMoE(16, 8, 4, 2, lora_rank=2, dtype=torch.float32)
    x = torch.randn(5, 16)
    want = layer(x).double()
    layer.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    torch.testing.assert_close(layer(x.double()), want, rtol=1e-5, atol=1e-6)
