"""The MoE families of the installed transformers, discovered (not a hand list), and a tiny
random-init model of each, built on the CPU from its own config class with sizes shrunk.

A family is a ``transformers.models.<name>`` package whose modeling file defines an experts
class (``@use_experts_implementation``). ``python tests/hf_families.py`` prints the coverage
table the README holds: per family, covered (the experts class runs on kt) or why not.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import sys
from functools import lru_cache
from typing import Optional

import torch
import transformers

from kt_ops.hf.experts import experts_support, is_experts_class, is_experts_module

# Config fields shrunk wherever a config (or a sub-config: text, vision, audio) has them.
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, expert_intermediate_size=16,
    shared_expert_intermediate_size=24, moe_shared_expert_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
    n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2,
    n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
    qk_head_dim=12, v_head_dim=8, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[],
    initializer_range=0.15, n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # vision / audio towers of multimodal wrappers (only their text model runs here)
    depth=1, embed_dim=32, num_heads=4, out_hidden_size=32, vision_hidden_size=32, patch_size=4,
    spatial_merge_size=1, num_channels=3, image_size=16,
)
VOCAB = TINY["vocab_size"]
# Per-layer lists (attention kinds, dense/sparse MLPs) are cut to the last num_hidden_layers
# entries of their default (MoE layers tend to come last: first_k_dense_replace and the like).
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "moe_layer_types", "layers_block_type", "hybrid_override_pattern")
MAX_PARAMS = 20_000_000  # a tiny model has well under 1M
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "thinker_config", "talker_config")


@dataclasses.dataclass
class Family:
    name: str                      # transformers.models.<name>
    experts_classes: list          # experts class names in the modeling file
    model_class: Optional[type]    # the causal LM (or multimodal generation) class, if any
    config_class: Optional[type]


def _models_dir() -> str:
    return os.path.join(os.path.dirname(transformers.__file__), "models")


@lru_cache(maxsize=None)
def discover() -> tuple:
    """Every family of the installed transformers with an experts class, sorted by name."""
    families = []
    for name in sorted(os.listdir(_models_dir())):
        path = os.path.join(_models_dir(), name, f"modeling_{name}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            if "@use_experts_implementation" not in f.read():
                continue
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # a family that needs an optional dependency: listed, never built
            families.append(Family(name, [], None, None))
            continue
        experts = [n for n, obj in vars(module).items() if isinstance(obj, type) and obj.__module__ == module.__name__
                   and is_experts_class(obj)]
        model_class = _model_class(module)
        config_class = getattr(model_class, "config_class", None) or _config_class(name)
        families.append(Family(name, experts, model_class, config_class))
    return tuple(families)


def _model_class(module) -> Optional[type]:
    """The family's *ForCausalLM, else its *ForConditionalGeneration (multimodal wrappers)."""
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        found = sorted(n for n, obj in vars(module).items() if isinstance(obj, type) and n.endswith(suffix)
                       and obj.__module__ == module.__name__)
        if found:
            return getattr(module, found[0])
    return None


def _config_class(name: str) -> Optional[type]:
    try:
        module = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
    except Exception:
        return None
    configs = [obj for obj in vars(module).values() if isinstance(obj, type) and obj.__module__ == module.__name__
               and issubclass(obj, transformers.PreTrainedConfig)]
    # the top-level config: the one naming sub-configs, else the only / first one
    top = [c for c in configs if getattr(c, "sub_configs", None)]
    return (top or configs or [None])[0]


def _field_defaults(config_cls: type) -> dict:
    """{field: default} of a config class (dataclass fields, else a default instance's)."""
    if dataclasses.is_dataclass(config_cls):
        out = {}
        for f in dataclasses.fields(config_cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = None
        return out
    return dict(vars(config_cls()))


def tiny_config(family: Family):
    """The family's config with every known size field shrunk (sub-configs too)."""
    cls = family.config_class

    def shrink(config_cls, extra=None):
        defaults = _field_defaults(config_cls)
        fields = set(defaults)
        kwargs = {k: copy.deepcopy(v) for k, v in TINY.items() if k in fields}
        layers = kwargs.get("num_hidden_layers", TINY["num_hidden_layers"])
        for k in PER_LAYER_LISTS:
            if isinstance(defaults.get(k), (list, tuple)) and len(defaults[k]) > layers:
                kwargs[k] = list(defaults[k])[-layers:]
            elif isinstance(defaults.get(k), str) and len(defaults[k]) > layers:  # e.g. "M-M*-"
                kwargs[k] = defaults[k][-layers:]
        for sub in SUB_CONFIGS:
            sub_cls = (getattr(config_cls, "sub_configs", None) or {}).get(sub)
            if (sub in fields and isinstance(sub_cls, type) and issubclass(sub_cls, transformers.PreTrainedConfig)
                    and sub_cls is not transformers.AutoConfig):
                kwargs[sub] = shrink(sub_cls).to_dict()
        if "kv_lora_rank" in fields:  # multi-head latent attention: one kv head per query head
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", TINY["num_attention_heads"])
        kwargs.update(extra or {})
        return config_cls(**kwargs)

    return shrink(cls)


def tiny_model(family: Family, *, dtype=torch.float32, seed: int = 0):
    """A random-init tiny model of the family (eval mode, float32 unless asked)."""
    config = tiny_config(family)
    with torch.device("meta"):  # size check first: a config field we do not shrink can leave a full-size tower
        params = sum(p.numel() for p in family.model_class(copy.deepcopy(config)).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {params / 1e6:.0f}M parameters (> {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(seed)
    model = family.model_class(config)
    with torch.no_grad():
        for module in model.modules():  # routing biases that start at zero: make them matter
            if hasattr(module, "e_score_correction_bias") and isinstance(module.e_score_correction_bias, torch.Tensor):
                module.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model.to(dtype).eval()


def input_ids(seed: int = 0, batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run(model, ids, **kwargs):
    """The model's forward on token ids, without a KV cache (hybrid linear-attention families
    cannot report a cache length when every tiny layer is a linear one)."""
    return model(input_ids=ids, use_cache=False, **kwargs)


def classify(family: Family) -> tuple[str, str]:
    """("covered", experts classes) or ("refused" | "not built", why) for one family."""
    if family.model_class is None or family.config_class is None:
        return "not built", "no causal-LM / generation class or config class importable"
    if not family.experts_classes:
        return "not built", "modeling module not importable here"
    try:
        model = tiny_model(family)
    except Exception as e:  # noqa: BLE001 - reported, per family
        return "not built", f"tiny config does not build: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    experts = [m for m in model.modules() if is_experts_module(m)]
    if not experts:
        return "not built", "the tiny model holds no experts module (MoE layers off at this size)"
    try:
        with torch.no_grad():
            run(model, input_ids())
    except Exception as e:  # noqa: BLE001
        return "not built", f"the tiny model's own forward fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    reasons = sorted({why for m in experts if (why := experts_support(m)) is not None})
    if reasons:
        return "refused", "; ".join(reasons)
    return "covered", ", ".join(sorted({type(m).__name__ for m in experts}))


def coverage_table() -> str:
    rows = [(f.name, *classify(f)) for f in discover()]
    covered = sum(1 for r in rows if r[1] == "covered")
    lines = [f"{covered} of {len(rows)} MoE families of transformers {transformers.__version__} covered "
             f"(discovered by tests/hf_families.py):", "", "| family | status | experts class / why not |",
             "|---|---|---|"]
    lines += [f"| {name} | {status} | {why} |" for name, status, why in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(coverage_table())
