"""patch_model on every MoE family of the installed transformers, discovered by
tests/hf_families.py (not a hand list), each as a tiny random-init model from its own config:

* covered families (SwiGLU experts in the default layout): the patched model's logits equal
  the unpatched model's (fp32, 1e-5); a LoRA training step equals PEFT's LoRA on the unpatched
  experts (loss and every LoRA gradient, 1e-5), with PEFT's adapter loaded by
  kt_ops.load_adapter; kt_ops.save_adapter's output loads back into plain PEFT with the
  patched model's logits;
* refused families (another layout or activation): patch_model raises a ValueError naming
  the experts class and why, and changes nothing;
* families whose tiny model cannot be built here skip, with the reason.
"""
import copy
from functools import lru_cache

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from hf_families import classify, discover, input_ids, run, tiny_model  # noqa: E402
from kt_ops.hf.expert_layout import ExpertsLayout  # noqa: E402
from kt_ops.hf.experts import gating_of, is_experts_module, kt_experts_forward  # noqa: E402
from test_hf_adapters import R, peft_lora_grads_as_kt, peft_model  # noqa: E402
from test_hf_patching import rel_err  # noqa: E402
from kt_ops.hf.patch import patched_blocks  # noqa: E402

FAMILIES = discover()
# Named in issue 16 (and the five hand-supported before it): must stay covered.
MUST_COVER = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "olmoe",
              "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "minimax_m2")


def assert_experts_match_at_large_activations(model, scale: float = 40.0):
    """Each experts module's own forward against kt.moe (the "kt" experts function) on hidden
    states scaled so that gate and up pre-activations reach tens: a tiny random model's stay
    near 1, where a gating that differs from silu(gate)·up only at large values (a clamp at
    swiglu_limit) would pass the logits check unseen."""
    g = torch.Generator().manual_seed(1)
    for module in (m for m in model.modules() if is_experts_module(m)):
        E, _, H = ExpertsLayout.of(module).sizes(module.gate_up_proj)
        x = torch.randn(24, H, generator=g) * scale
        K = min(2, E)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(24)])
        w = torch.rand(24, K, generator=g)
        with torch.no_grad():
            pre = x @ ExpertsLayout.of(module).weights(module)["gate_proj"][0].T
            assert pre.abs().max() > 20, "the probe must reach beyond the families' clamps (7-10)"
            assert rel_err(kt_experts_forward(module, x, ids, w), module(x, ids, w)) <= 1e-5, type(module).__name__


# Families whose tiny model's float32 LoRA gradients are further than 1e-5 from float64 whoever
# computes them. Gemma 4 (first layer; measured by the same step in float64, with transformers'
# eager experts): PEFT's float32 gradients 0.8-1.4e-5 from float64, kt's 0.9-2.0e-5, while kt and
# PEFT in float64 agree to 1e-15.
LORA_GRAD_TOLERANCE = {"gemma4": 4e-5}


@lru_cache(maxsize=None)
def status(name):
    return classify(next(f for f in FAMILIES if f.name == name))


def test_discovery_finds_the_families():
    names = {f.name for f in FAMILIES}
    assert set(MUST_COVER) <= names
    for name in MUST_COVER:
        assert status(name)[0] == "covered", (name, status(name))
    covered = [f.name for f in FAMILIES if status(f.name)[0] == "covered"]
    assert len(covered) > len(MUST_COVER)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family(family, tmp_path):
    kind, why = status(family.name)
    if kind == "not built":
        pytest.skip(f"{family.name}: {why}")
    if kind == "refused":
        model = tiny_model(family)
        before = [type(m) for m in model.modules()]
        with pytest.raises(ValueError, match="patch_model: .*experts.*: "):
            kt_ops.patch_model(model)
        assert [type(m) for m in model.modules()] == before  # nothing changed
        return

    base = tiny_model(family)
    ids = input_ids()
    with torch.no_grad():
        ref = run(base, ids).logits
    patched = kt_ops.patch_model(copy.deepcopy(base))
    assert not any(is_experts_module(m) for m in patched.modules())
    with torch.no_grad():
        assert rel_err(run(patched, ids).logits, ref) <= 1e-5
    assert_experts_match_at_large_activations(base)

    # one LoRA step against PEFT on the unpatched experts (PEFT's adapter loaded into kt)
    base.train()
    pm = peft_model(base)
    pm.save_pretrained(tmp_path / "peft")
    lora = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=1), tmp_path / "peft")
    for model in (pm, lora):
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    losses = [run(m, ids, labels=ids).loss for m in (pm, lora)]
    assert rel_err(losses[1], losses[0]) <= 1e-5
    for loss in losses:
        loss.backward()
    grads = peft_lora_grads_as_kt(pm, lora)
    assert len(grads) == 5 * len(patched_blocks(lora)) > 0
    for (name, kt_name), g in grads.items():
        kt_param = getattr(lora.get_submodule(name).experts, kt_name)
        kt_grad = kt_param.grad if kt_param.grad is not None else torch.zeros_like(kt_param)
        assert rel_err(kt_grad, g) <= LORA_GRAD_TOLERANCE.get(family.name, 1e-5), (name, kt_name)

    # and back: kt writes the very adapter PEFT wrote (the adapter kt loaded, not yet stepped) ...
    kt_ops.save_adapter(lora, tmp_path / "kt")
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("kt", "peft"))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-7), key
    # ... and it loads into plain PEFT on a fresh unpatched model, where PEFT loads its own
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "kt").eval()
    lora.eval()
    if not peft_loads_its_own_adapter(base, pm, tmp_path / "peft", ids):
        return
    with torch.no_grad():
        assert rel_err(run(reloaded, ids).logits, run(lora, ids).logits) <= 1e-5


