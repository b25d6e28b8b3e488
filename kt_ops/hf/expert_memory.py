"""How much CPU memory a model's routed experts take in each expert format, from its config.

The model is built from its config on the meta device (no weight is allocated) and every
transformers experts module in it is read off: ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``. So the layer count, the dense layers (DeepSeek's ``first_k_dense_replace``, Qwen's
``mlp_only_layers``, ...) and the shapes are transformers' own, for any family it runs. Bytes
per layer are :func:`kt_ops.quantization.expert_set_nbytes` (plus the biases, in bf16, where the
experts have them): what ``KTMoE.expert_nbytes()`` reports once :func:`~kt_ops.patch_model` has
patched the layer, scales included. Shared experts and every other module stay where the model
keeps them and are not counted.

    .venv/bin/python -m kt_ops.hf.expert_memory                    # docs/quantization.md's table
    .venv/bin/python -m kt_ops.hf.expert_memory path/to/checkpoint   # any local config
    .venv/bin/python -m kt_ops.hf.expert_memory --expert-shards 2    # per owner of 2 shards
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Optional, Sequence

import torch

from kt_ops import quantization
from kt_ops.hf.expert_layout import ExpertsLayout
from kt_ops.hf.experts import is_experts_module

# (label, expert_format, group_size): the table's columns after bf16.
FORMAT_COLUMNS = (("fp8", "fp8", None), ("int8", "int8", None), ("int4 g=32", "int4", 32),
                  ("int4 g=128", "int4", 128), ("mxfp4", "mxfp4", None), ("nvfp4", "nvfp4", None))


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    name: str            # the experts module's path in the model
    num_experts: int
    hidden_size: int
    intermediate_size: int
    bias: bool = False   # gpt-oss: gate/up [E, 2I] and down [E, H] biases

    def nbytes(self, expert_format: Optional[str] = None, group_size: Optional[int] = None, shards: int = 1) -> int:
        """The bytes of the layer's experts; with ``shards`` > 1, of the largest shard (shard 0,
        ``ceil(E / shards)`` experts): what its owner holds. Biases are held in the model's dtype
        whatever the expert format (bf16 here, as the model is built)."""
        experts = -(-self.num_experts // shards)
        biases = experts * (2 * self.intermediate_size + self.hidden_size) * torch.bfloat16.itemsize if self.bias else 0
        return quantization.expert_set_nbytes(experts, self.hidden_size, self.intermediate_size,
                                              expert_format, group_size) + biases


def expert_layers(config) -> list[ExpertLayer]:
    """Every transformers experts module of the model ``config`` describes, with its shape."""
    from accelerate import init_empty_weights

    from kt_ops.hf.loading import _build_model

    config = _without_quantization(config)
    with init_empty_weights(include_buffers=True), torch.random.fork_rng(devices=[]):
        model = _build_model(config, torch.bfloat16)
    layers = []
    for name, module in model.named_modules():
        if is_experts_module(module):
            layout = ExpertsLayout.of(module)
            E, I, H = layout.sizes(module.gate_up_proj)
            layers.append(ExpertLayer(name, E, H, I, layout.has_bias))
    if not layers:
        raise ValueError(f"expert_layers: {type(model).__name__} (model_type={config.model_type!r}) has no "
                         "transformers experts module")
    return layers


def _without_quantization(config):
    """The config without its ``quantization_config``: the model is built unquantized (kt_ops
    holds the experts in its own format), as :func:`kt_ops.hf.from_pretrained` does."""
    if not hasattr(config, "quantization_config"):
        return config
    import copy

    config = copy.deepcopy(config)
    del config.quantization_config
    return config


def expert_bytes(config, expert_format: Optional[str] = None, group_size: Optional[int] = None,
                 shards: int = 1) -> int:
    """Bytes of all routed experts of the model ``config`` describes, in one format (None: bf16);
    with ``shards`` > 1 (``expert_shards``), what the owner of the largest shard holds."""
    return sum(layer.nbytes(expert_format, group_size, shards) for layer in expert_layers(config))


def reference_configs() -> dict:
    """The table's models (docs/quantization.md), as transformers configs with their released shapes
    (config.json)."""
    from transformers import DeepseekV3Config, DeepseekV4Config, GptOssConfig, Qwen3MoeConfig

    return {
        # 48 layers, all MoE (decoder_sparse_step 1, mlp_only_layers []), 128 experts of 2048 x 768.
        "Qwen3-30B-A3B": Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128),
        # 94 layers, all MoE, 128 experts of 4096 x 1536.
        "Qwen3-235B-A22B": Qwen3MoeConfig(hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                                          num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64,
                                          num_key_value_heads=4, head_dim=128),
        # transformers' defaults are DeepSeek-V3's: 61 layers, the first 3 dense, 256 routed experts
        # of 7168 x 2048 (and one shared expert per layer, not counted).
        "DeepSeek-V3 / R1": DeepseekV3Config(),
        # DeepSeek-V3's architecture with 384 routed experts and only the first layer dense.
        "Kimi-K2": DeepseekV3Config(n_routed_experts=384, first_k_dense_replace=1, num_attention_heads=64),
        # openai/gpt-oss-120b: 36 layers, all MoE, 128 experts of 2880 x 2880 with biases (ships its
        # experts in MXFP4: the mxfp4 column).
        "gpt-oss-120b": GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                                     num_experts_per_tok=4, num_hidden_layers=36, num_attention_heads=64,
                                     num_key_value_heads=8, head_dim=64),
        # openai/gpt-oss-20b: 24 layers, all MoE, 32 experts of 2880 x 2880 with biases (MXFP4).
        "gpt-oss-20b": GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                    num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64),
        # deepseek-ai/DeepSeek-V4-Flash: 43 layers, all MoE (the first num_hash_layers=3 route by token
        # id, to the same 256 routed experts), 256 routed experts of 4096 x 2048, one shared expert per
        # layer (not counted); its MTP layer (num_nextn_predict_layers 1) transformers does not build.
        # Ships its experts in FP4 (E2M1 + an E8M0 scale per 32: the mxfp4 column).
        "DeepSeek-V4-Flash": DeepseekV4Config(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256,
                                              n_shared_experts=1, num_experts_per_tok=6, num_hidden_layers=43,
                                              num_hash_layers=3, num_attention_heads=64, num_key_value_heads=1,
                                              head_dim=512),
    }


def load_config(path: str):
    """A transformers config from a checkpoint directory or a ``config.json`` file (local only)."""
    from transformers import AutoConfig

    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    with open(path) as f:
        fields = json.load(f)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.2f} MB"


def memory_table(configs: dict, shards: int = 1) -> str:
    """A markdown table: per model, its routed experts in bf16 and in each format (GB = 1e9 bytes,
    MB = 1e6; with the ratio to bf16), and one layer's bf16 experts (what patch_model holds at most on top
    while it quantizes, one experts module at a time). With ``shards`` > 1, per owner of the largest
    of ``shards`` expert shards."""
    bf16_label = "bf16" if shards == 1 else f"bf16 per owner of {shards} shards"
    head = ["model", "MoE layers x experts (H x I)", "routed params", bf16_label] + [c[0] for c in FORMAT_COLUMNS]
    head.append("one layer bf16")
    rows = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for label, config in configs.items():
        layers = expert_layers(config)
        shapes = sorted({(l.num_experts, l.hidden_size, l.intermediate_size) for l in layers})
        shape = "; ".join(f"{sum((l.num_experts, l.hidden_size, l.intermediate_size) == s for l in layers)} x {s[0]} "
                          f"({s[1]} x {s[2]})" for s in shapes)
        params = sum(l.nbytes() for l in layers) // 2  # all experts
        bf16 = sum(l.nbytes(shards=shards) for l in layers)
        cells = [label, shape, f"{params / 1e9:,.1f} B" if params >= 1e8 else f"{params / 1e6:,.2f} M", _size(bf16)]
        for _, fmt, group in FORMAT_COLUMNS:
            if fmt == "int4" and any(l.hidden_size % group or l.intermediate_size % group for l in layers):
                cells.append(f"n/a (groups of {group} do not divide H, I)")  # patch_model refuses it too
                continue
            if fmt in quantization.FP4_FORMATS and any(l.hidden_size % 32 or l.intermediate_size % 32 for l in layers):
                cells.append("n/a (H, I not multiples of 32)")  # patch_model refuses it too (size_problem)
                continue
            nbytes = sum(l.nbytes(fmt, group, shards) for l in layers)
            cells.append(f"{_size(nbytes)} ({nbytes / bf16:.3f}x)")
        cells.append(_size(max(l.nbytes(shards=shards) for l in layers)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kt_ops.hf.expert_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", metavar="CONFIG",
                        help="checkpoint directories or config.json files (default: docs/quantization.md's models)")
    parser.add_argument("--expert-shards", type=int, default=1, metavar="S",
                        help="per owner of the largest of S expert shards (default: one owner, all experts)")
    args = parser.parse_args(argv)
    if args.expert_shards < 1:
        parser.error(f"--expert-shards must be >= 1, got {args.expert_shards}")
    configs = {path: load_config(path) for path in args.configs} if args.configs else reference_configs()
    print(memory_table(configs, args.expert_shards))


if __name__ == "__main__":
    main()
