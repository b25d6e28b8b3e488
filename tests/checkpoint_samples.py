"""Checkpoints as they ship, written by the tests from tiny random models (nothing downloaded):

* float ones by transformers' own ``save_pretrained`` (per expert, the hub layout) or with
  ``save_original_format=False`` (fused ``experts.gate_up_proj``);
* FP8 block checkpoints in DeepSeek-V3's layout (every linear ``X.weight`` float8_e4m3fn plus
  ``X.weight_scale_inv`` per 128x128 block, ``quant_method: fp8``);
* compressed-tensors float-quantized FP8 (llm-compressor's FP8_BLOCK / FP8_DYNAMIC / FP8: every
  linear ``X.weight`` float8_e4m3fn plus ``X.weight_scale`` per 128x128 block, per output channel
  or per tensor);
* compressed-tensors int-quantized INT8 (W8A8: ``X.weight`` int8 and ``X.weight_scale`` per
  output channel or per tensor);
* GPTQ symmetric INT4 without desc_act (Qwen3's GPTQ-Int4: ``qweight`` int32 ``[in/8, out]``,
  ``qzeros``, fp16 ``scales [in/g, out]``, ``g_idx``), packed the way GPTQ packs (written out here);
* compressed-tensors pack-quantized INT4 (Kimi-K2-Thinking: the experts, symmetric, groups of
  32, ``weight_packed`` int32 / ``weight_scale`` bf16 / ``weight_shape``), packed the way
  compressed-tensors' ``pack_to_int32`` packs (written out here, not imported);

each beside a float checkpoint holding exactly the values the quantized one stands for, which
``transformers.from_pretrained`` loads as the reference.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kt_ops import quantization

EXPERT_KEY = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
# 2-d weights that stay float in FP8 checkpoints (DeepSeek-V3's modules_to_not_convert and
# the embeddings / router).
FP8_KEEP_FLOAT = re.compile(r"(embed_tokens|lm_head|\.mlp\.gate)\.weight$")


def tiny_qwen3_moe(dtype=torch.float32, seed: int = 0, **overrides):
    """Qwen3-MoE small enough for a test, with int4-friendly sizes (H = 64, I = 32)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**{**fields, **overrides}), dtype=dtype).eval()


def tiny_deepseek_v3(dtype=torch.float32, seed: int = 0):
    """DeepSeek-V3 (MLA attention, one dense layer then MoE with a shared expert, biased
    routing), small."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for m in model.modules():  # make the routing bias matter
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model


def input_ids(vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))


def rewrite(src: str, dst: str, transform, quantization_config=None) -> None:
    """Copies checkpoint ``src`` to ``dst`` shard by shard, each tensor through
    ``transform(key, tensor) -> {key: tensor}``, with ``quantization_config`` in config.json."""
    os.makedirs(dst, exist_ok=True)
    index_path = os.path.join(src, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index_path))["weight_map"].values())) if os.path.exists(index_path)
             else ["model.safetensors"])
    weight_map = {}
    for file in files:
        out = {}
        with safe_open(os.path.join(src, file), framework="pt") as f:
            for key in f.keys():
                out.update(transform(key, f.get_tensor(key)))
        save_file(out, os.path.join(dst, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in out})
    if os.path.exists(index_path):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if os.path.exists(os.path.join(src, "generation_config.json")):
        shutil.copy(os.path.join(src, "generation_config.json"), dst)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_fp8(src: str, dst: str, reference: str) -> None:
    """An FP8 block checkpoint of float checkpoint ``src`` (every 2-d linear weight), and in
    ``reference`` the float checkpoint of its dequantized values."""
    def quantized(key, t):
        if not key.endswith(".weight") or t.dim() != 2 or FP8_KEEP_FLOAT.search(key):
            return None
        q, s = quantization.quantize(t[None].float(), "fp8", name=key)
        return q[0], s[0]

    def fp8(key, t):
        qs = quantized(key, t)
        return {key: t} if qs is None else {key: qs[0], key + "_scale_inv": qs[1]}

    def dequantized(key, t):
        qs = quantized(key, t)
        return {key: t if qs is None else quantization.dequantize(qs[0][None], qs[1][None])[0].to(t.dtype)}

    rewrite(src, dst, fp8, FP8_CONFIG)
    rewrite(src, reference, dequantized)


def compressed_fp8_config(strategy: str) -> dict:
    """compressed-tensors' config of llm-compressor's FP8_BLOCK (``block``), FP8_DYNAMIC
    (``channel``) or, with dynamic activations, FP8 (``tensor``)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "block_structure": [128, 128] if strategy == "block" else None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "group" if strategy == "block" else "token", "group_size": 128 if strategy == "block" else None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def quantize_compressed_fp8(w: torch.Tensor, strategy: str):
    """(float8_e4m3fn weight, scale, dequantized float32) as compressed-tensors stores them:
    ``block`` kt's own fp8 blocks with the scales rounded to bf16 (the model's dtype, as
    llm-compressor writes them), ``channel`` scale = row amax / 448 in bf16 ``[out, 1]``,
    ``tensor`` one float32 scale ``[1]``."""
    w = w.float()
    if strategy == "block":
        q, s = quantization.quantize(w[None], "fp8")
        q, s = q[0], s[0].to(torch.bfloat16)
        return q, s, quantization.dequantize(q[None], s[None])[0]
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    s = (amax / 448).clamp_min(1e-8).to(torch.bfloat16 if strategy == "channel" else torch.float32)
    sf = s.float().reshape(-1, 1)  # [out, 1] or [1, 1]
    q = (w / sf).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * sf


