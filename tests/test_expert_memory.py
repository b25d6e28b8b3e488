"""The routed experts' bytes per expert format, computed from shapes alone
(``quantization.expert_set_nbytes``, ``kt_ops.hf.expert_memory``): equal to what the layers and
patched models really hold, scales included (and gpt-oss's biases), and the table's models
(docs/quantization.md) read with their released shapes."""
import json

import pytest
import torch

import kt_ops
from kt_ops import KTMoE, quantization
from kt_ops.hf.patch import patched_experts

transformers = pytest.importorskip("transformers")
from kt_ops.hf import expert_memory  # noqa: E402

bf16 = torch.bfloat16
FORMATS = [(None, None), ("fp8", None), ("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
FORMAT_IDS = ["bf16", "fp8", "int8", "int4-g32", "int4-g64", "int4-g128"]


@pytest.mark.parametrize("fmt,group", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("H,I", [(384, 256), (640, 384)], ids=["fp8-whole-blocks", "fp8-partial-blocks"])
def test_shape_formula_equals_the_bytes_a_layer_holds(fmt, group, H, I):
    layer = KTMoE(H, I, 3, 2, dtype=bf16, expert_format=fmt, group_size=group)
    held = sum(t.nbytes for t in (layer.gate_proj, layer.up_proj, layer.down_proj, *layer.expert_scales()) if t is not None)
    assert quantization.expert_set_nbytes(3, H, I, fmt, group) == layer.expert_nbytes() == held


def test_shape_formula_by_hand():
    # fp8, H=640 (5 blocks), I=384 (3 blocks), 2 experts: one byte a weight, float32 block scales.
    assert quantization.expert_set_nbytes(2, 640, 384, "fp8") == 3 * 2 * 640 * 384 + (2 + 1) * 2 * 3 * 5 * 4
    # int8: float32 scale per output channel (gate, up: I rows; down: H rows).
    assert quantization.expert_set_nbytes(2, 640, 384, "int8") == 3 * 2 * 640 * 384 + 2 * (2 * 384 + 640) * 4
    # int4 g=64: half a byte a weight, a bf16 scale per 64 weights.
    assert quantization.expert_set_nbytes(2, 640, 384, "int4", 64) == 3 * 2 * 640 * 384 // 2 + 3 * 2 * 640 * 384 // 64 * 2
    assert quantization.expert_set_nbytes(2, 640, 384, dtype=torch.float32) == 3 * 2 * 640 * 384 * 4


def test_shape_formula_refusals():
    with pytest.raises(ValueError, match="expert_set_nbytes: expert_format must be None or one of"):
        quantization.expert_set_nbytes(2, 256, 128, "int2")
    with pytest.raises(ValueError, match=r"expert_set_nbytes: int4 groups of 128 must divide hidden size 256 and "
                                         r"intermediate size 96"):
        quantization.expert_set_nbytes(2, 256, 96, "int4", 128)
    with pytest.raises(ValueError, match="group_size is for expert_format='int4' only"):
        quantization.expert_set_nbytes(2, 256, 128, "fp8", 32)


def tiny_config(family):
    if family == "gpt_oss":  # biases, transposed and interleaved gate/up; all 2 layers MoE
        return transformers.GptOssConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=64)
    common = dict(vocab_size=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, moe_intermediate_size=64, num_experts_per_tok=2, max_position_embeddings=64)
    if family == "qwen3_moe":  # layer 1 dense by mlp_only_layers: 3 of 4 layers MoE
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_hidden_layers=4, num_experts=8,
                                           decoder_sparse_step=1, mlp_only_layers=[1])
    # the first 2 of 4 layers dense: 2 MoE layers (and a shared expert, not counted)
    return transformers.DeepseekV3Config(**common, num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=6,
                                         n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                         qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1)


@pytest.mark.parametrize("family,moe_layers,experts", [("qwen3_moe", (0, 2, 3), 8), ("deepseek_v3", (2, 3), 6),
                                                       ("gpt_oss", (0, 1), 6)])
def test_expert_layers_are_the_models_moe_layers(family, moe_layers, experts):
    layers = expert_memory.expert_layers(tiny_config(family))
    assert [layer.name for layer in layers] == [f"model.layers.{i}.mlp.experts" for i in moe_layers]
    assert {(l.num_experts, l.hidden_size, l.intermediate_size) for l in layers} == {(experts, 128, 64)}
    assert {l.bias for l in layers} == {family == "gpt_oss"}


@pytest.mark.parametrize("fmt,group", [(None, None), ("fp8", None), ("int8", None), ("int4", 32), ("mxfp4", None)],
                         ids=["bf16", "fp8", "int8", "int4-g32", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_predicted_bytes_equal_the_patched_models(family, fmt, group):
    """The table's number is what patch_model's layers really hold once the model is patched."""
    config = tiny_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=bf16)
    kt_ops.patch_model(model, lora_rank=4, expert_format=fmt, group_size=group)
    held = sum(kt.expert_nbytes() for _, kt in patched_experts(model))
    assert expert_memory.expert_bytes(config, fmt, group) == held > 0


@pytest.mark.parametrize("fmt,group", [(None, None), ("int4", 32)], ids=["bf16", "int4-g32"])
def test_predicted_shard_bytes_equal_the_largest_shard_owners(fmt, group, monkeypatch):
    """With expert_shards=4 of the 6 DeepSeek experts (shards of 2, 2, 1, 1), the table's number per
    owner is what rank 0 (the largest shard) holds once patched; rank 3 holds less."""
    config = tiny_config("deepseek_v3")
    held = {}
    for rank in (0, 3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=bf16)
        kt_ops.patch_model(model, expert_format=fmt, group_size=group, expert_shards=4)
        held[rank] = sum(kt.expert_nbytes() for _, kt in patched_experts(model))
    assert expert_memory.expert_bytes(config, fmt, group, shards=4) == held[0] == 2 * held[3] > 0
    assert expert_memory.expert_bytes(config, fmt, group) == 3 * held[0]


def test_reference_models_have_their_released_shapes():
    """Shapes as the released config.json files give them (docs/quantization.md's memory table)."""
    want = {"Qwen3-30B-A3B": (48, 128, 2048, 768), "Qwen3-235B-A22B": (94, 128, 4096, 1536),
            "DeepSeek-V3 / R1": (58, 256, 7168, 2048), "Kimi-K2": (60, 384, 7168, 2048),
            "gpt-oss-120b": (36, 128, 2880, 2880), "gpt-oss-20b": (24, 32, 2880, 2880),
            "DeepSeek-V4-Flash": (43, 256, 4096, 2048)}
    configs = expert_memory.reference_configs()
    assert list(configs) == list(want)
    for label, (n_layers, E, H, I) in want.items():
        layers = expert_memory.expert_layers(configs[label])
        assert len(layers) == n_layers, label
        assert {(l.num_experts, l.hidden_size, l.intermediate_size) for l in layers} == {(E, H, I)}, label
        assert {l.bias for l in layers} == {label.startswith("gpt-oss")}, label
    # DeepSeek-V3's 654 B routed parameters: 1.31 TB in bf16, half that in fp8.
    v3 = expert_memory.expert_layers(configs["DeepSeek-V3 / R1"])
    assert sum(l.nbytes() for l in v3) == 58 * 256 * 3 * 7168 * 2048 * 2
    # gpt-oss-120b's experts with their biases: ~214 GiB in bf16, ~57 GiB in mxfp4 (as it ships:
    # half a byte a weight and an E8M0 byte per 32; the biases stay bf16).
    oss = expert_memory.expert_layers(configs["gpt-oss-120b"])
    weights, biases = 36 * 128 * 3 * 2880 * 2880, 36 * 128 * (2 * 2880 + 2880)
    assert sum(l.nbytes() for l in oss) == (weights + biases) * 2
    assert sum(l.nbytes("mxfp4") for l in oss) == weights // 2 + weights // 32 + biases * 2


def test_the_issues_memory_ratios_at_the_reference_shapes():
    """The quantized-experts issue's bound: fp8 and int8 at most 0.52x bf16, int4 (groups of 32)
    at most 0.30x, scales included."""
    for label, config in expert_memory.reference_configs().items():
        layers = expert_memory.expert_layers(config)
        bf16_bytes = sum(l.nbytes() for l in layers)
        for fmt, group, bound in (("fp8", None, 0.52), ("int8", None, 0.52), ("int4", 32, 0.30)):
            ratio = sum(l.nbytes(fmt, group) for l in layers) / bf16_bytes
            assert ratio <= bound, (label, fmt, ratio)


def test_cli_reads_a_config_json_and_a_checkpoint_directory(tmp_path, capsys):
    config = tiny_config("qwen3_moe")
    config.save_pretrained(tmp_path / "ckpt")  # a directory holding config.json
    (tmp_path / "alone.json").write_text(json.dumps(config.to_dict()))
    expert_memory.main([str(tmp_path / "ckpt"), str(tmp_path / "alone.json")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model | MoE layers x experts (H x I) | routed params | bf16 | fp8 |")
    params = 3 * 8 * 3 * 128 * 64  # 3 MoE layers x 8 experts x 3 matrices of 128 x 64
    for line, name in zip(lines[2:], ("ckpt", "alone.json")):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0].endswith(name) and cells[1] == "3 x 8 (128 x 64)"
        assert cells[2] == f"{params / 1e6:,.2f} M" and cells[3] == f"{params * 2 / 1e6:,.2f} MB"
        int4 = params // 2 + params // 32 * 2  # half a byte a weight, a bf16 scale per 32
        assert cells[6] == f"{int4 / 1e6:,.2f} MB ({int4 / (params * 2):.3f}x)"
        assert cells[7] == "n/a (groups of 128 do not divide H, I)"  # I = 64
        mxfp4 = params // 2 + params // 32  # an E8M0 byte per 32
        nvfp4 = params // 2 + params // 16 + 3 * 8 * 3 * 4  # an E4M3 byte per 16, a float32 per expert matrix
        assert cells[8] == f"{mxfp4 / 1e6:,.2f} MB ({mxfp4 / (params * 2):.3f}x)"
        assert cells[9] == f"{nvfp4 / 1e6:,.2f} MB ({nvfp4 / (params * 2):.3f}x)"
        assert cells[10] == f"{params * 2 // 3 / 1e6:,.2f} MB"  # one layer's bf16 experts
    assert len(lines) == 4


def test_cli_refuses_a_model_without_experts(tmp_path):
    dense = transformers.Qwen3Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=96, head_dim=32)
    with pytest.raises(ValueError, match="has no transformers experts module"):
        expert_memory.expert_layers(dense)
