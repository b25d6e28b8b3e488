"""kt.linear (csrc/ops/linear.cpp, kt_ops/linear.py): nn.Linear's GEMMs on kt's base-GEMM paths, so
that bf16 layers outside the experts run at float32 speed on CPUs without AVX512-BF16.

* the op and its gradients against float64 on fresh random inputs, every dtype and every path this
  CPU runs; gradcheck in float64; opcheck of the three ops;
* bad input refused by name;
* KTLinear / use_kt_linear: only plain nn.Linear swapped, state dict unchanged, float32 inputs take
  F.linear exactly;
* patch_model(kt_linear=...): a bf16 Qwen3-MoE's linears routed through kt.linear, logits and a
  PEFT LoRA step against the unpatched model's float64 twin; the default follows the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kt_ops
from kt_ops.cpu_isa import ISAS, supported_cpu_isas
from kt_ops.linear import KTLinear, bf16_gemms_are_slow, linear, use_kt_linear
from test_hf_patching import rel_err, tiny_model

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
TOL = {f64: 1e-12, f32: 1e-5, bf16: 1.5e-2}


def isa_param(isa):
    marks = [] if isa in supported_cpu_isas() else [pytest.mark.skip(reason=f"this CPU cannot run {isa}")]
    return pytest.param(isa, marks=marks, id=isa)


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64).to(dtype)


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("dtype", [bf16, f32, f64], ids=str)
# 1 and 5 rows: the forward takes ATen's GEMM (decode-sized); 27 and 40 rows: kt's base GEMM.
@pytest.mark.parametrize("shape,with_bias", [((1, 64), True), ((5, 96), False), ((3, 9, 130), False),
                                             ((40, 64), True)])
def test_linear_and_its_gradients_match_float64(isa, dtype, shape, with_bias):
    seed = hash((isa, str(dtype), shape, with_bias)) % 2**31
    out_features, in_features = 48, shape[-1]
    x = rand(*shape, dtype=dtype, seed=seed).requires_grad_(True)
    w = rand(out_features, in_features, dtype=dtype, seed=seed + 1).mul_(in_features ** -0.5).requires_grad_(True)
    b = rand(out_features, dtype=dtype, seed=seed + 2).requires_grad_(True) if with_bias else None
    dy = rand(*shape[:-1], out_features, dtype=dtype, seed=seed + 3)
    with kt_ops.use_cpu_isa(isa):
        y = linear(x, w, b)
        y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if with_bias else None
    ref = F.linear(x64, w64, b64)
    ref.backward(dy.double())
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= TOL[dtype]
    assert rel_err(x.grad, x64.grad) <= TOL[dtype]
    assert rel_err(w.grad, w64.grad) <= TOL[dtype]
    if with_bias:
        assert rel_err(b.grad, b64.grad) <= TOL[dtype]


def test_gradcheck_float64():
    x = rand(3, 4, 20, dtype=f64, seed=0).requires_grad_(True)
    w = rand(12, 20, dtype=f64, seed=1).requires_grad_(True)
    b = rand(12, dtype=f64, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(linear, (x, w, b))
    assert torch.autograd.gradcheck(linear, (x, w, None))


@pytest.mark.parametrize("dtype", [bf16, f32], ids=str)
def test_opcheck(dtype):
    x = rand(4, 7, 64, dtype=dtype, seed=3).requires_grad_(True)
    w = rand(32, 64, dtype=dtype, seed=4).requires_grad_(True)
    b = rand(32, dtype=dtype, seed=5).requires_grad_(True)
    g = rand(4, 7, 32, dtype=dtype, seed=6)
    torch.library.opcheck(torch.ops.kt.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.kt.linear.default, (x, w, None))
    torch.library.opcheck(torch.ops.kt.linear_input_grad.default, (g, w.detach()))
    torch.library.opcheck(torch.ops.kt.linear_weight_grad.default, (g, x.detach()))


@pytest.mark.parametrize("args,match", [
    (lambda: (torch.randn(3, 8), torch.randn(4, 9)), r"x's last dim \(8\) must equal weight's in features \(9\)"),
    (lambda: (torch.randn(3, 8), torch.randn(4, 8, dtype=bf16)), "x and weight must have one floating dtype"),
    (lambda: (torch.randn(3, 8), torch.randn(2, 4, 8)), "weight must be 2-d"),
    (lambda: (torch.randn(3, 8), torch.randn(4, 8), torch.randn(5)), r"bias must be \[4\]"),
    (lambda: (torch.ones(3, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), "floating dtype"),
])
def test_bad_input_is_refused_by_name(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kt.linear(*args())


def test_use_kt_linear_swaps_plain_linears_only():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), Custom(6, 4), nn.Sequential(nn.Linear(4, 3, bias=False)))
    keys = model.state_dict().keys()
    reference = copy.deepcopy(model)
    assert use_kt_linear(model) == 2
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [KTLinear, Custom, KTLinear]
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, KTLinear))
    assert model.state_dict().keys() == keys
    x = torch.randn(5, 8)
    assert torch.equal(model(x), reference(x))  # float32: F.linear itself
    model.to(bf16)
    reference.to(f64)
    assert rel_err(model(x.to(bf16)), reference(x.double())) <= 3e-2  # bf16 through kt.linear


def _tiny_qwen3_moe(dtype):
    model = tiny_model("qwen3_moe", dtype=dtype)
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    return model


def test_patch_model_routes_a_bf16_models_linears_and_equals_float64():
    """patch_model(kt_linear=True) on a bf16 model: every nn.Linear (attention, LM head) is a
    KTLinear; the logits and a PEFT LoRA step's loss and attention LoRA gradients match the
    unpatched model in float64 within bf16's rounding; kt_linear=False leaves them as they are."""
    import peft

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = _tiny_qwen3_moe(f64)
    model = kt_ops.patch_model(_tiny_qwen3_moe(bf16), lora_rank=4, lora_alpha=8, kt_linear=True)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is KTLinear for m in linears)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) <= 3e-2

    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = kt_ops.hf.get_peft_model(model, peft.LoraConfig(**config))
    peft_reference = peft.get_peft_model(reference, peft.LoraConfig(**config))
    peft_reference.load_state_dict({k: v.double() for k, v in peft_model.state_dict().items()
                                    if "experts" not in k}, strict=False)
    for m in (peft_model, peft_reference):
        for name, p in m.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.copy_(torch.linspace(-0.3, 0.3, p.numel()).reshape(p.shape))
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = peft_reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_" in n and "experts" not in n}
    ref_grads = {n: p.grad for n, p in peft_reference.named_parameters() if n in grads}
    assert grads and grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) <= 6e-2, name

    untouched = kt_ops.patch_model(_tiny_qwen3_moe(bf16), kt_linear=False)
    assert all(type(m) is nn.Linear for m in untouched.modules() if isinstance(m, nn.Linear))
    default = kt_ops.patch_model(_tiny_qwen3_moe(bf16))
    assert any(type(m) is KTLinear for m in default.modules()) == bf16_gemms_are_slow()
    with pytest.raises(ValueError, match="kt_linear must be True, False or None"):
        kt_ops.patch_model(_tiny_qwen3_moe(bf16), kt_linear="yes")
