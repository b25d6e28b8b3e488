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
from hf_families import classify, discover, input_ids, run, tiny_model  # noqa: E402
from kt_ops.hf.experts import is_experts_module  # noqa: E402
from test_hf_adapters import R, peft_lora_grads_as_kt, peft_model  # noqa: E402
from test_hf_patching import rel_err  # noqa: E402
from kt_ops.hf.patch import patched_blocks  # noqa: E402

FAMILIES = discover()
# Named in issue 16 (and the five hand-supported before it): must stay covered.
MUST_COVER = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "olmoe",
              "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "minimax_m2")


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
        assert rel_err(getattr(lora.get_submodule(name).experts, kt_name).grad, g) <= 1e-5, (name, kt_name)

    # and back: kt's adapter loads into plain PEFT on a fresh unpatched model
    kt_ops.save_adapter(lora, tmp_path / "kt")
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "kt").eval()
    lora.eval()
    with torch.no_grad():
        assert rel_err(run(reloaded, ids).logits, run(lora, ids).logits) <= 1e-5
