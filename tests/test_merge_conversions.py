"""merge_adapter writing another format than the base's: ``output_format="fp8"`` (DeepSeek-V3's
128x128 blocks), ``"int8"`` and ``"int4"`` (compressed-tensors), from a float base.

* Every linear weight but the output embeddings, and every routed expert's, is written in the
  format; the rest is copied byte for byte.
* Each written weight decodes (the loader's own decoder, StoredMatrix) to the exactly merged
  float weight within the format's rounding, element by element: half a step of the int grid
  (scale / 2), or FP8's relative half-ulp (2^-4) above its subnormal range.
* kt_ops.hf.from_pretrained reads the output, and its logits equal the float model holding
  those decoded weights (fp32, 1e-5); stock transformers reads the FP8 output (dequantized to
  bf16 on a CPU) and the INT4 one (through the compressed-tensors package) within bf16's
  rounding of the same; not yet the INT8 one (its loader's limit, below).
"""
import copy
import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

import kt_ops
import checkpoint_samples as samples
from kt_ops.hf.checkpoint_formats import StoredMatrix
from moe_testing import randomize_lora, rel_err

R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def merged_float(tmp_path_factory):
    """(base dir, adapter dir, the exactly merged fp32 checkpoint, its tensors, the patched model)."""
    d = tmp_path_factory.mktemp("merge_conversions")
    base = samples.tiny_qwen3_moe()
    base.save_pretrained(d / "base")
    pm = kt_ops.hf.get_peft_model(kt_ops.patch_model(copy.deepcopy(base), lora_rank=R, lora_alpha=ALPHA),
                                  __import__("peft").LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    kt_ops.save_adapter(pm, d / "zero_adapter")  # B = 0: the base's own quantization error
    randomize_lora(pm, lambda n: "lora_b" in n.lower(), seed=1, scale=0.02)
    kt_ops.save_adapter(pm, d / "adapter")
    kt_ops.hf.merge_adapter(d / "base", d / "adapter", d / "float", progress=False)
    with safe_open(d / "float" / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return d, tensors, base, pm.eval()


def _decoded(path, fmt) -> dict:
    """The output's tensors, each quantized weight decoded to float32 ``X.weight``."""
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for key, t in stored.items():
        if key.endswith((".weight_scale", ".weight_scale_inv", ".weight_shape")):
            continue
        if key.endswith(".weight_packed"):
            name = key[: -len("_packed")]
            out[name] = StoredMatrix.from_parts({"packed": t, "group_scale": stored[name + "_scale"]}, name).to_float()
        elif t.dtype in (torch.float8_e4m3fn, torch.int8):
            scale = stored[key + ("_scale_inv" if fmt == "fp8" else "_scale")]
            out[key] = StoredMatrix.from_parts({"value": t, "value_scale": scale}, key).to_float()
        else:
            out[key] = t
    return out, stored


def _float_model(d, tensors: dict, name: str):
    """The model of float checkpoint ``tensors`` (the base's config), as transformers loads it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    (d / name).mkdir()
    save_file(tensors, d / name / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(d / "float" / "config.json", d / name / "config.json")
    return AutoModelForCausalLM.from_pretrained(d / name).eval()


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_conversion_within_rounding_and_loads(merged_float, fmt):
    d, exact, base, patched = merged_float
    out = d / f"out_{fmt}"
    summary = kt_ops.hf.merge_adapter(d / "base", d / "adapter", out, output_format=fmt, progress=False)
    decoded, stored = _decoded(out, fmt)
    assert decoded.keys() == exact.keys()

    linear = {k for k in exact if k.endswith(("_proj.weight",)) and ".mlp.gate." not in k}
    assert {n for n in summary.converted} == linear  # attention and every expert's; not lm_head, router, norms
    for key, want in exact.items():
        got = decoded[key]
        if key not in linear:
            assert torch.equal(got, want), key  # copied byte for byte (lm_head and embeddings included)
            assert stored[key].dtype == want.dtype
            continue
        err = (got - want).abs()
        if fmt == "fp8":
            scale = stored[key + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[: want.shape[0], : want.shape[1]]
            bound = 2.0 ** -4 * want.abs() + scale * 2.0 ** -10  # relative half-ulp; subnormal step / 2
        elif fmt == "int8":
            bound = stored[key + "_scale"].float() / 2
        else:
            s = stored[key[: -len(".weight")] + ".weight_scale"].float()
            bound = s.repeat_interleave(want.shape[1] // s.shape[1], 1) / 2
        assert bool((err <= bound * (1 + 1e-6) + 1e-12).all()), (key, float((err - bound).max()))
        assert rel_err(got, want) > 0 or fmt == "fp8"  # quantized: not the float weights passed through

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("fp8" if fmt == "fp8" else "compressed-tensors")

    # kt_ops reads it back: the logits of the float model holding the decoded weights
    reference = _float_model(d, decoded, f"decoded_{fmt}")
    loaded = kt_ops.hf.from_pretrained(out, progress=False)
    ids = samples.input_ids()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert rel_err(loaded(input_ids=ids).logits, want) <= 1e-5
        # the quantized merge is as near the patched model with its adapter as the base quantized
        # the same way is to the base (its own quantization error, times 2)
        err = rel_err(want, patched(input_ids=ids).logits)
        kt_ops.hf.merge_adapter(d / "base", d / "zero_adapter", d / f"zero_{fmt}", output_format=fmt, progress=False)
        quantized_base = kt_ops.hf.from_pretrained(d / f"zero_{fmt}", progress=False)
        own = rel_err(quantized_base(input_ids=ids).logits, base(input_ids=ids).logits)
        print(f"{fmt}: logits vs the patched model with the adapter {err:.2e}; the base's own quantization {own:.2e}")
        assert err <= 2 * own


# transformers 5.23 with compressed-tensors 0.20.1 cannot build fused experts from per-expert INT8
# (int-quantized) tensors: its Concatenate gets none ("Ckpt contains: 0"), for checkpoint_samples'
# own INT8 checkpoints too; strict, so that the day it can, this says so.
_STOCK_INT8 = pytest.mark.xfail(strict=True, raises=subprocess.CalledProcessError,
                                reason="transformers' compressed-tensors loader: per-expert INT8 experts")


@pytest.mark.parametrize("fmt", ["fp8", pytest.param("int8", marks=_STOCK_INT8), "int4"])
def test_output_loads_in_stock_transformers(merged_float, fmt):
    """transformers' own loaders, kt_ops not imported: FP8 (dequantized to bf16 without a GPU) and
    compressed-tensors' (its package), within bf16's rounding of the decoded weights."""
    d, _, base, _ = merged_float
    out = d / f"out_{fmt}_stock"
    kt_ops.hf.merge_adapter(d / "base", d / "adapter", out, output_format=fmt, progress=False)
    decoded, _ = _decoded(out, fmt)
    reference = _float_model(d, decoded, f"decoded_{fmt}_stock")
    ids = samples.input_ids()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    torch.save({"ids": ids}, d / f"ids_{fmt}.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()
        assert "kt_ops" not in sys.modules
        with torch.no_grad():
            logits = model(input_ids=torch.load({str(d / f'ids_{fmt}.pt')!r})["ids"]).logits.float()
        assert "kt_ops" not in sys.modules
        torch.save(logits, {str(d / f'stock_logits_{fmt}.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, capture_output=True)
    got = torch.load(d / f"stock_logits_{fmt}.pt")
    print(f"{fmt}: stock transformers vs the decoded weights {rel_err(got, want):.2e}")
    assert rel_err(got, want) <= 2e-2


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu], ids=["uint8", "e8m0"])
def test_fp8_with_e8m0_scales_rounds_them_up_to_powers_of_two(scale_dtype):
    """DeepSeek-V4's FP8 linears (ue8m0 block scales) merged "same": the new scales are powers
    of two in the stored dtype, no value overflows E4M3, and the loader's decoding is the merged
    weight within FP8's rounding (a partial block included)."""
    from kt_ops.hf.merge_formats import encode_like

    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 384, generator=g) * torch.logspace(-3, 1, 384)
    like = {"value": torch.empty(200, 384, dtype=torch.float8_e4m3fn), "value_scale": torch.empty(2, 3, dtype=scale_dtype)}
    out = encode_like(like, w, "x.weight")
    assert out["value_scale"].dtype == scale_dtype and out["value_scale"].shape == (2, 3)
    scale = out["value_scale"].view(torch.float8_e8m0fnu).float()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :384]
    assert bool((w.abs() <= 448 * full).all())
    got = StoredMatrix.from_parts(out, "x.weight").to_float()
    assert bool(((got - w).abs() <= 2.0 ** -4 * w.abs() + full * 2.0 ** -10).all())