# Families where PEFT cannot load the adapter it saved itself (its load reports every LoRA key of
# the experts missing, and the reloaded model's logits differ): multimodal wrappers whose
# checkpoint key mapping PEFT applies on load but not on save, in the PEFT and transformers
# installed here. Listed so that a fix upstream shows as a failure here, to be removed.
PEFT_CANNOT_RELOAD = {"deepseek_ocr2", "mistral_large4", "unlimited_ocr"}


def peft_loads_its_own_adapter(base, pm, path, ids) -> bool:
    """Whether PEFT's reload of its own saved adapter (``path``, saved from ``pm``) gives
    ``pm``'s logits; checked against PEFT_CANNOT_RELOAD, both ways."""
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    was_training = pm.training
    pm.eval()
    with torch.no_grad():
        ok = rel_err(run(reloaded, ids).logits, run(pm, ids).logits) <= 1e-5
    pm.train(was_training)
    family = type(base).__module__.split(".")[-2]
    assert ok != (family in PEFT_CANNOT_RELOAD), (family, ok)
    return ok


def _deepseek_v4_experts():
    family = next((f for f in FAMILIES if f.name == "deepseek_v4"), None)
    if family is None:
        pytest.skip("no deepseek_v4 in this transformers")
    model = tiny_model(family)
    return model, next(m for m in model.modules() if is_experts_module(m))


def test_clamped_gating_runs_with_its_limit():
    """DeepSeek-V4's experts clamp gate and up at swiglu_limit in an _apply_gate of their own
    (which transformers' backends call). Their act_fn is SiLU, so a check by name had passed them
    and kt.moe computed unclamped SwiGLU; the gating is now matched by what it computes, and kt
    runs it with the limit it matched (the family's test_family checks the numbers)."""
    model, experts = _deepseek_v4_experts()
    assert type(experts.act_fn).__name__ in ("SiLU", "SiLUActivation") and experts.limit == 10.0
    assert gating_of(experts) == {"swiglu_limit": 10.0, "activation": "silu", "swiglu_alpha": None}
    patched = kt_ops.patch_model(model)
    assert {m.swiglu_limit for m in patched.modules() if isinstance(m, kt_ops.KTMoE)} == {10.0}


def test_other_clamped_gating_is_refused():
    """A gating that names a limit but clamps otherwise (here: gate on both sides) is neither
    form kt.moe computes: refused, naming the limit, by patch_model and the "kt" function."""
    model, experts = _deepseek_v4_experts()

    class OtherClamp(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(-self.limit, self.limit)) * up.clamp(-self.limit, self.limit)

    experts.__class__ = OtherClamp
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"OtherClamp's gating with swiglu_limit=10.0 is not act\(gate\)·up .*, "
                                         r"clamped at the limit \(gate <- min\(gate, limit\), up <- clamp\(up, -limit, "
                                         r"limit\)\) or not"):
        kt_ops.patch_model(model)
    assert [type(m) for m in model.modules()] == before
    x, ids, w = torch.randn(3, experts.gate_up_proj.shape[2]), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r'experts_implementation="kt": OtherClamp'):
        kt_experts_forward(experts, x, ids, w)


