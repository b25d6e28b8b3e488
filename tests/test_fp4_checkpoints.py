"""kt_ops.hf.from_pretrained: FP4 checkpoints as they ship (tests/fp4_checkpoint_samples.py).

* the layouts: gpt-oss's MXFP4 blocks read as transformers' own dequantization reads them
  (``convert_moe_packed_tensors``; gate rows even, up rows odd), NVFP4 as compressed-tensors
  (``scale / weight_global_scale``: to one float32 rounding) and ModelOpt (``scale *
  weight_scale_2``: exactly) read it;
* kept as ``"mxfp4"`` / ``"nvfp4"``: the stored bytes copied (byte-identical, the quantizer
  never called), the logits those of transformers' dequantized gpt-oss
  (``Mxfp4Config(dequantize=True)``, on the CPU) or of the float checkpoint of the NVFP4 values,
  within fp32 1e-5 / bf16 1e-2; their LoRA trains, the base bytes untouched;
* into another expert_format: dequantized (None: the same model as transformers'
  from_pretrained of the dequantized weights + patch_model) or requantized as patch_model does;
* what kt_ops cannot honour is refused by name: config fields, missing or misshapen tensors.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
import fp4_checkpoint_samples as fp4  # noqa: E402
from kt_ops import quantization  # noqa: E402
from kt_ops.hf import from_pretrained  # noqa: E402
from kt_ops.hf.checkpoint_formats import CheckpointQuantization, StoredMatrix  # noqa: E402
from kt_ops.hf.patch import patched_experts  # noqa: E402
from test_checkpoint_loading import (TOL, _edited, _no_quantize, _stored, assert_same_model, loaded,  # noqa: E402
                                     logits, reference)
from test_hf_patching import rel_err  # noqa: E402

CONVENTIONS = ["compressed-tensors", "modelopt", "modelopt-hf_quant_config"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# --------------------------------------------------------------------------- layouts

def test_gpt_oss_blocks_read_as_transformers_reads_them():
    """kt's mxfp4 of one expert is the checkpoint's bytes, and dequantizes to what transformers'
    convert_moe_packed_tensors makes of them, gate rows even and up rows odd (GptOssExperts)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    E, I, H = 3, 64, 96
    w = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(45)) * torch.logspace(-3, 2, H)  # block exponents over a wide range
    blocks, scales, _ = fp4.quantize_mxfp4(w)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]: the model's layout
    for e in range(E):
        m = StoredMatrix.from_parts({"mx_blocks": blocks[e], "mx_scales": scales[e]}, "experts.gate_up_proj")
        assert m.fmt == "mxfp4" and m.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(m.data, blocks[e].reshape(2 * I, H // 2))  # the bytes, reshaped only
        assert torch.equal(m.scale.view(torch.uint8), scales[e])
        gate, up = m.rows(slice(0, None, 2)), m.rows(slice(1, None, 2))
        assert torch.equal(gate.to_float(), theirs[e, :, 0::2].t())
        assert torch.equal(up.to_float(), theirs[e, :, 1::2].t())
        assert torch.equal(gate.data, blocks[e, 0::2].reshape(I, H // 2))


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
def test_nvfp4_read_as_its_producer_reads_it(convention):
    """Low nibble first; compressed-tensors' weight = e2m1 * scale / weight_global_scale (kt:
    times 1 / weight_global_scale, one float32 rounding apart), ModelOpt's e2m1 * scale *
    weight_scale_2 (exactly kt's)."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(60)) * torch.logspace(-2, 1, 128)
    packed, scale, stored_global, _ = fp4.quantize_nvfp4(w, convention)
    if convention == "modelopt":
        parts = {"value": packed, "fp4_scale": scale, "global_scale": stored_global}
        theirs = fp4._unpack(packed).reshape(48, 8, 16) * (scale.float() * stored_global)[..., None]
    else:
        parts = {"fp4_packed": packed, "fp4_scale": scale, "global_scale_inv": stored_global}
        theirs = fp4._unpack(packed).reshape(48, 8, 16) * (scale.float() / stored_global)[..., None]
    m = StoredMatrix.from_parts(parts, "x.weight")
    assert m.fmt == "nvfp4" and m.data is packed and torch.equal(m.scale.view(torch.uint8), scale.view(torch.uint8))
    want_global = stored_global if convention == "modelopt" else torch.reciprocal(stored_global)
    assert m.global_scale.dtype == torch.float32 and torch.equal(m.global_scale, want_global.reshape(()))
    ours, theirs = m.to_float(), theirs.reshape(48, 128)
    if convention == "modelopt":
        assert torch.equal(ours, theirs)
    else:
        # 1 / g and the product round once each (2^-24 apiece), their division once: 3 · 2^-24
        torch.testing.assert_close(ours, theirs, rtol=3 * 2.0 ** -24, atol=0)


@pytest.mark.parametrize("config,parsed", [
    (fp4.GPT_OSS_MXFP4_CONFIG, ("mxfp4", "mxfp4", False)),
    (fp4.compressed_nvfp4_config(), ("nvfp4", "compressed-tensors", False)),
    (fp4.compressed_nvfp4_config(activations=False), ("nvfp4", "compressed-tensors", False)),
    (fp4.modelopt_config(), ("nvfp4", "modelopt", False)),
    ({"quant_method": "modelopt", **fp4.modelopt_hf_quant_config(kv_cache=True)}, ("nvfp4", "modelopt", True)),
    ({**fp4.modelopt_config(), "quant_algo": "W4A16_NVFP4", "quant_method": "modelopt_fp4"},
     ("nvfp4", "modelopt", False)),
])
def test_fp4_configs_read(config, parsed):
    stored = CheckpointQuantization.from_config(config)
    assert (stored.method, stored.quant_method, stored.kv_cache_quantized) == parsed


def _ct_group(**changes):
    config = fp4.compressed_nvfp4_config()
    group = config["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        if part in changes and changes[part] is not None:
            changes[part] = {**group[part], **changes[part]}
    return {**config, "config_groups": {"g": {**group, **changes}}}


@pytest.mark.parametrize("config,match", [
    ({**fp4.GPT_OSS_MXFP4_CONFIG, "group_size": 64}, r"quantization_config\.group_size is set"),
    (_ct_group(weights={"group_size": 32}), r"config_groups\.g\.weights\.group_size is 32; kt_ops reads NVFP4"),
    (_ct_group(weights={"strategy": "group"}), r"config_groups\.g\.weights\.strategy is 'group'"),
    (_ct_group(weights={"symmetric": False}), r"config_groups\.g\.weights\.symmetric is False"),
    (_ct_group(format="mxfp4-pack-quantized"), r"config_groups\.g: format is 'mxfp4-pack-quantized'"),
    (_ct_group(input_activations={"num_bits": 8, "strategy": "tensor", "dynamic": False}),
     r"config_groups\.g\.input_activations\.num_bits is 8; kt_ops is weight-only"),
    (_ct_group(input_activations={"dynamic": False}), r"config_groups\.g\.input_activations\.dynamic is False"),
    (_ct_group(output_activations={"num_bits": 4}), r"config_groups\.g\.output_activations is set"),
    ({**fp4.modelopt_config(), "quant_algo": "FP8"}, r"quantization_config\.quant_algo is 'FP8'"),
    ({**fp4.modelopt_config(), "quant_algo": "NVFP4_AWQ"}, r"quantization_config\.quant_algo is 'NVFP4_AWQ'"),
    ({"quant_method": "modelopt", **fp4.modelopt_hf_quant_config(), "quantization": {
        **fp4.modelopt_hf_quant_config()["quantization"], "group_size": 32}},
     r"quantization_config\.quantization\.group_size is 32"),
    ({**fp4.modelopt_config(), "config_groups": {"group_0": {
        **fp4.modelopt_config()["config_groups"]["group_0"],
        "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"}}}},
     r"config_groups\.group_0\.input_activations is 8-bit float; kt_ops is weight-only"),
    ({**fp4.modelopt_config(), "pre_quant_scale": True}, r"quantization_config\.pre_quant_scale is set"),
])
def test_fp4_config_kt_cannot_honour_is_named(config, match):
    with pytest.raises(ValueError, match=match):
        CheckpointQuantization.from_config(config)


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """{dtype: gpt-oss's MXFP4 checkpoint of a tiny gpt-oss in that dtype}."""
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        root = tmp_path_factory.mktemp(f"gpt_oss_{str(dtype)[6:]}")
        fp4.tiny_gpt_oss(dtype).save_pretrained(root / "float")
        fp4.write_gpt_oss_mxfp4(str(root / "float"), str(root / "mxfp4"))
        paths[dtype] = root / "mxfp4"
    return paths


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    """{(convention, dtype): (NVFP4 checkpoint of a tiny Qwen3-MoE, its float reference)}."""
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        root = tmp_path_factory.mktemp(f"qwen3_{str(dtype)[6:]}")
        samples.tiny_qwen3_moe(dtype).save_pretrained(root / "float")
        for convention in CONVENTIONS:
            producer, _, where = convention.partition("-")
            producer = "compressed-tensors" if producer == "compressed" else producer
            fp4.write_nvfp4(str(root / "float"), str(root / convention), str(root / f"{convention}-ref"), producer,
                            hf_quant_config_file=bool(where) and producer == "modelopt")
            paths[convention, dtype] = (root / convention, root / f"{convention}-ref")
    return paths


def _transformers_gpt_oss(path, dtype, patch=None, seed=0):
    """transformers' own CPU load of the MXFP4 checkpoint (Mxfp4Config(dequantize=True)),
    then ``patch_model(model, **patch)`` (the LoRA drawn from ``seed``) unless ``patch`` is None."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=dtype)
    if patch is None:
        return model
    torch.manual_seed(seed)
    return kt_ops.patch_model(model, **patch)


def _kt_bytes(kt, name, e):
    t = getattr(kt, name)[e].detach()
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_oss_mxfp4_kept_as_stored(gpt_oss, monkeypatch, dtype):
    path = gpt_oss[dtype]
    monkeypatch.setattr(quantization, "quantize", _no_quantize)
    ours = loaded(path, expert_format="mxfp4", dtype=dtype)
    monkeypatch.undo()
    for name, kt in patched_experts(ours):
        assert kt.expert_format == "mxfp4"
        gate_up, down = (_stored(path, f"{name}.{p}") for p in ("gate_up_proj_blocks", "down_proj_blocks"))
        gate_up_s, down_s = (_stored(path, f"{name}.{p}") for p in ("gate_up_proj_scales", "down_proj_scales"))
        bias = _stored(path, f"{name}.gate_up_proj_bias")
        E, two_i, groups, _ = gate_up.shape
        for e in range(E):
            assert torch.equal(_kt_bytes(kt, "gate_proj", e), gate_up[e, 0::2].reshape(two_i // 2, -1))
            assert torch.equal(_kt_bytes(kt, "up_proj", e), gate_up[e, 1::2].reshape(two_i // 2, -1))
            assert torch.equal(_kt_bytes(kt, "down_proj", e), down[e].reshape(down.shape[1], -1))
            assert torch.equal(_kt_bytes(kt, "gate_scale", e), gate_up_s[e, 0::2])
            assert torch.equal(_kt_bytes(kt, "up_scale", e), gate_up_s[e, 1::2])
            assert torch.equal(_kt_bytes(kt, "down_scale", e), down_s[e])
            assert torch.equal(kt.up_bias[e], bias[e, 1::2].to(dtype))
    ids = samples.input_ids()
    ref = _transformers_gpt_oss(path, dtype)
    assert rel_err(logits(ours, ids), logits(ref, ids)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_oss_mxfp4_into_float_is_transformers_dequantized(gpt_oss, dtype):
    """expert_format=None: the model transformers' dequantizing load + patch_model gives (every
    tensor equal), and the unpatched model's logits."""
    ours = loaded(gpt_oss[dtype], lora_rank=2, dtype=dtype)
    ref = _transformers_gpt_oss(gpt_oss[dtype], dtype, {"lora_rank": 2})
    assert_same_model(ours, ref)
    ids = samples.input_ids()
    assert torch.equal(logits(ours, ids), logits(ref, ids))
    plain = _transformers_gpt_oss(gpt_oss[dtype], dtype)
    assert rel_err(logits(ours, ids), logits(plain, ids)) <= TOL[dtype]


@pytest.mark.parametrize("expert_format", ["int4", "nvfp4"])
def test_gpt_oss_mxfp4_requantized(gpt_oss, expert_format):
    """Into another quantized format: what patch_model makes of transformers' dequantized model."""
    ours = loaded(gpt_oss[torch.float32], expert_format=expert_format)
    ref = _transformers_gpt_oss(gpt_oss[torch.float32], torch.float32, {"expert_format": expert_format})
    assert_same_model(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_nvfp4_kept_as_stored(nvfp4, monkeypatch, convention, dtype):
    path, ref_path = nvfp4[convention, dtype]
    monkeypatch.setattr(quantization, "quantize", _no_quantize)
    ours = loaded(path, expert_format="nvfp4", dtype=dtype)
    monkeypatch.undo()
    name, kt = patched_experts(ours)[1]
    assert kt.expert_format == "nvfp4"
    for e in range(kt.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = f"{name}.{e}.{proj}"
            packed = _stored(path, base + (".weight_packed" if convention == "compressed-tensors" else ".weight"))
            assert torch.equal(_kt_bytes(kt, proj, e), packed)
            assert torch.equal(_kt_bytes(kt, proj.replace("proj", "scale"), e),
                               _stored(path, base + ".weight_scale").view(torch.uint8))
            stored_global = (_stored(path, base + ".weight_global_scale").reshape(()).reciprocal()
                             if convention == "compressed-tensors" else _stored(path, base + ".weight_scale_2"))
            assert torch.equal(getattr(kt, proj.replace("proj", "global_scale"))[e], stored_global)
    ref = reference(ref_path, dtype)  # float experts holding the NVFP4 values
    ids = samples.input_ids()
    assert rel_err(logits(ours, ids), logits(ref, ids)) <= TOL[dtype]


@pytest.mark.parametrize("expert_format", [None, "int4", "mxfp4"])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_nvfp4_into_another_format(nvfp4, convention, expert_format):
    """Dequantized (the non-expert NVFP4 linears too, always), then cast or requantized: the
    model from_pretrained + patch_model makes of the float checkpoint of its values."""
    path, ref_path = nvfp4[convention, torch.bfloat16]
    ours = loaded(path, expert_format=expert_format, lora_rank=2)
    ref = reference(ref_path, torch.bfloat16, expert_format=expert_format, lora_rank=2)
    assert_same_model(ours, ref)


@pytest.mark.parametrize("which", ["mxfp4", "nvfp4"])
def test_fp4_lora_trains(gpt_oss, nvfp4, which):
    """A few optimizer steps of the experts' LoRA (and the attention's, PEFT-free: the model's
    own parameters frozen) over FP4 experts: the loss falls, the base bytes stay."""
    path = gpt_oss[torch.bfloat16] if which == "mxfp4" else nvfp4["compressed-tensors", torch.bfloat16][0]
    model = loaded(path, expert_format=which, lora_rank=4, lora_alpha=8)
    base = {f"{n}.{t}": getattr(kt, t).detach().clone() for n, kt in patched_experts(model)
            for t in ("gate_proj", "up_proj", "down_proj", "gate_scale", "up_scale", "down_scale")}
    model.train()
    trained = [p for n, p in model.named_parameters() if "lora" in n]
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    assert trained
    optimizer = torch.optim.Adam(trained, lr=2e-2)
    ids = samples.input_ids()
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    for n, kt in patched_experts(model):
        for t in ("gate_proj", "up_proj", "down_proj", "gate_scale", "up_scale", "down_scale"):
            assert torch.equal(getattr(kt, t).view(torch.uint8), base[f"{n}.{t}"].view(torch.uint8)), (n, t)


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("convention,drop,match", [
    ("modelopt", ".weight_scale_2", r"experts\.1\.up_proj\.weight has no .*experts\.1\.up_proj\.weight_scale_2 \("),
    ("modelopt", ".weight_scale", r"experts\.1\.up_proj\.weight has no .*experts\.1\.up_proj\.weight_scale \("),
    ("modelopt", "", r"experts\.1\.up_proj\.weight is uint8 \(packed NVFP4\) without"),
    ("compressed-tensors", ".weight_global_scale", r"has no .*experts\.1\.up_proj\.weight_global_scale"),
    ("compressed-tensors", ".weight_packed", r"has no .*experts\.1\.up_proj\.weight_packed"),
])
def test_nvfp4_missing_tensor_is_named(nvfp4, tmp_path, convention, drop, match):
    path, _ = nvfp4[convention, torch.float32]
    base = "model.layers.0.mlp.experts.1.up_proj"
    dropped = [base + drop] if drop else [base + ".weight_scale", base + ".weight_scale_2", base + ".input_scale"]
    config = json.load(open(path / "config.json"))["quantization_config"]
    edited = _edited(path, tmp_path / "c", lambda k, t: {} if k in dropped else {k: t}, config)
    with pytest.raises(ValueError, match=match):
        from_pretrained(edited, progress=False)


def test_nvfp4_misshapen_scale_is_named(nvfp4, tmp_path):
    path, _ = nvfp4["compressed-tensors", torch.float32]
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    edited = _edited(path, tmp_path / "c", lambda k, t: {k: t[:, ::2].contiguous() if k == key else t},
                     fp4.compressed_nvfp4_config())
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}: expected torch.float8_e4m3fn scales \[64, 2\]"):
        from_pretrained(edited, progress=False)


def test_gpt_oss_scales_missing_or_misshapen_is_named(gpt_oss, tmp_path):
    path = gpt_oss[torch.float32]
    key = "model.layers.0.mlp.experts.down_proj_scales"
    edited = _edited(path, tmp_path / "c", lambda k, t: {} if k == key else {k: t}, fp4.GPT_OSS_MXFP4_CONFIG)
    with pytest.raises(ValueError, match=r"down_proj_blocks has no model\.layers\.0\.mlp\.experts\.down_proj_scales"):
        from_pretrained(edited, progress=False)
    edited = _edited(path, tmp_path / "d", lambda k, t: {k: t[..., :1].contiguous() if k == key else t},
                     fp4.GPT_OSS_MXFP4_CONFIG)
    with pytest.raises(ValueError, match=r"down_proj_blocks \[4, 64, 2, 16\] and .*down_proj_scales \[4, 64, 1\]"):
        from_pretrained(edited, progress=False)


# --------------------------------------------------------------------------- DeepSeek-V4

@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory):
    """(DeepSeek-V4-Flash-style checkpoint of a tiny DeepSeek-V4: FP4 experts, a few FP8 linears
    with E8M0 block scales; its float reference; the model class)."""
    root = tmp_path_factory.mktemp("deepseek_v4")
    model = fp4.tiny_deepseek_v4()
    model.save_pretrained(root / "float")
    fp4.write_deepseek_v4_fp4(str(root / "float"), str(root / "fp4"), str(root / "ref"))
    return root / "fp4", root / "ref", type(model)


def test_deepseek_v4_fp4_experts_read_as_transformers_reads_them(deepseek_v4):
    """transformers' own dequantizing load (FineGrainedFP8Config(dequantize=True)) of the FP4
    checkpoint is the float reference, tensor for tensor: the layout written is the one it reads."""
    path, ref_path, cls = deepseek_v4
    theirs = cls.from_pretrained(path, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    want = cls.from_pretrained(ref_path).state_dict()
    got = theirs.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k].float(), want[k].float()) for k in want)


def test_deepseek_v4_fp4_experts_kept_as_stored(deepseek_v4, monkeypatch):
    from hf_families import input_ids, run

    path, ref_path, cls = deepseek_v4
    monkeypatch.setattr(quantization, "quantize", _no_quantize)
    ours = loaded(path, expert_format="mxfp4")
    monkeypatch.undo()
    name, kt = patched_experts(ours)[0]
    stored_name = name.replace(".mlp.", ".ffn.")
    for e in range(kt.num_experts):
        for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            assert torch.equal(_kt_bytes(kt, proj, e), _stored(path, f"{stored_name}.{e}.{w}.weight").view(torch.uint8))
            assert torch.equal(_kt_bytes(kt, proj.replace("proj", "scale"), e),
                               _stored(path, f"{stored_name}.{e}.{w}.scale").view(torch.uint8))
    plain = cls.from_pretrained(ref_path)  # float experts holding the FP4 values
    with torch.no_grad():
        assert rel_err(run(ours, input_ids()).logits, run(plain, input_ids()).logits) <= TOL[torch.float32]


def test_deepseek_v4_fp4_experts_into_float(deepseek_v4):
    path, ref_path, cls = deepseek_v4
    assert_same_model(loaded(path, lora_rank=2), reference(ref_path, torch.float32, model_class=cls, lora_rank=2))
