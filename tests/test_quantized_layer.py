"""KTMoE and patch_model with quantized frozen experts (expert_format = fp8 / int8 / int4 / mxfp4 / nvfp4):
the layer against the float64 reference on its dequantized experts, the bytes the experts
hold, construction on the meta device, dtype moves, state dicts, the refusals, and a
patched tiny transformers model: logits of the unpatched model holding the dequantized
experts, LoRA training that leaves the base bytes untouched, PEFT adapters."""
import copy

import pytest
import torch

import kt_ops
from kt_ops import KTMoE, quantization
from kt_ops.reference import moe_reference

f32, bf16 = torch.float32, torch.bfloat16
FORMATS = [("fp8", None), ("int8", None), ("int4", 32), ("int4", 128), ("mxfp4", None), ("nvfp4", None)]
FORMAT_IDS = ["fp8", "int8", "int4-g32", "int4-g128", "mxfp4", "nvfp4"]
LORA = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def quantized_layer(fmt, group, dtype, *, H=256, I=128, E=6, K=2, r=4, seed=0):
    torch.manual_seed(seed)
    layer = KTMoE(H, I, E, K, lora_rank=r, dtype=dtype, expert_format=fmt, group_size=group)
    with torch.no_grad():
        for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
            getattr(layer, name).normal_(0, 0.05)  # live LoRA
    return layer


@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [8, 40], ids=["decode-sized", "gemm-sized"])
def test_layer_matches_float64_on_its_dequantized_experts(fmt, group, dtype, T):
    layer = quantized_layer(fmt, group, dtype)
    x = torch.randn(T, 256, dtype=dtype, requires_grad=True)
    weights, ids = layer.gate(x.detach())  # the router's own gradient is not the experts' business
    weights = weights.detach().requires_grad_(True)
    out = layer.routed_experts(x, ids, weights)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    lora64 = [getattr(layer, n).detach().double().requires_grad_() for n in LORA]
    ref = moe_reference(x64, ids, w64, *(w.double() for w in layer.dequantized_experts()), *lora64,
                        layer.lora_scale)
    ref.backward(grad_out.double())
    tol = 1e-5 if dtype == f32 else 1e-2
    assert rel_err(out, ref) < tol
    assert rel_err(x.grad, x64.grad) < tol
    assert rel_err(weights.grad, w64.grad) < tol
    for name, ref_param in zip(LORA, lora64):
        assert rel_err(getattr(layer, name).grad, ref_param.grad) < tol, name
    for name in ("gate_proj", "up_proj", "down_proj", "gate_scale", "up_scale", "down_scale"):
        assert not getattr(layer, name).requires_grad and getattr(layer, name).grad is None
    for g in layer.expert_global_scales():  # nvfp4's
        assert g is None or (not g.requires_grad and g.grad is None)


@pytest.mark.parametrize("fmt,group,max_ratio", [("fp8", None, 0.52), ("int8", None, 0.52), ("int4", 32, 0.30),
                                                 ("int4", 128, 0.30), ("mxfp4", None, 0.27), ("nvfp4", None, 0.29)],
                         ids=FORMAT_IDS)
def test_expert_bytes_against_bf16(fmt, group, max_ratio):
    """Scales included; at the Qwen3-30B-A3B expert shape (H=2048, I=768), 2 experts."""
    bf16_layer = KTMoE(2048, 768, 2, 1, dtype=bf16)
    layer = KTMoE(2048, 768, 2, 1, dtype=bf16, expert_format=fmt, group_size=group)
    assert bf16_layer.expert_nbytes() == 3 * 2 * 768 * 2048 * 2
    ratio = layer.expert_nbytes() / bf16_layer.expert_nbytes()
    assert ratio <= max_ratio, ratio
    assert layer.expert_nbytes() == sum(getattr(layer, n).nbytes for n in
                                        ("gate_proj", "up_proj", "down_proj", "gate_scale", "up_scale", "down_scale",
                                         *(("gate_global_scale", "up_global_scale", "down_global_scale")
                                           if fmt == "nvfp4" else ())))


