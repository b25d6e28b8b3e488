"""Expert LoRA of patched models against PEFT 0.21 on the unpatched model.

PEFT puts LoRA on transformers-5 fused experts with
``LoraConfig(target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])``:
one rank-r LoRA per fused parameter (see kt_ops/hf/adapters.py for the layout). kt_ops
represents it exactly (gate/up LoRA A tied), so for every supported architecture (fp32):

* a training step (loss with labels, backward) of the patched model equals PEFT's: loss,
  every LoRA gradient (mapped to kt's layout) and the router weight gradients, relative
  error <= 1e-5; after one SGD step on the LoRA the next loss is still equal (the tied A
  gets PEFT's fused gradient);
* save_adapter -> PeftModel.from_pretrained(fresh unpatched model) gives the patched
  model's logits, and load_adapter brings the adapter back into a patched model;
* an adapter saved by PEFT (also rsLoRA, and one that targets down_proj only) loads into a
  patched model with load_adapter and gives PEFT's logits.
"""
import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
from kt_ops.hf import adapters  # noqa: E402
from kt_ops.hf.patch import patched_blocks  # noqa: E402
from moe_testing import randomize_lora  # noqa: E402
from test_hf_patching import ARCHS, input_ids, rel_err, tiny_model  # noqa: E402

R, ALPHA = 4, 8
TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def peft_model(base, *, seed=1, targets=TARGETS, **config):
    """PEFT LoRA on the experts of a copy of ``base``, with random (nonzero) A and B."""
    config = dict(dict(r=R, lora_alpha=ALPHA), **config)
    model = peft.get_peft_model(copy.deepcopy(base),
                                peft.LoraConfig(target_modules=[], target_parameters=list(targets), **config))
    randomize_lora(model, lambda name: "lora_" in name, seed)
    return model


def random_kt_lora(model, seed=2):
    randomize_lora(model, lambda name: "lora_" in name, seed)


def peft_lora_grads_as_kt(pm, patched):
    """PEFT's LoRA gradients in kt's layout: {(block name, kt tensor name): gradient}; a LoRA
    tensor that got none (experts no token reached, e.g. a vision tower's) has a zero one."""
    grads = {n.replace(".default", ""): p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in pm.named_parameters() if "lora_" in n}
    out = {}
    for name, block in patched_blocks(patched):
        prefix = f"base_model.model.{name}."
        mine = {k[len(prefix):]: g for k, g in grads.items() if k.startswith(prefix)}
        for kt_name, g in adapters.peft_block_to_kt(mine, block, R).items():
            out[(name, kt_name)] = g
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_matches_peft(arch, tmp_path):
    base = tiny_model(arch).train()
    pm = peft_model(base)
    pm.save_pretrained(tmp_path)
    patched = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=1), tmp_path)
    for model in (pm, patched):  # the router is trained too (gradient of the routing weights)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name or name.endswith("mlp.gate.weight"))
    ids = input_ids()
    kwargs = dict(output_router_logits=True) if arch in ("qwen3_moe", "qwen2_moe", "mixtral") else {}
    losses = [m(input_ids=ids, labels=ids, **kwargs).loss for m in (pm, patched)]
    assert rel_err(losses[1], losses[0]) <= 1e-5
    for loss in losses:
        loss.backward()

    ref = peft_lora_grads_as_kt(pm, patched)
    assert len(ref) == 5 * len(patched_blocks(patched))  # gate_a (= up_a), gate_b, up_b, down_a, down_b
    for (name, kt_name), g in ref.items():
        kt = patched.get_submodule(name).experts
        assert rel_err(getattr(kt, kt_name).grad, g) <= 1e-5, (name, kt_name)
    router_grads = {n.removeprefix("base_model.model."): p.grad for n, p in pm.named_parameters()
                    if n.endswith("mlp.gate.weight")}
    for name, p in patched.named_parameters():
        if name.endswith("mlp.gate.weight"):
            assert rel_err(p.grad, router_grads[name]) <= 1e-5, name

    # one SGD step on the LoRA of both: the models stay equal
    with torch.no_grad():
        for model in (pm, patched):
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p -= 0.5 * p.grad
        losses = [m(input_ids=ids, labels=ids, **kwargs).loss for m in (pm, patched)]
    assert rel_err(losses[1], losses[0]) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_save_adapter_loads_into_peft(arch, tmp_path):
    base = tiny_model(arch)
    patched = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA)
    random_kt_lora(patched)
    ids = input_ids(3)
    with torch.no_grad():
        expected = patched(input_ids=ids).logits
        without = base(input_ids=ids).logits
    assert rel_err(expected, without) > 1e-2  # the adapter matters
    kt_ops.save_adapter(patched, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == R and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert config["target_modules"] == [] and sorted(config["target_parameters"]) == sorted(TARGETS)
    assert config["task_type"] == "CAUSAL_LM"

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, expected) <= 1e-5
    # PEFT's own state dict is exactly what was saved
    saved = adapters.adapter_state_dict(patched)
    theirs = peft.utils.get_peft_model_state_dict(loaded)
    assert saved.keys() == theirs.keys()
    assert all(torch.equal(saved[k], theirs[k]) for k in saved)

    again = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=1)
    assert kt_ops.load_adapter(again, tmp_path) is again
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, expected)
    kt = again.model.layers[-1].mlp.experts
    assert kt.lora_scale == ALPHA / R and kt.gate_lora_a is kt.up_lora_a


