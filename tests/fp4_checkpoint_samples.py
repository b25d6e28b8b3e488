"""FP4 checkpoints as they ship, written by the tests from tiny random models (nothing downloaded;
the layouts are written out here from their producers' code, not imported):

* gpt-oss MXFP4 (transformers' integrations/mxfp4.py): the experts' ``gate_up_proj_blocks``
  U8 ``[E, 2I, H/32, 16]`` (rows: the fused outputs, gate at the even ones), ``_scales`` U8
  ``[E, 2I, H/32]`` (E8M0, ``2^(byte - 127)``), ``down_proj_blocks`` / ``_scales``, the biases
  and everything else as saved; ``quant_method: mxfp4`` with gpt-oss's ``modules_to_not_convert``;
* compressed-tensors NVFP4 (llm-compressor's NVFP4 scheme, ``nvfp4-pack-quantized``): every
  linear but the embeddings, head and routers as ``X.weight_packed`` U8 ``[out, in/2]`` (low
  nibble first: compressed-tensors' ``pack_fp4_to_uint8``), ``X.weight_scale`` F8_E4M3
  ``[out, in/16]``, ``X.weight_global_scale`` F32 ``[1]`` (a divisor), ``X.input_global_scale``;
* ModelOpt NVFP4 (its ``NVFP4QTensor.quantize`` and export): ``X.weight`` U8, ``X.weight_scale``
  F8_E4M3, ``X.weight_scale_2`` F32 ``[]`` (a multiplier), ``X.input_scale``; the config in
  config.json (``quant_method: modelopt``) or in ``hf_quant_config.json``;

each NVFP4 one beside a float checkpoint of the values kt_ops reads it as (``e2m1 * (scale *
global)`` in float32), which ``transformers.from_pretrained`` loads as the reference.
"""
from __future__ import annotations

import json
import os
import re

import torch

