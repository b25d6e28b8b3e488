"""merge_adapter into FP4 checkpoints in their own format: gpt-oss's fused MXFP4 experts,
compressed-tensors' and ModelOpt's NVFP4 (every linear: attention and experts).

* The output has the base's tensors (names, dtypes, shapes) and config; the tensors the adapter
  does not touch (biases, routers, NVFP4's activation scales ...) are byte-identical.
* NVFP4, element by element: each merged weight, decoded by the loader (StoredMatrix), is the
  exactly merged float weight (the adapter merged into the base's float twin) within E2M1's
  rounding at its block's scale: half a step (0.25, 0.5 or 1 times the scale below 2, 4 and 6),
  or the distance past 6 where a rounded-down E4M3 block scale saturates it.
* Logits: the merged checkpoint read by kt_ops (as stored) is as near the patched model with
  its adapter as one fresh FP4 quantization of the float model is to it (times 2); stock
  transformers reads the merged gpt-oss MXFP4 (dequantized on a CPU) with kt's logits.
"""
import copy

import pytest
import torch
from safetensors import safe_open

import kt_ops
import checkpoint_samples as samples
import fp4_checkpoint_samples as fp4
from kt_ops.hf.checkpoint_formats import StoredMatrix
from moe_testing import randomize_lora, rel_err

peft = pytest.importorskip("peft")
R, ALPHA = 4, 8