def test_geglu_experts_run_as_gelu_tanh():
    """Gemma 4's experts gate with gelu_pytorch_tanh (transformers' default _apply_gate): kt.moe
    runs them with activation="gelu_tanh" (test_family checks the numbers). GELU's erf form, a
    different function by up to 4.7e-4 at 2, is not taken for it."""
    family = next((f for f in FAMILIES if f.name == "gemma4"), None)
    if family is None:
        pytest.skip("no gemma4 in this transformers")
    model = tiny_model(family)
    experts = next(m for m in model.modules() if is_experts_module(m))
    assert gating_of(experts) == {"swiglu_limit": None, "activation": "gelu_tanh", "swiglu_alpha": None}

    class ErfGelu(type(experts)):
        pass

    experts.__class__ = ErfGelu
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"ErfGelu's gating \(activation GELU\) is not act\(gate\)·up \(act: silu or "
                                         r"gelu_tanh\); kt.moe computes SwiGLU, GeGLU and gpt-oss's gated experts only"):
        kt_ops.patch_model(model)


def _minimax_m3_experts():
    family = next((f for f in FAMILIES if f.name == "minimax_m3_vl"), None)
    if family is None:
        pytest.skip("no minimax_m3_vl in this transformers")
    model = tiny_model(family)
    return model, next(m for m in model.modules() if is_experts_module(m))


def test_gpt_oss_gating_runs_as_swigluoai():
    """MiniMax-M3's experts compute gpt-oss's gating, gate·σ(alpha·gate)·(up + 1) after the clamp,
    in an _apply_gate of their own: kt.moe runs them with activation="swigluoai" and the module's
    alpha and limit (test_family checks the numbers, at pre-activations past the limit too)."""
    model, experts = _minimax_m3_experts()
    alpha, limit = experts.swiglu_alpha, experts.swiglu_limit
    assert gating_of(experts) == {"swiglu_limit": limit, "activation": "swigluoai", "swiglu_alpha": alpha}
    patched = kt_ops.patch_model(model)
    layers = [m for m in patched.modules() if isinstance(m, kt_ops.KTMoE)]
    assert layers and {(m.activation, m.swiglu_alpha, m.swiglu_limit) for m in layers} == {("swigluoai", alpha, limit)}


def test_gpt_oss_gating_with_another_alpha_than_it_names_is_refused():
    """The alpha kt runs is the one the gating computes with: a module whose gating uses another
    alpha than the one it names is refused, by patch_model and the "kt" function."""
    model, experts = _minimax_m3_experts()

    class OtherAlpha(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
            return gate * torch.sigmoid(gate * (self.swiglu_alpha + 0.01)) * (up + 1)

    experts.__class__ = OtherAlpha
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=rf"OtherAlpha's gating with swiglu_limit={experts.swiglu_limit} is not .* or "
                                         rf"gate·σ\({experts.swiglu_alpha}·gate\)·\(up \+ 1\) \(gpt-oss's\)"):
        kt_ops.patch_model(model)
    assert [type(m) for m in model.modules()] == before
    x, ids, w = torch.randn(3, experts.gate_up_proj.shape[2]), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r'experts_implementation="kt": OtherAlpha'):
        kt_experts_forward(experts, x, ids, w)


def test_gpt_oss_experts_convert_from_their_layout():
    """gpt-oss's experts hold gate_up_proj [E, H, 2I] (transposed) with gate and up interleaved
    (even and odd outputs), down_proj [E, I, H] and biases: patch_model gives kt.moe
    gate = gate_up_projᵀ[:, 0::2], up = [:, 1::2], down = down_projᵀ, the biases split the same
    way, and gpt-oss's gating (swigluoai, alpha 1.702, clamped at 7); test_family checks the
    numbers, biases made nonzero."""
    family = next((f for f in FAMILIES if f.name == "gpt_oss"), None)
    if family is None:
        pytest.skip("no gpt_oss in this transformers")
    model = tiny_model(family)
    experts = next(m for m in model.modules() if is_experts_module(m))
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    gate_up_bias, down_bias = experts.gate_up_proj_bias.detach().clone(), experts.down_proj_bias.detach().clone()
    assert gate_up_bias.abs().sum() > 0 and down_bias.abs().sum() > 0
    patched = kt_ops.patch_model(model, lora_rank=2)
    kt = next(b.experts for _, b in patched_blocks(patched))
    assert torch.equal(kt.gate_proj, gate_up.transpose(1, 2)[:, 0::2]) and torch.equal(kt.up_proj, gate_up.transpose(1, 2)[:, 1::2])
    assert torch.equal(kt.down_proj, down.transpose(1, 2))
    assert torch.equal(kt.gate_bias, gate_up_bias[:, 0::2]) and torch.equal(kt.up_bias, gate_up_bias[:, 1::2])
    assert torch.equal(kt.down_bias, down_bias)
    assert not any(b.requires_grad for b in kt.expert_biases())  # frozen with the base in LoRA training
    assert (kt.activation, kt.swiglu_alpha, kt.swiglu_limit, kt.gate_up_interleaved) == ("swigluoai", 1.702, 7.0, True)
