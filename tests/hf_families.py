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

# Config fields shrunk wherever a config (or any sub-config: text, vision, audio, ...) has them:
# a size never grows (a default of 0, e.g. no RoPE dims, stays 0; None takes the tiny value) and
# a list of sizes (one per expert kind) keeps its length. FORCED fields take the value as given.
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, expert_intermediate_size=16,
    shared_expert_intermediate_size=24, moe_shared_expert_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8, max_position_embeddings=64,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2,
    moe_topk=2, top_k_experts=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
    qk_nope_head_dim=8, qk_head_dim=12, v_head_dim=8, first_k_dense_replace=0, num_dense_layers=0,
    decoder_sparse_step=1, n_shared_experts=1,
    vocab_size_per_layer_input=96, hidden_size_per_layer_input=8,  # Gemma 4's per-layer embeddings
    mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16,  # hybrid Mamba-2 layers
    # vision / audio towers of multimodal wrappers (only their text model runs here)
    depth=1, embed_dim=32, num_heads=4, out_hidden_size=32, vision_hidden_size=32, patch_size=4,
    spatial_merge_size=1, num_channels=3, image_size=16, d_model=32, encoder_layers=1, encoder_attention_heads=4,
    encoder_ffn_dim=32, output_dim=32, downsample_hidden_size=8,
)
FORCED = dict(
    initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2, mlp_only_layers=[],
    enable_moe_block=True,  # Gemma 4: the MoE block is off by default
    enable_audio_output=False,  # Qwen3-Omni: no talker (a second, speech MoE model)
)
VOCAB = TINY["vocab_size"]
# Per-layer lists (attention kinds, dense/sparse MLPs) are cut to the last num_hidden_layers
# entries of their default (MoE layers tend to come last: first_k_dense_replace and the like); a
# dense/sparse list the config derives (default None) is made all "sparse".
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "moe_layer_types", "layers_block_type", "hybrid_override_pattern")
# What no rule above gives, per family (applied like FORCED, at every config level with the field).
FAMILY_FIELDS = {
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[16, 16],  # text and vision experts; derived when None
                            rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[22, 22, 20])),
    "glm4v_moe": dict(rope_parameters=dict(  # the modeling file's default sections, made explicit (_fit_mrope)
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[8, 12, 12])),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # no default: checkpoints list them
    "muse_spark": dict(patch_sizes=[4, 2], hidden_sizes=[32, 32], depths=[1, 1]),  # one per vision stage
}
# The class to build where the first *ForConditionalGeneration is not the text model.
FAMILY_MODEL_CLASSES = {"qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}  # the top one only generates
MAX_PARAMS = 20_000_000  # a tiny model has well under 1M


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
        model_class = getattr(module, FAMILY_MODEL_CLASSES[name]) if name in FAMILY_MODEL_CLASSES else _model_class(module)
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


def _shrunk(default, tiny):
    """``tiny`` for a size field whose default is ``default`` (see TINY)."""
    if isinstance(default, (list, tuple)) and default and all(isinstance(v, int) for v in default):
        return [min(v, tiny) for v in default]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return min(default, tiny)
    return copy.deepcopy(tiny)


def _sub_config_classes(config_cls) -> dict:
    """{field: config class} of the sub-configs a config class declares (AutoConfig left out:
    its class is known only from a default instance)."""
    declared = {**(getattr(config_cls, "sub_configs_defaults", None) or {}), **(getattr(config_cls, "sub_configs", None) or {})}
    return {k: v for k, v in declared.items() if isinstance(v, type) and issubclass(v, transformers.PreTrainedConfig)
            and v is not transformers.AutoConfig}


def _fit_mrope(config) -> None:
    """Multimodal RoPE splits each head's rotary frequencies into sections that must add up to
    them: rescale the default sections to the tiny head."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), (list, tuple)):
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    half = int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)) // 2
    sections = list(rope["mrope_section"])
    fitted = [half * s // sum(sections) for s in sections]
    fitted[-1] += half - sum(fitted)  # the last: equal first sections stay equal (ERNIE needs h = w)
    rope["mrope_section"] = fitted


def tiny_config(family: Family):
    """The family's config with every known size field shrunk (sub-configs too)."""
    extra = FAMILY_FIELDS.get(family.name, {})

    def shrink(config_cls):
        defaults = _field_defaults(config_cls)
        fields = set(defaults)
        kwargs = {k: _shrunk(defaults[k], v) for k, v in TINY.items() if k in fields}
        kwargs.update({k: copy.deepcopy(v) for k, v in {**FORCED, **extra}.items() if k in fields})
        layers = kwargs.get("num_hidden_layers", TINY["num_hidden_layers"])
        for k in PER_LAYER_LISTS:
            if k in extra:
                continue
            if isinstance(defaults.get(k), (list, tuple)) and len(defaults[k]) > layers:
                kwargs[k] = list(defaults[k])[-layers:]
            elif isinstance(defaults.get(k), str) and len(defaults[k]) > layers:  # e.g. "M-M*-"
                kwargs[k] = defaults[k][-layers:]
        for sub, sub_cls in _sub_config_classes(config_cls).items():
            if sub in fields:
                kwargs[sub] = shrink(sub_cls).to_dict()
        if "kv_lora_rank" in fields:  # multi-head latent attention: one kv head per query head
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", TINY["num_attention_heads"])
        config = config_cls(**kwargs)
        derived = getattr(config, "mlp_layer_types", None)
        if "mlp_layer_types" in fields and "mlp_layer_types" not in kwargs and (
                derived is None or isinstance(derived, list) and set(derived) <= {"dense", "sparse"}):
            kwargs["mlp_layer_types"] = ["sparse"] * layers  # e.g. the first 3 layers dense: all of ours
            config = config_cls(**kwargs)
        # Sub-configs typed AutoConfig (e.g. a Pixtral vision tower): shrink the default's class.
        auto = {sub: value for sub in fields - set(kwargs)
                if isinstance(value := getattr(config, sub, None), transformers.PreTrainedConfig)}
        if auto:
            kwargs.update({sub: {**shrink(type(v)).to_dict(), "model_type": v.model_type} for sub, v in auto.items()})
            config = config_cls(**kwargs)
        _fit_mrope(config)
        return config

    return shrink(family.config_class)


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
            for name in ("gate_up_proj_bias", "down_proj_bias"):  # experts' biases start at zero too (gpt-oss)
                bias = getattr(module, name, None)
                if isinstance(bias, torch.Tensor):
                    bias.normal_(0.0, 0.5)
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