def _tensors(path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _adapter(base_dir, out_dir, attention: bool, scale: float = 0.02):
    """The patched model of FP4 checkpoint ``base_dir`` (experts as stored) with a nonzero
    adapter (experts; and q/k/v/o with ``attention``), saved to ``out_dir``."""
    model = kt_ops.hf.from_pretrained(base_dir, lora_rank=R, lora_alpha=ALPHA, progress=False)
    if attention:
        model = kt_ops.hf.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    randomize_lora(model, lambda n: "lora_b" in n.lower(), seed=3, scale=scale)
    kt_ops.save_adapter(model, out_dir)
    return model.eval()


def _check_same_layout(base_dir, out_dir, merged_keys):
    base, out = _tensors(base_dir), _tensors(out_dir)
    assert base.keys() == out.keys()
    for key, t in base.items():
        assert (out[key].dtype, out[key].shape) == (t.dtype, t.shape), key
        if key not in merged_keys:
            assert torch.equal(out[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    return base, out


def _logits_check(out_dir, patched, fresh_quantized, float_model, ids):
    merged = kt_ops.hf.from_pretrained(out_dir, progress=False)
    with torch.no_grad():
        want = patched(input_ids=ids).logits
        own = rel_err(fresh_quantized(input_ids=ids).logits, float_model(input_ids=ids).logits)
        base_vs_adapter = rel_err(fresh_quantized(input_ids=ids).logits, want)
        err = rel_err(merged(input_ids=ids).logits, want)
    print(f"logits vs the patched model with the adapter {err:.2e}; one fresh FP4 quantization {own:.2e}; "
          f"the base without the adapter {base_vs_adapter:.2e}")
    assert base_vs_adapter > 2 * own  # the adapter matters more than the bound below
    assert err <= 2 * own
    return merged


def test_gpt_oss_mxfp4_merged_as_mxfp4(tmp_path):
    import transformers

    float_model = fp4.tiny_gpt_oss(torch.float32)
    float_model.save_pretrained(tmp_path / "float")
    fp4.write_gpt_oss_mxfp4(str(tmp_path / "float"), str(tmp_path / "mxfp4"))
    patched = _adapter(tmp_path / "mxfp4", tmp_path / "adapter", attention=False)
    summary = kt_ops.hf.merge_adapter(tmp_path / "mxfp4", tmp_path / "adapter", tmp_path / "out", progress=False)
    assert sorted(summary.merged) == sorted(k for k in _tensors(tmp_path / "mxfp4") if k.endswith(("_blocks", "_scales")))
    _check_same_layout(tmp_path / "mxfp4", tmp_path / "out", set(summary.merged))
    ids = samples.input_ids()
    fresh = kt_ops.hf.from_pretrained(tmp_path / "mxfp4", progress=False)
    merged = _logits_check(tmp_path / "out", patched, fresh, float_model, ids)

    stock = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(stock(input_ids=ids).logits, merged(input_ids=ids).logits) <= 1e-5


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
def test_nvfp4_merged_as_nvfp4(tmp_path, convention):
    float_model = samples.tiny_qwen3_moe(torch.float32)
    float_model.save_pretrained(tmp_path / "float")
    fp4.write_nvfp4(str(tmp_path / "float"), str(tmp_path / "nvfp4"), str(tmp_path / "twin"), convention)
    patched = _adapter(tmp_path / "nvfp4", tmp_path / "adapter", attention=True)
    summary = kt_ops.hf.merge_adapter(tmp_path / "nvfp4", tmp_path / "adapter", tmp_path / "out", progress=False)
    base, out = _check_same_layout(tmp_path / "nvfp4", tmp_path / "out", set(summary.merged))
    assert any("self_attn" in k for k in summary.merged) and any(".experts." in k for k in summary.merged)

    # element by element against the adapter merged into the float twin (the base's exact values)
    kt_ops.hf.merge_adapter(tmp_path / "twin", tmp_path / "adapter", tmp_path / "exact", progress=False)
    exact = _tensors(tmp_path / "exact")
    values = ".weight" if convention == "modelopt" else ".weight_packed"
    global_key = ".weight_scale_2" if convention == "modelopt" else ".weight_global_scale"
    checked = 0
    for key in summary.merged:
        if not key.endswith(values):
            continue
        name = key[: -len(values)]
        parts = {("value" if convention == "modelopt" else "fp4_packed"): out[key],
                 "fp4_scale": out[name + ".weight_scale"],
                 ("global_scale" if convention == "modelopt" else "global_scale_inv"): out[name + global_key]}
        matrix = StoredMatrix.from_parts(parts, name + ".weight")
        got, want = matrix.to_float(), exact[name + ".weight"].float()
        step = (matrix.scale.float() * matrix.global_scale.float()).repeat_interleave(16, 1)
        y = (want / step).abs()
        half = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
        bound = step * torch.where(y <= 6, half, y - 6)
        slack = 1e-6 * want.abs() + 1e-12  # float32 rounding of the comparison itself
        assert bool(((got - want).abs() <= bound + slack).all()), key
        checked += 1
    assert checked == len([k for k in summary.merged if k.endswith(values)]) and checked > 0

    ids = samples.input_ids()
    fresh = kt_ops.hf.from_pretrained(tmp_path / "nvfp4", progress=False)
    _logits_check(tmp_path / "out", patched, fresh, float_model, ids)


def test_deepseek_v4_fp4_experts_merged_as_fp4(tmp_path):
    """DeepSeek-V4-Flash's layout: experts' int8-packed E2M1 with E8M0 scales, stored per expert
    under transformers' renamed names (``ffn.experts.{e}.w1``), FP8 linears beside them."""
    import hf_families

    float_model = fp4.tiny_deepseek_v4()
    float_model.save_pretrained(tmp_path / "float")
    fp4.write_deepseek_v4_fp4(str(tmp_path / "float"), str(tmp_path / "fp4"), str(tmp_path / "twin"))
    patched = _adapter(tmp_path / "fp4", tmp_path / "adapter", attention=False, scale=0.3)
    summary = kt_ops.hf.merge_adapter(tmp_path / "fp4", tmp_path / "adapter", tmp_path / "out", progress=False)
    assert summary.merged and all(".ffn.experts." in k for k in summary.merged)
    _check_same_layout(tmp_path / "fp4", tmp_path / "out", set(summary.merged))
    merged = kt_ops.hf.from_pretrained(tmp_path / "out", progress=False)
    base = kt_ops.hf.from_pretrained(tmp_path / "fp4", progress=False)
    # the yardstick: the experts alone quantized afresh (the FP8 linears are not re-quantized here)
    fresh = kt_ops.hf.from_pretrained(tmp_path / "float", expert_format="mxfp4", progress=False)
    float_experts = kt_ops.hf.from_pretrained(tmp_path / "float", progress=False)
    ids = hf_families.input_ids()
    with torch.no_grad():
        want = hf_families.run(patched, ids).logits
        own = rel_err(hf_families.run(fresh, ids).logits, hf_families.run(float_experts, ids).logits)
        assert rel_err(hf_families.run(base, ids).logits, want) > 2 * own
        err = rel_err(hf_families.run(merged, ids).logits, want)
    print(f"DeepSeek-V4: logits vs the patched model with the adapter {err:.2e}; one fresh FP4 quantization {own:.2e}")
    assert err <= 2 * own
