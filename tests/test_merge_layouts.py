"""merge_adapter on transformers' expert layouts: the merged checkpoint, loaded by stock
transformers, gives the patched model's logits (fp32, 1e-5) for families whose experts are
stored differently:

* gpt-oss: fused, transposed ``gate_up_proj [E, H, 2I]`` with gate/up interleaved, and biases;
* Qwen3-MoE written fused (``save_original_format=False``): ``gate_up_proj [E, 2I, H]``;
* DeepSeek-V3 (per expert, the hub layout; a dense first layer, a shared expert);
* Mixtral (per expert under ``block_sparse_moe`` with ``w1/w2/w3`` names, renamed by transformers).

The adapter's expert LoRA only (kt_ops.patch_model's LoRA, B made nonzero): each layout's delta
lands in the right rows, columns and experts or the logits differ by far more than the bound.
"""
import copy

import pytest
import torch

import kt_ops
import hf_families
from moe_testing import randomize_lora, rel_err

R, ALPHA = 4, 8
LAYOUTS = [("gpt_oss", True), ("qwen3_moe", True), ("deepseek_v3", False), ("mixtral", False)]


@pytest.fixture(scope="module")
def families():
    return {f.name: f for f in hf_families.discover()}


@pytest.mark.parametrize("family,fused", LAYOUTS, ids=[f"{n}-{'fused' if f else 'per_expert'}" for n, f in LAYOUTS])
def test_merged_layout_matches_patched_model(families, family, fused, tmp_path):
    from transformers import AutoModelForCausalLM

    base = hf_families.tiny_model(families[family])
    base.save_pretrained(tmp_path / "base", save_original_format=not fused)
    patched = kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA)
    randomize_lora(patched, lambda n: "lora_b" in n.lower(), seed=0, scale=0.02)
    kt_ops.save_adapter(patched, tmp_path / "adapter")

    summary = kt_ops.hf.merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "out", progress=False)
    assert summary.merged and all(".experts" in k or "block_sparse_moe" in k for k in summary.merged)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = hf_families.input_ids()
    with torch.no_grad():
        want = patched.eval()(input_ids=ids).logits
        assert rel_err(base(input_ids=ids).logits, want) > 1e-2  # the adapter matters: the check below can fail
        assert rel_err(merged(input_ids=ids).logits, want) <= 1e-5