from checkpoint_samples import FP8_KEEP_FLOAT, rewrite

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# gpt-oss's shipped config: only the experts are MXFP4
GPT_OSS_MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                   "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def tiny_gpt_oss(dtype=torch.float32, seed: int = 0):
    """gpt-oss (interleaved, transposed experts with biases, clamped SwiGLU-OAI, attention sinks)
    with MXFP4-friendly sizes: H = 64, I = 64."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # biases that matter (they start at zero)
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.05)
    return model


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (bit 3 the sign) of ``x`` rounded to the nearest magnitude, saturating at 6."""
    magnitude = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return (magnitude | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: column 2j in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values (float32) of packed codes, low nibble first (compressed-tensors'
    ``unpack_fp4_from_uint8``, ModelOpt's ``_unpack_tensor``)."""
    lut = torch.cat([E2M1, -E2M1])
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return lut[codes.long()]


def quantize_mxfp4(w: torch.Tensor):
    """OCP MX quantization of ``w [..., out, in]`` in gpt-oss's layout: per 32 input columns
    the exponent ``floor(log2(amax)) - 2`` (byte + 127), values rounded to E2M1. Returns
    (blocks U8 [..., out, in/32, 16], scales U8 [..., out, in/32], dequantized float32)."""
    *lead, out, inp = w.shape
    groups = w.float().reshape(*lead, out, inp // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    step = torch.exp2(exponent)[..., None]
    codes = _nearest_e2m1(groups / step)
    blocks = _pack(codes)  # [..., out, in/32, 16]
    dequantized = (_unpack(blocks) * step).reshape(*lead, out, inp)
    return blocks, (exponent + 127).to(torch.uint8), dequantized


def write_gpt_oss_mxfp4(src: str, dst: str) -> None:
    """gpt-oss's shipped MXFP4 checkpoint of float checkpoint ``src`` (saved by gpt-oss's
    save_pretrained: experts as the model holds them, ``gate_up_proj [E, H, 2I]``)."""
    def mxfp4(key, t):
        if not GPT_OSS_EXPERTS.search(key):
            return {key: t}
        blocks, scales, _ = quantize_mxfp4(t.transpose(1, 2))  # the rows are the outputs
        return {key + "_blocks": blocks, key + "_scales": scales}

    rewrite(src, dst, mxfp4, GPT_OSS_MXFP4_CONFIG)


def quantize_nvfp4(w: torch.Tensor, convention: str):
    """ModelOpt's NVFP4 quantization of ``w [out, in]`` (global amax / (6 * 448), block scales
    ``amax_block / 6 / global`` in E4M3, values rounded to E2M1), stored by ``convention``:
    ``"modelopt"`` (``weight_scale_2``: the global multiplier) or ``"compressed-tensors"``
    (``weight_global_scale``: its inverse, ``6 * 448 / amax`` as llm-compressor computes it).
    Returns (packed U8 [out, in/2], scale F8_E4M3 [out, in/16], the stored global scale,
    dequantized float32: ``e2m1 * (scale * global)`` with global = weight_scale_2, or 1 /
    weight_global_scale in float32)."""
    out, inp = w.shape
    w = w.float()
    amax = w.abs().amax().clamp_min(1e-6)
    if convention == "modelopt":
        stored = (amax / (6.0 * 448.0)).reshape(())
        multiplier = stored
    else:
        stored = (6.0 * 448.0 / amax).reshape(1)
        multiplier = torch.reciprocal(stored).reshape(())
    groups = w.reshape(out, inp // 16, 16)
    block = (groups.abs().amax(-1) / 6.0 / multiplier).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn)
    step = (block.float() * multiplier)[..., None]
    packed = _pack(_nearest_e2m1(groups / step).reshape(out, inp))
    dequantized = (_unpack(packed).reshape(out, inp // 16, 16) * step).reshape(out, inp)
    return packed, block, stored.to(torch.float32), dequantized


def compressed_nvfp4_config(activations: bool = True) -> dict:
    """compressed-tensors' config of llm-compressor's NVFP4 (``activations``: W4A4, its
    activations quantized per 16 dynamically under a static global scale) or NVFP4A16 scheme."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "dynamic": False, "observer": "minmax", "block_structure": None, "actorder": None}
    acts = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
            "dynamic": "local", "observer": "static_minmax", "block_structure": None, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts if activations else None,
                                          "output_activations": None, "format": "nvfp4-pack-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def modelopt_hf_quant_config(kv_cache: bool = False) -> dict:
    """ModelOpt's hf_quant_config.json of an NVFP4 export."""
    return {"producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8" if kv_cache else None,
                             "group_size": 16, "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}


def modelopt_config() -> dict:
    """ModelOpt's config.json quantization_config of an NVFP4 export (its convert_hf_quant_config_format)."""
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    return {"config_groups": {"group_0": {"input_activations": dict(group), "weights": dict(group),
                                          "targets": ["Linear"]}},
            "ignore": ["lm_head", "model.layers.*.mlp.gate"], "quant_algo": "NVFP4",
            "producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt"}


def _picked(key: str, t: torch.Tensor) -> bool:
    """The linear weights NVFP4 checkpoints quantize: all but the embeddings, head and routers."""
    return key.endswith(".weight") and t.dim() == 2 and not FP8_KEEP_FLOAT.search(key)


def write_nvfp4(src: str, dst: str, reference: str, convention: str, hf_quant_config_file: bool = False,
                activations: bool = True) -> None:
    """An NVFP4 checkpoint of float checkpoint ``src`` in ``convention``'s layout
    (``"compressed-tensors"`` or ``"modelopt"``; ModelOpt's config in config.json, or with
    ``hf_quant_config_file`` in hf_quant_config.json), every linear quantized but the
    embeddings, head and routers, with the activation global scales of W4A4 (``activations``);
    in ``reference`` the float checkpoint of its values."""
    def stored(key, t):
        if not _picked(key, t):
            return {key: t}
        packed, scale, global_scale, _ = quantize_nvfp4(t, convention)
        base = key[: -len(".weight")]
        act = torch.tensor(0.01, dtype=torch.float32)  # an activation global scale: never read
        if convention == "modelopt":
            out = {key: packed, base + ".weight_scale": scale, base + ".weight_scale_2": global_scale}
            return {**out, base + ".input_scale": act} if activations else out
        out = {base + ".weight_packed": packed, base + ".weight_scale": scale,
               base + ".weight_global_scale": global_scale}
        return {**out, base + ".input_global_scale": act.reshape(1)} if activations else out

    def dequantized(key, t):
        return {key: quantize_nvfp4(t, convention)[3].to(t.dtype) if _picked(key, t) else t}

    if convention == "modelopt":
        config = None if hf_quant_config_file else modelopt_config()
    else:
        config = compressed_nvfp4_config(activations)
    rewrite(src, dst, stored, config)
    if convention == "modelopt" and hf_quant_config_file:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(modelopt_hf_quant_config(), f)
    rewrite(src, reference, dequantized)


# DeepSeek-V4's FP8 config (ue8m0 block scales) with FP4 experts (transformers' FineGrainedFP8Config)
DEEPSEEK_V4_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
DEEPSEEK_V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
DEEPSEEK_V4_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv)\.weight$")  # a few FP8 linears beside the experts


def tiny_deepseek_v4(dtype=torch.float32, seed: int = 0):
    """DeepSeek-V4 (hyper-connections, compressed attention, hash and score routing) from
    tests/hf_families.py's tiny config, with MXFP4-friendly expert sizes (H = 64, I = 32)."""
    from hf_families import discover, tiny_config

    family = next(f for f in discover() if f.name == "deepseek_v4")
    config = tiny_config(family)
    config.hidden_size, config.moe_intermediate_size = 64, 32
    torch.manual_seed(seed)
    return family.model_class._from_config(config, dtype=dtype).eval()


def quantize_fp8_ue8m0(w: torch.Tensor):
    """FP8 e4m3 with one power-of-two (E8M0) scale per 128x128 block, as DeepSeek-V4 stores its
    linears: (float8 [out, in], scale float8_e8m0fnu [ceil(out/128), ceil(in/128)], dequantized)."""
    out, inp = w.shape
    w = w.float()
    ob, ib = -(-out // 128), -(-inp // 128)
    padded = torch.nn.functional.pad(w.abs(), (0, ib * 128 - inp, 0, ob * 128 - out))
    amax = padded.reshape(ob, 128, ib, 128).amax(dim=(1, 3)).clamp_min(2.0 ** -100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu), q.float() * full


def write_deepseek_v4_fp4(src: str, dst: str, reference: str) -> None:
    """DeepSeek-V4-Flash's layout of float checkpoint ``src``: the routed experts' ``wN.weight``
    as int8 holding two E2M1 codes per byte (low nibble first) with ``wN.scale`` E8M0 per 32
    input columns, a few attention linears FP8 with ``.scale`` E8M0 per 128x128 block, the rest
    float; in ``reference`` the float checkpoint of its values."""
    def quantized(key, t):
        if DEEPSEEK_V4_EXPERT.search(key):
            blocks, scales, values = quantize_mxfp4(t)
            return blocks.reshape(t.shape[0], -1).view(torch.int8), scales.view(torch.float8_e8m0fnu), values
        if DEEPSEEK_V4_FP8.search(key):
            return quantize_fp8_ue8m0(t)
        return None

    def stored(key, t):
        q = quantized(key, t)
        return {key: t} if q is None else {key: q[0], key[: -len(".weight")] + ".scale": q[1]}

    def dequantized(key, t):
        q = quantized(key, t)
        return {key: t if q is None else q[2].to(t.dtype)}

    rewrite(src, dst, stored, DEEPSEEK_V4_CONFIG)
    rewrite(src, reference, dequantized)
