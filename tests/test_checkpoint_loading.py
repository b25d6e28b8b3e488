"""kt_ops.hf.from_pretrained: checkpoints as they ship, straight into the patched model.

* float checkpoints (per expert as save_pretrained writes them, fused, sharded; fp32 and bf16):
  the same model as transformers' from_pretrained + patch_model (every tensor equal, LoRA
  included, equal logits), for Qwen3-MoE, DeepSeek-V3 and every covered family;
* FP8 block, compressed-tensors FP8 (per block, per tensor, per channel), compressed-tensors
  INT8 (per channel, per tensor) and INT4, and GPTQ INT4 checkpoints written by the tests: the
  logits of the float checkpoint of their dequantized values; kept in their format they are
  copied as stored (the quantizer is never called, the bytes are the checkpoint's, GPTQ's
  repacked); requantized as asked;
* what goes wrong is named: a missing expert, an extra tensor, a wrong shape, an FP8 weight
  without its scale (or with a scale of no known shape), a quantization kt_ops does not read.
"""
import json
import os
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
from kt_ops import quantization  # noqa: E402
from kt_ops.hf import from_pretrained  # noqa: E402
from kt_ops.hf.patch import patched_experts  # noqa: E402
from test_hf_patching import rel_err  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(path, dtype, seed=0, model_class=None, **patch_kwargs):
    """transformers' from_pretrained + patch_model, the LoRA drawn from ``seed``."""
    cls = model_class or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype)
    torch.manual_seed(seed)
    return kt_ops.patch_model(model, **patch_kwargs)


def loaded(path, seed=0, **kwargs):
    torch.manual_seed(seed)
    return from_pretrained(path, progress=False, **kwargs)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k
    assert [(n, p.requires_grad) for n, p in a.named_parameters()] == [(n, p.requires_grad) for n, p in b.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["per_expert", "fused", "sharded"])
def test_float_checkpoint_is_the_patched_model(tmp_path, layout, dtype):
    model = samples.tiny_qwen3_moe(dtype)
    kwargs = {"save_original_format": False} if layout == "fused" else {}
    if layout == "sharded":
        kwargs["max_shard_size"] = "40KB"  # several shards; a weight and its neighbours apart
    model.save_pretrained(tmp_path, **kwargs)
    if layout == "sharded":
        assert len(set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())) > 3
    ours = loaded(tmp_path, lora_rank=4, lora_alpha=8)
    ref = reference(tmp_path, dtype, lora_rank=4, lora_alpha=8)
    assert_same_model(ours, ref)
    ids = samples.input_ids()
    assert torch.equal(logits(ours, ids), logits(ref, ids))
    assert not ours.training and ours.generation_config is not None


def test_tied_embeddings(tmp_path):
    """A checkpoint of a model with tied input/output embeddings holds the embedding once."""
    samples.tiny_qwen3_moe(tie_word_embeddings=True).save_pretrained(tmp_path)
    ours = loaded(tmp_path, lora_rank=2)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ref = reference(tmp_path, torch.float32, lora_rank=2)
    assert_same_model(ours, ref)
    ids = samples.input_ids()
    assert torch.equal(logits(ours, ids), logits(ref, ids))


def test_fp16_checkpoint_into_another_dtype(tmp_path):
    samples.tiny_qwen3_moe(torch.float16).save_pretrained(tmp_path)
    ours = loaded(tmp_path, dtype=torch.float32, expert_format="int8")
    ref = reference(tmp_path, torch.float32, expert_format="int8")
    assert_same_model(ours, ref)
    assert ours.model.embed_tokens.weight.dtype == torch.float32


