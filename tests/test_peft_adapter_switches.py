"""PEFT's adapter switches reach kt's expert LoRA (kt_ops.hf.peft_experts, expert_adapters).

A patched model wrapped with PEFT (``kt_ops.hf.get_peft_model`` / ``kt_ops.load_adapter``) is
compared, logits fp32 within 1e-5, with the unpatched model under plain PEFT holding the same
adapter (LoRA on attention and on the experts), through every switch PEFT has:
``disable_adapter()``, ``disable_adapter_layers()``, named adapters (``add_adapter``,
``load_adapter(dir, name)``, ``set_adapter``, ``delete_adapter``), TRL's copy of the
``default`` adapter into ``ref`` by parameter names, saving named adapters, and PEFT's own
``get_peft_model`` (what TRL's ``peft_config`` path calls), which must leave kt's LoRA trainable.
Each comparison is also checked to be able to fail: the expert LoRA's B factors are nonzero,
so leaving it on (or off) moves the logits far beyond the tolerance.
"""
import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
from moe_testing import randomize_lora, rel_err  # noqa: E402

R, ALPHA = 4, 8
TOL = 1e-5


def _full_config(**kw):
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"], **kw)


def _plain_adapter(base, folder, seed):
    """An adapter written by plain PEFT on the unpatched model, with nonzero B everywhere."""
    model = peft.get_peft_model(copy.deepcopy(base), _full_config())
    randomize_lora(model, lambda name: "lora_B" in name, seed=seed, scale=0.3)
    model.save_pretrained(folder)
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = samples.tiny_qwen3_moe()
    root = tmp_path_factory.mktemp("adapters")
    plain = _plain_adapter(base, root / "first", seed=1)
    patched = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                  str(root / "first"))
    return dict(base=base, root=root, plain=plain, kt=patched, ids=samples.input_ids())


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_active_adapter_equals_plain_peft_and_differs_from_base(setup):
    kt, plain, base, ids = setup["kt"], setup["plain"], setup["base"], setup["ids"]
    assert rel_err(_logits(kt, ids), _logits(plain, ids)) <= TOL
    # The adapter moves the logits well beyond the tolerance: the switches below can fail.
    assert rel_err(_logits(kt, ids), _logits(base, ids)) > 1e-2


def test_disable_adapter_gives_the_base_model(setup):
    kt, plain, base, ids = setup["kt"], setup["plain"], setup["base"], setup["ids"]
    want = _logits(base, ids)
    with kt.disable_adapter():
        got = _logits(kt, ids)
    with plain.disable_adapter():
        assert rel_err(_logits(plain, ids), want) <= TOL  # what PEFT means by it
    assert rel_err(got, want) <= TOL
    assert rel_err(_logits(kt, ids), _logits(plain, ids)) <= TOL  # back on after the context
    kt.base_model.disable_adapter_layers()
    try:
        assert rel_err(_logits(kt, ids), want) <= TOL
    finally:
        kt.base_model.enable_adapter_layers()
    assert rel_err(_logits(kt, ids), _logits(plain, ids)) <= TOL


def test_disabled_experts_are_frozen_and_come_back_trainable(setup):
    """As PEFT's LoRA layers: frozen while disabled, the active adapter trainable again after."""
    kt = setup["kt"]
    experts = kt_ops.hf.patched_experts(kt)[0][1]
    assert experts.gate_lora_a.requires_grad and experts.down_lora_b.requires_grad
    with kt.disable_adapter():
        assert not experts.gate_lora_a.requires_grad and experts.adapters.disabled
    assert experts.gate_lora_a.requires_grad and not experts.adapters.disabled