def test_dequantized_experts_are_the_quantized_values():
    layer = quantized_layer("int8", None, f32)
    gate, up, down = layer.dequantized_experts()
    assert gate.shape == (6, 128, 256) and down.shape == (6, 256, 128) and gate.dtype == f32
    torch.testing.assert_close(up, layer.up_proj.float() * layer.up_scale[:, :, None], rtol=0, atol=0)


def test_layer_refusals():
    with pytest.raises(ValueError, match="train_base=True cannot train quantized experts \\(expert_format='fp8'\\)"):
        KTMoE(128, 64, 4, 2, train_base=True, expert_format="fp8")
    with pytest.raises(ValueError, match="group_size is for expert_format='int4' only"):
        KTMoE(128, 64, 4, 2, expert_format="int8", group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        KTMoE(128, 64, 4, 2, expert_format="int4", group_size=16)
    with pytest.raises(ValueError, match=r"KTMoE: int4 groups of 64 must divide hidden size 128 and intermediate size 96"):
        KTMoE(128, 96, 4, 2, expert_format="int4", group_size=64)


def test_meta_device_construction_has_the_quantized_layout():
    with torch.device("meta"):
        layer = KTMoE(256, 128, 4, 2, lora_rank=2, dtype=bf16, expert_format="int4", group_size=64)
    assert layer.gate_proj.device.type == "meta"
    assert layer.gate_proj.shape == (4, 128, 128) and layer.gate_proj.dtype == torch.uint8
    assert layer.gate_scale.shape == (4, 128, 4) and layer.gate_scale.dtype == bf16
    assert layer.down_proj.shape == (4, 256, 64) and layer.down_scale.shape == (4, 256, 2)
    assert layer.gate_lora_a.dtype == bf16
    # Fake tensors trace through the meta kernel of the quantized op.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = layer(torch.empty(5, 256, dtype=bf16, device="meta"))
    assert out.shape == (5, 256) and out.dtype == bf16


@pytest.mark.parametrize("fmt,scale_dtype", [("mxfp4", torch.float8_e8m0fnu), ("nvfp4", torch.float8_e4m3fn)])
def test_meta_device_construction_of_fp4_experts(fmt, scale_dtype):
    with torch.device("meta"):
        layer = KTMoE(256, 128, 4, 2, lora_rank=2, dtype=bf16, expert_format=fmt)
    group = quantization.FP4_GROUP[fmt]
    assert layer.gate_proj.shape == (4, 128, 128) and layer.gate_proj.dtype == torch.uint8
    assert layer.gate_scale.shape == (4, 128, 256 // group) and layer.gate_scale.dtype == scale_dtype
    assert layer.down_scale.shape == (4, 256, 128 // group)
    globals_ = [getattr(layer, n, None) for n in ("gate_global_scale", "up_global_scale", "down_global_scale")]
    assert all(g is not None and g.shape == (4,) and g.dtype == f32 for g in globals_) == (fmt == "nvfp4")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = layer(torch.empty(5, 256, dtype=bf16, device="meta"))
    assert out.shape == (5, 256) and out.dtype == bf16


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_dtype_moves_and_state_dict_keep_the_storage(fmt):
    layer = quantized_layer(fmt, None, f32)
    x = torch.randn(10, 256)
    ref = layer(x)
    layer.bfloat16()
    assert layer.gate_proj.dtype == torch.uint8 and layer.gate_scale.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn)
    if fmt == "nvfp4":
        assert layer.gate_global_scale.dtype == f32
    assert rel_err(layer(x.bfloat16()), ref) < 2e-2
    layer.float()
    state = layer.state_dict()
    fresh = quantized_layer(fmt, None, f32, seed=1)
    assert not torch.equal(fresh.gate_scale.view(torch.uint8), layer.gate_scale.view(torch.uint8))
    fresh.load_state_dict(state)
    assert rel_err(fresh(x), layer(x)) == 0


def test_dtype_moves_keep_the_quantized_storage():
    layer = quantized_layer("fp8", None, f32)
    x = torch.randn(10, 256)
    ref = layer(x)
    layer.bfloat16()
    assert layer.gate_proj.dtype == torch.float8_e4m3fn and layer.gate_scale.dtype == f32
    assert layer.gate_lora_a.dtype == bf16 and layer.expert_dtype == bf16
    out = layer(x.bfloat16())
    assert out.dtype == bf16 and rel_err(out, ref) < 2e-2
    layer.float()
    assert layer.expert_dtype == f32 and layer.gate_proj.dtype == torch.float8_e4m3fn


def test_state_dict_round_trip():
    layer = quantized_layer("int4", 32, f32, seed=1)
    fresh = quantized_layer("int4", 32, f32, seed=2)
    x = torch.randn(7, 256)
    assert rel_err(fresh(x), layer(x)) > 1e-3
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


# ---- patch_model on a tiny transformers model ---------------------------------------------------

transformers = pytest.importorskip("transformers")
VOCAB = 96


def tiny_qwen3_moe(dtype, *, moe_last_only=False, seed=0):
    """H = 128, expert I = 64 (int4 groups of 32 and 64 fit), 8 experts, top-2."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[0] if moe_last_only else [], initializer_range=0.15,
        max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype).eval()


def dequantized_reference(model, patched):
    """The unpatched model with each experts module holding the patched one's dequantized
    weights (in the model's dtype)."""
    ref = copy.deepcopy(model)
    from kt_ops.hf.patch import patched_experts
    for name, kt in patched_experts(patched):
        experts = ref.get_submodule(name)
        gate, up, down = kt.dequantized_experts()
        with torch.no_grad():
            experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            experts.down_proj.copy_(down)
    return ref


def input_ids(seed=0):
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt,group", [("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("mxfp4", None),
                                       ("nvfp4", None)],
                         ids=["fp8", "int8", "int4-g32", "int4-g64", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["fp32", "bf16"])
def test_patched_model_gives_the_logits_of_the_dequantized_model(fmt, group, dtype):
    model = tiny_qwen3_moe(dtype, moe_last_only=dtype == bf16)  # bf16: see test_hf_patching's docstring
    patched = kt_ops.patch_model(copy.deepcopy(model), expert_format=fmt, group_size=group)
    ref = dequantized_reference(model, patched)
    with torch.no_grad():
        out, want, float_logits = (m(input_ids=input_ids()).logits for m in (patched, ref, model))
    assert rel_err(out, want) <= (1e-5 if dtype == f32 else 1e-2)
    assert rel_err(out, float_logits) > 0  # the weights really were quantized


def test_patched_model_trains_its_lora_and_keeps_its_base_bytes(tmp_path):
    model = kt_ops.patch_model(tiny_qwen3_moe(f32), lora_rank=4, lora_alpha=8, expert_format="int4")
    from kt_ops.hf.patch import patched_experts
    experts = [kt for _, kt in patched_experts(model)]
    base = [(kt.gate_proj.clone(), kt.down_scale.clone()) for kt in experts]
    nbytes = [kt.expert_nbytes() for kt in experts]
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = [p for kt in experts for n, p in kt.named_parameters() if "lora" in n]
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = input_ids(3)
    losses = []
    model.train()
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for kt, (gate, down_scale), n in zip(experts, base, nbytes):
        assert torch.equal(kt.gate_proj, gate) and torch.equal(kt.down_scale, down_scale) and kt.expert_nbytes() == n

    # The adapter saves and loads into a freshly patched quantized model: same logits.
    model.eval()
    kt_ops.save_adapter(model, str(tmp_path))
    fresh = kt_ops.patch_model(tiny_qwen3_moe(f32), lora_rank=4, lora_alpha=8, expert_format="int4")
    kt_ops.load_adapter(fresh, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_patch_model_refusals():
    with pytest.raises(ValueError, match="patch_model: train_base=True cannot train quantized experts"):
        kt_ops.patch_model(tiny_qwen3_moe(f32), train_base=True, expert_format="int8")
    with pytest.raises(ValueError, match="int4 groups of 128 must divide hidden size 128 and intermediate size 64"):
        kt_ops.patch_model(tiny_qwen3_moe(f32), expert_format="int4", group_size=128)
    with pytest.raises(ValueError, match="expert_format must be None or one of"):
        kt_ops.patch_model(tiny_qwen3_moe(f32), expert_format="nf4")