def test_save_adapter_bf16_round_trip(tmp_path):
    base = tiny_model("qwen2_moe", dtype=torch.bfloat16, moe_last_only=True)
    patched = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA)
    random_kt_lora(patched)
    kt_ops.save_adapter(patched, tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    ids = input_ids(4)
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, patched(input_ids=ids).logits) <= 1e-2


@pytest.mark.parametrize("arch, config", [
    ("deepseek_v3", dict(use_rslora=True)),
    ("mixtral", dict(targets=["experts.down_proj"])),
    ("qwen3_moe", dict(targets=["experts.gate_up_proj"], r=3, lora_alpha=5)),
])
def test_peft_adapter_loads_into_patched(arch, config, tmp_path):
    base = tiny_model(arch)
    pm = peft_model(base, seed=6, **config)
    pm.save_pretrained(tmp_path)
    r = config.get("r", R)
    patched = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=r), tmp_path)
    ids = input_ids(5)
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
        assert rel_err(expected, base(input_ids=ids).logits) > 1e-2
        assert rel_err(patched(input_ids=ids).logits, expected) <= 1e-5
    if "targets" in config:  # the projection PEFT did not adapt has B = 0
        kt = patched.model.layers[0].mlp.experts
        untouched = ("gate_lora_b", "up_lora_b") if config["targets"] == ["experts.down_proj"] else ("down_lora_b",)
        assert all(not getattr(kt, n).any() for n in untouched)


def test_errors(tmp_path):
    base = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="no kt_ops-patched MoE block"):
        kt_ops.save_adapter(base, tmp_path / "a")
    with pytest.raises(ValueError, match="lora_rank=0"):
        kt_ops.save_adapter(kt_ops.patch_model(copy.deepcopy(base)), tmp_path / "a")
    patched = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        kt_ops.load_adapter(patched, tmp_path / "missing")
    kt_ops.save_adapter(patched, tmp_path / "r4")
    with pytest.raises(ValueError, match=r"rank r=4 but the model was patched with lora_rank=2"):
        kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=2), tmp_path / "r4")
    # an adapter that also adapts attention loads its attention part through PEFT (see
    # tests/test_peft_attention.py); one whose rank differs from the experts' is refused
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                  target_parameters=TARGETS))
    pm.save_pretrained(tmp_path / "attn")
    with pytest.raises(ValueError, match=r"peft_config has r=2, .* but the experts' LoRA has r=4"):
        kt_ops.load_adapter(patched, tmp_path / "attn")
    # untied gate/up A cannot be written as PEFT's fused LoRA
    kt = patched.model.layers[0].mlp.experts
    kt.up_lora_a = torch.nn.Parameter(kt.gate_lora_a.detach() + 1)
    with pytest.raises(ValueError, match="gate_lora_a and up_lora_a differ"):
        kt_ops.save_adapter(patched, tmp_path / "b")


def test_non_owner_load_and_save(tmp_path, monkeypatch):
    owner = kt_ops.patch_model(tiny_model("qwen3_moe"), lora_rank=R, lora_alpha=ALPHA)
    kt_ops.save_adapter(owner, tmp_path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    other = kt_ops.patch_model(tiny_model("qwen3_moe"), lora_rank=R, lora_alpha=1)
    kt_ops.load_adapter(other, tmp_path)  # checks the config, sets the scale; no weights here
    assert other.model.layers[0].mlp.experts.lora_scale == ALPHA / R
    with pytest.raises(ValueError, match="only the owner rank"):
        kt_ops.save_adapter(other, tmp_path / "x")