def test_fresh_named_adapter_is_the_base_model_and_separate(setup):
    kt, base, plain, ids = setup["kt"], setup["base"], setup["plain"], setup["ids"]
    kt.add_adapter("fresh", peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    try:
        experts = kt_ops.hf.patched_experts(kt)[0][1]
        fresh, default = experts.expert_lora("fresh"), experts.expert_lora("default")
        assert fresh.gate_lora_a is not default.gate_lora_a and not fresh.gate_lora_a.requires_grad
        assert fresh.gate_lora_a is fresh.up_lora_a  # PEFT's one A on the fused gate_up_proj
        assert torch.count_nonzero(fresh.gate_lora_b) == 0 and torch.count_nonzero(fresh.gate_lora_a) > 0
        kt.set_adapter("fresh")
        assert fresh.gate_lora_a.requires_grad and not default.gate_lora_a.requires_grad
        assert rel_err(_logits(kt, ids), _logits(base, ids)) <= TOL  # B = 0 everywhere: the base model
        kt.set_adapter("default")
        assert rel_err(_logits(kt, ids), _logits(plain, ids)) <= TOL
    finally:
        kt.set_adapter("default")
        kt.delete_adapter("fresh")
    assert "fresh" not in kt_ops.hf.patched_experts(kt)[0][1].adapters.lora


def test_second_adapter_loaded_by_name_equals_plain_peft(setup, tmp_path):
    kt, base, ids = setup["kt"], setup["base"], setup["ids"]
    second = _plain_adapter(base, tmp_path / "second", seed=2)
    kt.load_adapter(str(tmp_path / "second"), adapter_name="second")
    try:
        assert rel_err(_logits(kt, ids), _logits(setup["plain"], ids)) <= TOL  # loading does not activate
        kt.set_adapter("second")
        assert rel_err(_logits(kt, ids), _logits(second, ids)) <= TOL
        assert rel_err(_logits(kt, ids), _logits(setup["plain"], ids)) > 1e-2
        # Saved by name: the folder PEFT writes it to holds both parts, which plain PEFT loads.
        kt.save_pretrained(str(tmp_path / "saved"), selected_adapters=["second"])
        again = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved" / "second"))
        assert rel_err(_logits(again, ids), _logits(second, ids)) <= TOL
        kt.set_adapter("default")
        kt.delete_adapter("second")
        assert rel_err(_logits(kt, ids), _logits(setup["plain"], ids)) <= TOL
    finally:
        if "second" in kt.peft_config:
            kt.set_adapter("default")
            kt.delete_adapter("second")


def test_trl_reference_copy_by_name_is_a_separate_copy(setup):
    """DPOTrainer (ref_model=None, a PEFT model): add_adapter("ref", default's config), then
    copy every ``.default.`` parameter into its ``.ref.`` twin; the reference runs under
    set_adapter("ref") while "default" trains."""
    kt, plain, ids = copy.deepcopy(setup["kt"]), setup["plain"], setup["ids"]
    kt.add_adapter("ref", kt.peft_config["default"])
    copied = 0
    for name, param in kt.named_parameters():
        if ".default." in name:
            kt.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
            copied += ".experts." in name
    assert copied == 2 * 5  # 2 layers x the expert LoRA's five tensors (the tied A once)
    before = _logits(kt, ids)
    kt.set_adapter("ref")
    assert rel_err(_logits(kt, ids), before) <= TOL
    kt.set_adapter("default")
    # One training step on "default": "ref" must not move.
    opt = torch.optim.SGD([p for p in kt.parameters() if p.requires_grad], lr=1.0)
    assert any(".experts.adapters.lora.default." in n for n, p in kt.named_parameters() if p.requires_grad)
    assert not any(".ref." in n for n, p in kt.named_parameters() if p.requires_grad)
    kt.train()
    kt(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    kt.eval()
    assert rel_err(_logits(kt, ids), before) > 1e-3
    kt.set_adapter("ref")
    assert rel_err(_logits(kt, ids), _logits(plain, ids)) <= TOL


def test_peft_own_get_peft_model_keeps_expert_lora_trainable(setup, tmp_path):
    """TRL's peft_config path calls PEFT's get_peft_model on the patched model: kt's expert
    LoRA and grad anchors stay trainable, the rest of the base model is frozen, and PEFT's own
    save / load carry the experts' part in PEFT's layout."""
    base, ids = setup["base"], setup["ids"]
    patched = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA)
    randomize_lora(patched, lambda name: name.endswith("lora_b"), seed=4, scale=0.3)
    model = peft.get_peft_model(patched, peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith("experts.adapters.lora.default.gate_lora_a") for n in trainable)
    assert any(n.endswith("experts.grad_anchor") for n in trainable)
    assert not any(n.endswith(("embed_tokens.weight", "mlp.gate.weight", "q_proj.base_layer.weight",
                               "experts.gate_proj")) for n in trainable)
    model.save_pretrained(str(tmp_path / "own"))
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "own" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in saved
    assert not any(".adapters.lora." in k for k in saved)
    fresh = peft.PeftModel.from_pretrained(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                           str(tmp_path / "own"))
    assert rel_err(_logits(fresh, ids), _logits(model, ids)) <= TOL
    with model.disable_adapter():
        assert rel_err(_logits(model, ids), _logits(base, ids)) <= TOL


def test_unknown_adapter_name_is_refused_by_name(setup):
    kt = copy.deepcopy(setup["kt"])
    experts = kt_ops.hf.patched_experts(kt)[0][1]
    with pytest.raises(ValueError, match="no expert adapter 'nope'.*kt_ops.hf.get_peft_model"):
        experts.set_adapter("nope")
    with pytest.raises(ValueError, match="one expert adapter at a time"):
        experts.set_adapter(["default", "default"])
    with pytest.raises(ValueError, match="r=8.*r=4"):
        kt.add_adapter("wide", peft.LoraConfig(r=8, lora_alpha=ALPHA, target_modules=["q_proj"]))
    assert "wide" not in kt.peft_config and "wide" not in experts.adapters.lora


def test_peft_lora_on_kt_base_weights_is_refused_at_the_first_forward(setup):
    """PEFT's own get_peft_model with target_parameters (the config one writes for the
    unpatched model) wraps kt's down_proj in a LoRA of PEFT's own: refused, naming the fix."""
    model = peft.get_peft_model(kt_ops.patch_model(copy.deepcopy(setup["base"]), lora_rank=R, lora_alpha=ALPHA),
                                _full_config())
    with pytest.raises(ValueError, match="drop target_parameters"):
        model(input_ids=setup["ids"])


def test_state_dict_of_earlier_versions_loads_into_the_active_adapter(setup):
    """Trainer checkpoints written before named adapters hold experts.gate_lora_a ...;
    loading one fills the active adapter."""
    model = kt_ops.patch_model(copy.deepcopy(setup["base"]), lora_rank=R, lora_alpha=ALPHA)
    experts = kt_ops.hf.patched_experts(model)[0][1]
    old = {k.replace("adapters.lora.default.", ""): torch.full_like(v, 0.5) for k, v in model.state_dict().items()
           if ".adapters.lora.default." in k}
    assert "model.layers.0.mlp.experts.gate_lora_a" in old
    result = model.load_state_dict(old, strict=False)
    assert not result.unexpected_keys
    assert torch.all(experts.gate_lora_a == 0.5) and torch.all(experts.down_lora_b == 0.5)