def write_compressed_fp8(src: str, dst: str, reference: str, strategy: str) -> None:
    """A compressed-tensors FP8 checkpoint of float checkpoint ``src`` and its dequantized
    ``reference`` (see _write_value_and_scale)."""
    _write_value_and_scale(src, dst, reference, lambda t: quantize_compressed_fp8(t, strategy),
                           compressed_fp8_config(strategy))


def _write_value_and_scale(src: str, dst: str, reference: str, quantize, config: dict) -> None:
    """Every 2-d linear weight of float checkpoint ``src`` but the embeddings, head and routers
    as compressed-tensors stores 8-bit weights (``X.weight`` the values, ``X.weight_scale``),
    ``quantize(t) -> (values, scale, dequantized)``, with ``config``; in ``reference`` the float
    checkpoint of the dequantized values."""
    def picked(key, t):
        return key.endswith(".weight") and t.dim() == 2 and not FP8_KEEP_FLOAT.search(key)

    def stored(key, t):
        if not picked(key, t):
            return {key: t}
        q, s, _ = quantize(t)
        return {key: q, key[: -len(".weight")] + ".weight_scale": s}

    def dequantized(key, t):
        return {key: quantize(t)[2].to(t.dtype) if picked(key, t) else t}

    rewrite(src, dst, stored, config)
    rewrite(src, reference, dequantized)