def test_deepseek_v3_with_lora_trains(tmp_path):
    model = samples.tiny_deepseek_v3()
    model.save_pretrained(tmp_path)
    ours = loaded(tmp_path, lora_rank=4)
    ref = reference(tmp_path, torch.float32, lora_rank=4)
    assert_same_model(ours, ref)
    ids = samples.input_ids()
    ours.train()
    for n, p in ours.named_parameters():
        p.requires_grad_("lora" in n)
    loss = ours(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [p.grad for n, p in ours.named_parameters() if "lora_a" in n or "lora_b" in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("expert_format", ["fp8", None, "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_checkpoint(tmp_path, monkeypatch, expert_format, dtype):
    samples.tiny_deepseek_v3(dtype).save_pretrained(tmp_path / "float")
    samples.write_fp8(tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized")
    # kept as stored (quantizing anything would be a detour): against float experts holding its
    # values; else what patch_model makes of them
    ours, ref = _against_dequantized(monkeypatch, tmp_path / "fp8", tmp_path / "dequantized", expert_format,
                                     kept=expert_format == "fp8", dtype=dtype)
    if expert_format == "fp8":
        name, kt = patched_experts(ours)[0]
        stored = _stored(tmp_path / "fp8", f"{name}.2.up_proj.weight")
        assert torch.equal(kt.up_proj[2].view(torch.uint8), stored.view(torch.uint8))
        assert torch.equal(kt.up_scale[2], _stored(tmp_path / "fp8", f"{name}.2.up_proj.weight_scale_inv"))
    else:  # requantized (or dequantized) from the FP8 values: what patch_model makes of them
        assert_same_model(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("expert_format", ["fp8", None])
@pytest.mark.parametrize("strategy", ["block", "tensor", "channel"])
def test_compressed_tensors_fp8_checkpoint(tmp_path, monkeypatch, strategy, expert_format, dtype):
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "float")
    samples.write_compressed_fp8(tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized", strategy)
    as_stored = expert_format == "fp8" and strategy != "channel"  # per-channel scales fit no kt format
    ours, ref = _against_dequantized(monkeypatch, tmp_path / "fp8", tmp_path / "dequantized", expert_format,
                                     kept=as_stored, dtype=dtype)
    name, kt = patched_experts(ours)[1]
    if as_stored:
        stored = _stored(tmp_path / "fp8", f"{name}.2.up_proj.weight")
        assert torch.equal(kt.up_proj[2].view(torch.uint8), stored.view(torch.uint8))
        scale = _stored(tmp_path / "fp8", f"{name}.2.up_proj.weight_scale").float()
        assert torch.equal(kt.up_scale[2], scale if strategy == "block" else scale.expand_as(kt.up_scale[2]))
    else:  # dequantized, or requantized from the FP8 values: what patch_model makes of them
        assert_same_model(ours, ref)


@pytest.mark.parametrize("expert_format", ["int8", None, "int4"])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_int8_checkpoint(tmp_path, monkeypatch, strategy, expert_format):
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "float")
    samples.write_compressed_int8(tmp_path / "float", tmp_path / "int8", tmp_path / "dequantized", strategy)
    ours, ref = _against_dequantized(monkeypatch, tmp_path / "int8", tmp_path / "dequantized", expert_format,
                                     kept=expert_format == "int8")
    name, kt = patched_experts(ours)[0]
    if expert_format == "int8":
        assert torch.equal(kt.gate_proj[1], _stored(tmp_path / "int8", f"{name}.1.gate_proj.weight"))
        scale = _stored(tmp_path / "int8", f"{name}.1.gate_proj.weight_scale").float().reshape(-1)
        assert torch.equal(kt.gate_scale[1], scale.expand_as(kt.gate_scale[1]))
    else:
        assert_same_model(ours, ref)


@pytest.mark.parametrize("expert_format", ["int4", None, "int8"])
def test_compressed_tensors_int4_checkpoint(tmp_path, monkeypatch, expert_format):
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "float")
    samples.write_int4(tmp_path / "float", tmp_path / "int4", tmp_path / "dequantized")
    # int4: no detour through bf16
    ours, ref = _against_dequantized(monkeypatch, tmp_path / "int4", tmp_path / "dequantized", expert_format,
                                     kept=expert_format == "int4")
    name, kt = patched_experts(ours)[1]
    if expert_format == "int4":
        assert kt.group_size == 32  # the checkpoint's
        packed = _stored(tmp_path / "int4", f"{name}.3.down_proj.weight_packed")
        assert torch.equal(kt.down_proj[3], packed.view(torch.uint8))
        assert torch.equal(kt.down_scale[3], _stored(tmp_path / "int4", f"{name}.3.down_proj.weight_scale"))
    else:
        assert_same_model(ours, ref)


@pytest.mark.parametrize("expert_format,checkpoint_format", [("int4", "gptq"), ("int4", "gptq_v2"), (None, "gptq"),
                                                              ("int8", "gptq")])
def test_gptq_int4_checkpoint(tmp_path, monkeypatch, expert_format, checkpoint_format):
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "float")
    samples.write_gptq(tmp_path / "float", tmp_path / "gptq", tmp_path / "dequantized",
                       checkpoint_format=checkpoint_format)
    # int4: the 4-bit values repacked, not requantized
    ours, ref = _against_dequantized(monkeypatch, tmp_path / "gptq", tmp_path / "dequantized", expert_format,
                                     kept=expert_format == "int4")
    name, kt = patched_experts(ours)[1]
    if expert_format == "int4":
        assert kt.group_size == 32  # the checkpoint's
        weight = samples.tiny_qwen3_moe().state_dict()[f"{name}.gate_up_proj"][3, 32:]  # expert 3's up_proj
        _, q, _ = samples.pack_gptq(weight, 32)
        assert torch.equal(kt.up_proj[3], q[:, 0::2] | (q[:, 1::2] << 4))  # kt's bytes: column 2j low nibble
        scales = _stored(tmp_path / "gptq", f"{name}.3.up_proj.scales")
        assert kt.up_scale.dtype == torch.float32 and torch.equal(kt.up_scale[3], scales.t().float())
    else:
        assert_same_model(ours, ref)


@pytest.mark.parametrize("edit,match", [
    ("qzeros", r"up_proj\.qzeros: zero points other than the symmetric one \(7 stored\)"),
    ("g_idx", r"up_proj\.g_idx reorders the input columns' groups"),
])
def test_gptq_asymmetric_or_reordered_is_named(float_checkpoint, tmp_path, edit, match):
    samples.write_gptq(float_checkpoint, tmp_path / "gptq", tmp_path / "ref")
    key = "model.layers.0.mlp.experts.1.up_proj." + edit

    def change(k, t):
        if k != key:
            return {k: t}
        return {k: t + 1 if edit == "qzeros" else t.flip(0)}
    path = _edited(tmp_path / "gptq", tmp_path / "c", change, samples.gptq_config())
    with pytest.raises(ValueError, match=match):
        from_pretrained(path, progress=False, expert_format="int4")


def test_compressed_tensors_int4_float32_scales_copied_exactly(tmp_path):
    """Int4 scales stored in float32 are held in float32 (kt's bf16 default would round them)."""
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "float")
    samples.write_int4(tmp_path / "float", tmp_path / "int4", tmp_path / "dequantized")

    def finer(k, t):  # float32 scales that bf16 cannot hold
        return {k: t.float() * (1 + 2**-12) if k.endswith(".weight_scale") else t}
    path = _edited(tmp_path / "int4", tmp_path / "f32", finer, samples.int4_config())
    ours = from_pretrained(path, progress=False, expert_format="int4")
    name, kt = patched_experts(ours)[1]
    assert kt.down_scale.dtype == torch.float32
    assert torch.equal(kt.down_scale[3], _stored(path, f"{name}.3.down_proj.weight_scale"))


def test_int4_checkpoint_into_other_groups(tmp_path):
    samples.tiny_qwen3_moe(moe_intermediate_size=64).save_pretrained(tmp_path / "float")
    samples.write_int4(tmp_path / "float", tmp_path / "int4", tmp_path / "dequantized")
    ours = loaded(tmp_path / "int4", expert_format="int4", group_size=64)
    ref = reference(tmp_path / "dequantized", torch.float32, expert_format="int4", group_size=64)
    assert_same_model(ours, ref)


def _against_dequantized(monkeypatch, stored, dequantized, expert_format, kept, dtype=torch.float32):
    """Loads checkpoint ``stored`` into ``expert_format`` (with the quantizer forbidden when the
    checkpoint's format is ``kept`` as stored) and checks its logits against transformers' load
    of ``dequantized``, the float checkpoint of its values, + patch_model (float experts when
    kept, else the same ``expert_format``). Returns (ours, that reference)."""
    if kept:
        monkeypatch.setattr(quantization, "quantize", _no_quantize)
    ours = loaded(stored, expert_format=expert_format, dtype=dtype)
    monkeypatch.undo()
    ref = reference(dequantized, dtype, expert_format=None if kept else expert_format)
    ids = samples.input_ids()
    assert rel_err(logits(ours, ids), logits(ref, ids)) <= TOL[dtype]
    return ours, ref


def _no_quantize(*args, **kwargs):
    raise AssertionError("quantize called: the checkpoint's format should have been copied as stored")


def _stored(path, key):
    from safetensors import safe_open
    from kt_ops.hf.shards import shard_files

    for file in shard_files(str(path)):
        with safe_open(file, "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise KeyError(key)


# --------------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    samples.tiny_qwen3_moe().save_pretrained(path)
    return path


def _edited(src, dst, transform, quantization_config=None):
    samples.rewrite(str(src), str(dst), transform, quantization_config)
    return dst


def test_missing_expert_is_named(float_checkpoint, tmp_path):
    drop = "model.layers.1.mlp.experts.2.up_proj.weight"
    path = _edited(float_checkpoint, tmp_path / "c", lambda k, t: {} if k == drop else {k: t})
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.experts\.\{2\}\.up_proj\.weight"):
        from_pretrained(path, progress=False)


def test_missing_weight_is_named(float_checkpoint, tmp_path):
    drop = "model.layers.0.self_attn.k_norm.weight"
    path = _edited(float_checkpoint, tmp_path / "c", lambda k, t: {} if k == drop else {k: t})
    with pytest.raises(ValueError, match=r"missing: model\.layers\.0\.self_attn\.k_norm\.weight"):
        from_pretrained(path, progress=False)


def test_extra_tensor_is_named(float_checkpoint, tmp_path):
    def add(k, t):
        return {k: t, "model.layers.0.mlp.extra_bias": torch.zeros(3)} if k.endswith("layers.0.input_layernorm.weight") \
            else {k: t}
    path = _edited(float_checkpoint, tmp_path / "c", add)
    with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.mlp\.extra_bias"):
        from_pretrained(path, progress=False)


def test_expert_out_of_range_is_named(float_checkpoint, tmp_path):
    def add(k, t):
        if k == "model.layers.0.mlp.experts.0.down_proj.weight":
            return {k: t, "model.layers.0.mlp.experts.9.down_proj.weight": t.clone()}
        return {k: t}
    path = _edited(float_checkpoint, tmp_path / "c", add)
    with pytest.raises(ValueError, match=r"experts\.9\.down_proj\.weight: expert 9, but .* has 4 experts"):
        from_pretrained(path, progress=False)


@pytest.mark.parametrize("key,what", [("model.layers.0.mlp.experts.1.gate_proj.weight", "of one expert"),
                                      ("model.layers.1.self_attn.q_proj.weight", "the model's")])
def test_wrong_shape_is_named(float_checkpoint, tmp_path, key, what):
    path = _edited(float_checkpoint, tmp_path / "c", lambda k, t: {k: t[:, :-1].contiguous() if k == key else t})
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')} has shape .*{what}"):
        from_pretrained(path, progress=False)


def test_fp8_weight_without_scale_is_named(float_checkpoint, tmp_path):
    samples.write_fp8(float_checkpoint, tmp_path / "fp8", tmp_path / "ref")
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    path = _edited(tmp_path / "fp8", tmp_path / "c", lambda k, t: {} if k == key + "_scale_inv" else {k: t},
                   samples.FP8_CONFIG)
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')} is float8_e4m3fn without .*_scale_inv"):
        from_pretrained(path, progress=False)


def test_compressed_fp8_scale_missing_or_misshapen_is_named(float_checkpoint, tmp_path):
    samples.write_compressed_fp8(float_checkpoint, tmp_path / "fp8", tmp_path / "ref", "block")
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    scale = key[: -len(".weight")] + ".weight_scale"
    config = samples.compressed_fp8_config("block")
    path = _edited(tmp_path / "fp8", tmp_path / "c", lambda k, t: {} if k == scale else {k: t}, config)
    with pytest.raises(ValueError, match=f"{re.escape(key)} is float8_e4m3fn without {re.escape(scale)}"):
        from_pretrained(path, progress=False)
    path = _edited(tmp_path / "fp8", tmp_path / "d", lambda k, t: {k: t[:, :1].repeat(1, 3) if k == scale else t},
                   config)
    with pytest.raises(ValueError, match=f"{re.escape(scale)}: expected float32/bfloat16 scales"):
        from_pretrained(path, progress=False)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_compressed_tensors_zero_point_is_named(float_checkpoint, tmp_path, fmt):
    """A zero-point tensor (asymmetric weights) is refused even where the config says symmetric."""
    write = samples.write_int4 if fmt == "int4" else samples.write_compressed_int8
    write(float_checkpoint, tmp_path / "q", tmp_path / "ref")
    config = samples.int4_config() if fmt == "int4" else samples.compressed_int8_config()
    scale = "model.layers.1.mlp.experts.2.down_proj.weight_scale"

    def add(k, t):
        zero = {k.replace("_scale", "_zero_point"): torch.zeros_like(t, dtype=torch.int8)} if k == scale else {}
        return {k: t, **zero}
    path = _edited(tmp_path / "q", tmp_path / "c", add, config)
    with pytest.raises(ValueError, match=r"down_proj\.weight_zero_point: asymmetric quantization \(zero points\)"):
        from_pretrained(path, progress=False)


def _fp8_group(**changes):
    group = samples.compressed_fp8_config("block")["config_groups"]["group_0"]
    weights = {**group["weights"], **changes.pop("weights", {})}
    return {**samples.compressed_fp8_config("block"), "config_groups": {"g": {**group, "weights": weights, **changes}}}


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method is 'awq'"),
    ({**samples.gptq_config(), "sym": False}, r"quantization_config\.sym is False"),
    ({**samples.gptq_config(), "desc_act": True}, r"quantization_config\.desc_act is True"),
    ({**samples.gptq_config(), "bits": 8}, r"quantization_config\.bits is 8"),
    ({**samples.gptq_config(), "group_size": -1}, r"quantization_config\.group_size is -1"),
    ({**samples.gptq_config(), "checkpoint_format": "marlin"}, r"checkpoint_format is 'marlin'"),
    (_fp8_group(input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     r"config_groups\.g\.input_activations\.dynamic is False"),
    (_fp8_group(weights={"strategy": "group", "group_size": 128}), r"config_groups\.g\.weights\.strategy is 'group'"),
    (_fp8_group(weights={"block_structure": [64, 64]}), r"block_structure is \[64, 64\]"),
    (_fp8_group(weights={"num_bits": 4}), r"config_groups\.g\.weights\.strategy is 'block'; kt_ops reads NVFP4"),
    ({**samples.int4_config(), "config_groups": {**samples.int4_config()["config_groups"],
      **_fp8_group()["config_groups"]}}, r"mix weight kinds \{'fp8': \['g'\], 'int4': \['group_0'\]\}"),
    ({**samples.compressed_int8_config(), "config_groups": {"g": {
        **samples.compressed_int8_config()["config_groups"]["group_0"],
        "weights": {**samples.compressed_int8_config()["config_groups"]["group_0"]["weights"], "strategy": "group",
                    "group_size": 128}}}}, r"config_groups\.g\.weights\.strategy is 'group'"),
    ({**samples.compressed_int8_config(), "format": "pack-quantized", "config_groups": {"g": {
        **samples.compressed_int8_config()["config_groups"]["group_0"], "format": "pack-quantized"}}},
     r"config_groups\.g: format is 'pack-quantized'; kt_ops reads INT8 weights 'int-quantized'"),
    ({**samples.FP8_CONFIG, "weight_block_size": [64, 64]}, r"weight_block_size is \[64, 64\]"),
    ({**samples.int4_config(), "config_groups": {"g": {**samples.int4_config()["config_groups"]["group_0"],
      "weights": {**samples.int4_config()["config_groups"]["group_0"]["weights"], "symmetric": False}}}},
     r"config_groups\.g\.weights\.symmetric is False"),
])
def test_unknown_quantization_is_named(float_checkpoint, tmp_path, config, match):
    path = _edited(float_checkpoint, tmp_path / "c", lambda k, t: {k: t}, config)
    with pytest.raises(ValueError, match=match):
        from_pretrained(path, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="local checkpoint directory"):
        from_pretrained(tmp_path / "nope")
    shutil.copy(os.devnull, tmp_path / "config.json")
    with pytest.raises(ValueError, match="no model.safetensors"):
        from_pretrained(tmp_path)


# --------------------------------------------------------------------------- every family

def _covered_families():
    from hf_families import classify, discover

    return [f for f in discover() if classify(f)[0] == "covered"]


# Covered families (patch_model) whose hub layout kt_ops' loader refuses, by name, with the
# transformers conversion it does not replay: ERNIE-4.5-VL stores text and vision experts in one
# per-expert list that transformers splits by index. (Transposed, interleaved and biased experts,
# Aria's and gpt-oss's, load: kt_ops.hf.expert_layout.)
LOADER_REFUSES = {"ernie4_5_vl_moe": "ErnieFuseAndSplitTextVisionExperts"}


@pytest.mark.parametrize("family", _covered_families(), ids=lambda f: f.name)
def test_every_covered_family_loads(tmp_path, family):
    """save_pretrained's checkpoint (the family's hub layout, through transformers' conversion
    mapping) gives the model from_pretrained + patch_model gives (or, for LOADER_REFUSES, a
    ValueError naming the conversion)."""
    from hf_families import input_ids as family_ids, run, tiny_model

    tiny_model(family).save_pretrained(tmp_path)
    if family.name in LOADER_REFUSES:
        with pytest.raises(ValueError, match=f"checkpoint: .*{LOADER_REFUSES[family.name]}.*kt_ops reads experts"):
            loaded(tmp_path, lora_rank=2)
        return
    ours = loaded(tmp_path, lora_rank=2)
    ref = reference(tmp_path, torch.float32, model_class=family.model_class, lora_rank=2)
    assert_same_model(ours, ref)
    ids = family_ids()
    with torch.no_grad():  # equal tensors; the linear-attention families' reference kernels round by alignment
        assert rel_err(run(ours, ids).logits, run(ref, ids).logits) <= 1e-6


# --------------------------------------------------------------------------- two ranks

def _load_on_rank(rank, world_size, path, ids):
    """One rank of a 2-rank load: every tensor whose data it reads is recorded (safetensors'
    get_tensor, or slicing a get_slice: reading a header is not reading data)."""
    import kt_ops.hf.shards as shards

    read = []
    real_open = shards.safe_open

    class RecordingSlice:
        def __init__(self, key, s):
            self.key, self.s = key, s

        def __getitem__(self, index):
            read.append(self.key)
            return self.s[index]

        def __getattr__(self, name):
            return getattr(self.s, name)

    class RecordingOpen:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def get_slice(self, key):
            return RecordingSlice(key, self.f.get_slice(key))

    shards.safe_open = RecordingOpen
    model = from_pretrained(path, lora_rank=2, progress=False)
    experts = patched_experts(model)
    held = sum(kt.expert_nbytes() for _, kt in experts)
    expert_params = [n for n, p in model.named_parameters() if ".experts." in n and p.numel() > 1]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return read, held, expert_params, out


def test_two_ranks_only_the_owner_reads_experts(tmp_path):
    from distributed_harness import check_all_ok, run_ranks

    samples.tiny_qwen3_moe().save_pretrained(tmp_path, max_shard_size="60KB")
    ids = samples.input_ids()
    with torch.no_grad():
        want = loaded(tmp_path, lora_rank=2)(input_ids=ids, use_cache=False).logits
    (read0, held0, params0, out0), (read1, held1, params1, out1) = check_all_ok(
        run_ranks(_load_on_rank, 2, str(tmp_path), ids, timeout_s=180))
    expert_keys = [k for k in read0 if samples.EXPERT_KEY.search(k)]
    assert len(expert_keys) == 2 * 4 * 3  # the owner read every expert matrix once
    assert [k for k in read1 if ".experts." in k] == []  # rank 1 read none
    assert len(read1) == len(read0) - len(expert_keys)  # ... and every other tensor
    assert held0 > 0 and held1 == 0 and params1 == []
    assert rel_err(out0, want) <= 1e-6 and rel_err(out1, want) <= 1e-6


def test_progress_bar_and_read_counts(float_checkpoint, capsys):
    model = from_pretrained(float_checkpoint)
    assert "Loading checkpoint" in capsys.readouterr().err
    stats = model.kt_load_stats
    assert stats["expert_tensors_read"] == 2 * 4 * 3
    assert stats["bytes_read"] == os.path.getsize(float_checkpoint / "model.safetensors") - _header_bytes(
        float_checkpoint / "model.safetensors")


def _header_bytes(file):
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_shard_reader_remaps_after_remap_bytes(float_checkpoint):
    """The mapping is dropped and reopened once remap_bytes were read from it (touched pages
    of a mapping stay resident until it closes)."""
    from kt_ops.hf.shards import ShardReader, tensor_refs

    file = str(float_checkpoint / "model.safetensors")
    refs = sorted(tensor_refs(file), key=lambda r: r.key)[:6]
    reader = ShardReader(file, remap_bytes=1)  # every read fills the budget
    handles = []
    for ref in refs:
        value = reader.read(ref)
        assert tuple(value.shape) == ref.shape
        handles.append(reader._handle)  # kept alive: ids stay distinct
    assert len({id(h) for h in handles}) == 6
    assert reader.tensors_read == 6 and reader.bytes_read == sum(r.nbytes for r in refs)
    reader = ShardReader(file, remap_bytes=sum(r.nbytes for r in refs))  # room for all six: one mapping
    handles = []
    for ref in refs:
        reader.read(ref)
        handles.append(reader._handle)
    assert len({id(h) for h in handles}) == 1
