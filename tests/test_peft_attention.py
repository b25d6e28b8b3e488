"""PEFT LoRA on attention beside kt's expert LoRA, in one adapter.

``kt_ops.hf.get_peft_model`` wraps a patched model with PEFT (LoRA on q_proj / v_proj) and keeps
the experts' LoRA trainable; ``kt_ops.save_adapter`` then writes one adapter that plain PEFT
loads into the *unpatched* model (``target_modules`` + ``target_parameters``) with the same
logits, and a training step of the two models gives the same loss and the same trained adapter
(fp32, SGD, 1e-5); ``kt_ops.load_adapter`` reads it back into a freshly patched model.
"""
import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
from moe_testing import randomize_lora  # noqa: E402
from test_hf_patching import rel_err  # noqa: E402

R, ALPHA = 4, 8
ATTENTION = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _kt_with_attention_lora():
    base = samples.tiny_qwen3_moe()
    pm = kt_ops.hf.get_peft_model(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                  copy.deepcopy(ATTENTION))
    randomize_lora(pm, lambda name: "lora_b" in name.lower(), seed=0, scale=0.1)  # kt's B and PEFT's B
    return base, pm


def test_expert_lora_stays_trainable():
    _, pm = _kt_with_attention_lora()
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in trainable) and any("v_proj.lora_B" in n for n in trainable)
    assert any(n.endswith("experts.adapters.lora.default.gate_lora_a") for n in trainable)
    assert any(n.endswith("experts.adapters.lora.default.down_lora_b") for n in trainable)
    assert not any(n.endswith(("q_proj.base_layer.weight", "mlp.gate.weight")) for n in trainable)
    with pytest.raises(ValueError, match="target_parameters"):
        kt_ops.hf.get_peft_model(kt_ops.patch_model(samples.tiny_qwen3_moe(), lora_rank=R),
                                 peft.LoraConfig(r=R, target_modules=["q_proj"], target_parameters=["experts.down_proj"]))


def test_one_adapter_plain_peft_loads_and_trains_the_same(tmp_path):
    base, pm = _kt_with_attention_lora()
    kt_ops.save_adapter(pm, tmp_path / "init")
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "init", is_trainable=True)
    ids = samples.input_ids()
    with torch.no_grad():
        assert rel_err(pm(input_ids=ids).logits, ref(input_ids=ids).logits) <= 1e-5

    losses = []
    for model in (pm, ref):
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    kt_ops.save_adapter(pm, tmp_path / "ours")
    ref.save_pretrained(tmp_path / "ref")
    from safetensors.torch import load_file
    ours, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(
        tmp_path / "ref" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert any("experts" in k for k in ours) and any("q_proj" in k for k in ours)
    for k in ours:
        assert rel_err(ours[k], theirs[k]) <= 1e-5, k

    # ... and back into a freshly patched model, wrapped with PEFT on the way
    fresh = kt_ops.load_adapter(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                str(tmp_path / "ours"))
    assert kt_ops.hf.peft_attention.is_peft_model(fresh)
    pm.eval(), ref.eval(), fresh.eval()
    with torch.no_grad():
        assert rel_err(fresh(input_ids=ids).logits, ref(input_ids=ids).logits) <= 1e-5


def test_save_pretrained_writes_both_loras(tmp_path):
    """The PEFT model's own save_pretrained (what Trainer.save_model calls) writes the adapter
    with the experts' LoRA too: plain PEFT on the unpatched model gives the same logits."""
    base, pm = _kt_with_attention_lora()
    pm.save_pretrained(tmp_path)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    ids = samples.input_ids()
    pm.eval()
    with torch.no_grad():
        assert rel_err(pm(input_ids=ids).logits, ref(input_ids=ids).logits) <= 1e-5


def test_rank_or_alpha_mismatch_is_refused(tmp_path):
    model = kt_ops.patch_model(samples.tiny_qwen3_moe(), lora_rank=R, lora_alpha=ALPHA)
    with pytest.raises(ValueError, match=r"lora_alpha=16 but the experts' LoRA has r=4, lora_alpha=8"):
        kt_ops.hf.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=2 * ALPHA, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"r=2, lora_alpha=8 but the experts' LoRA has r=4"):
        kt_ops.hf.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=ALPHA, target_modules=["q_proj"]))