def compressed_int8_config(strategy: str = "channel") -> dict:
    """compressed-tensors' config of llm-compressor's W8A8 INT8 scheme (``channel``), or the
    same with one scale per tensor."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False,
               "observer": "minmax"}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": "int-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def quantize_compressed_int8(w: torch.Tensor, strategy: str):
    """(int8 weight, scale, dequantized float32): scale = amax / 127 per row (bf16 ``[out, 1]``)
    or for the tensor (float32 ``[1]``), q = round(w / scale)."""
    w = w.float()
    if strategy == "channel":
        s = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-8).to(torch.bfloat16)
        sf = s.float()
    else:
        s = (w.abs().amax() / 127).clamp_min(1e-8).reshape(1)
        sf = s.reshape(1, 1)
    q = torch.round(w / sf).clamp(-127, 127).to(torch.int8)
    return q, s, q.float() * sf


def write_compressed_int8(src: str, dst: str, reference: str, strategy: str = "channel") -> None:
    """A compressed-tensors INT8 checkpoint of float checkpoint ``src`` and its dequantized
    ``reference`` (see _write_value_and_scale)."""
    _write_value_and_scale(src, dst, reference, lambda t: quantize_compressed_int8(t, strategy),
                           compressed_int8_config(strategy))


def int4_config(group_size: int = 32) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}


def _pack_int32(nibbles: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values along ``dim`` into one int32 each, value j at bits 4j (compressed-tensors'
    ``pack_to_int32`` along the input columns, GPTQ's along the input rows)."""
    n = nibbles.to(torch.int64).movedim(dim, -1)
    words = (n.reshape(*n.shape[:-1], -1, 8) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def pack_int4(w: torch.Tensor, group_size: int):
    """compressed-tensors' symmetric group quantization and ``pack_to_int32``: q = round(w /
    scale) in [-8, 7] with scale = amax / 7.5 (bf16), stored q + 8, eight values per int32
    word, value i of a word at bits 4i. Returns (packed [out, in/8], scale, dequantized)."""
    out, inp = w.shape
    groups = w.float().reshape(out, inp // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-6).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7)
    dequantized = (q * scale.float()[..., None]).reshape(out, inp)
    return _pack_int32((q + 8).reshape(out, inp), 1), scale, dequantized


def write_int4(src: str, dst: str, reference: str, group_size: int = 32, also=r"\.self_attn\.o_proj\.weight$") -> None:
    """A compressed-tensors INT4 checkpoint of ``src`` (the routed experts, and the weights
    matching ``also``: a quantized non-expert weight too), and its dequantized ``reference``."""
    def pick(key):
        return EXPERT_KEY.search(key) or (also and re.search(also, key))

    def int4(key, t):
        if not pick(key):
            return {key: t}
        packed, scale, _ = pack_int4(t, group_size)
        base = key[: -len(".weight")]
        return {base + ".weight_packed": packed, base + ".weight_scale": scale,
                base + ".weight_shape": torch.tensor(list(t.shape))}

    def dequantized(key, t):
        return {key: pack_int4(t, group_size)[2].to(t.dtype) if pick(key) else t}

    rewrite(src, dst, int4, int4_config(group_size))
    rewrite(src, reference, dequantized)


def gptq_config(group_size: int = 32, checkpoint_format: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True, "desc_act": False,
            "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "static_groups": False,
            "true_sequential": True}


def pack_gptq(w: torch.Tensor, group_size: int, stored_zero: int = 7):
    """GPTQ's symmetric 4-bit quantization of ``w [out, in]`` (scale = amax / 7.5 in fp16, q =
    round(w / scale) + 8 in [0, 15]) in its checkpoint layout. Returns ({suffix: tensor},
    q + 8 as [out, in], dequantized float32)."""
    out, inp = w.shape
    groups = w.float().reshape(out, inp // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-4).to(torch.float16)       # [out, in/g]
    q = (torch.round(groups / scale.float()[..., None]) + 8).clamp(0, 15).reshape(out, inp)
    dequantized = ((q - 8).reshape(out, inp // group_size, group_size) * scale.float()[..., None]).reshape(out, inp)
    tensors = {".qweight": _pack_int32(q.t(), 0),                                          # [in/8, out]
               ".qzeros": _pack_int32(torch.full((inp // group_size, out), stored_zero), 1),  # [in/g, out/8]
               ".scales": scale.t().contiguous(),                                          # [in/g, out]
               ".g_idx": (torch.arange(inp) // group_size).to(torch.int32)}
    return tensors, q.to(torch.uint8), dequantized


def write_gptq(src: str, dst: str, reference: str, group_size: int = 32, checkpoint_format: str = "gptq",
               also=r"\.self_attn\.o_proj\.weight$") -> None:
    """A GPTQ INT4 checkpoint of ``src`` (the routed experts, and the weights matching ``also``),
    and its dequantized ``reference``."""
    stored_zero = {"gptq": 7, "gptq_v2": 8}[checkpoint_format]

    def pick(key):
        return EXPERT_KEY.search(key) or (also and re.search(also, key))

    def gptq(key, t):
        if not pick(key):
            return {key: t}
        tensors, _, _ = pack_gptq(t, group_size, stored_zero)
        return {key[: -len(".weight")] + suffix: v for suffix, v in tensors.items()}

    def dequantized(key, t):
        return {key: pack_gptq(t, group_size)[2].to(t.dtype) if pick(key) else t}

    rewrite(src, dst, gptq, gptq_config(group_size, checkpoint_format))
    rewrite(src, reference, dequantized)
