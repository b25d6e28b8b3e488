"""PEFT LoRA on the rest of a patched model (attention, dense MLPs) beside kt's expert LoRA.

PEFT's ``get_peft_model`` freezes every parameter it did not create, kt's expert LoRA and grad
anchors included (PEFT would have to wrap the experts itself, and the patched model has no
``experts.gate_up_proj`` to wrap), and its ``save_pretrained`` / ``load_adapter`` only know its
own modules. :func:`get_peft_model` is PEFT's call that keeps kt's trainable tensors trainable
and gives the PEFT model a ``save_pretrained`` / ``load_adapter`` that also write / read the
experts' LoRA (so ``Trainer.save_model``, Trainer checkpoints and resuming carry both). One adapter then holds both halves, in the format PEFT writes for
the unpatched model with ``LoraConfig(target_modules=[...], target_parameters=["experts.gate_up_proj",
"experts.down_proj"])``: :func:`kt_ops.save_adapter` writes it from the PEFT-wrapped patched
model, plain PEFT loads it into the unpatched model, :func:`kt_ops.load_adapter` into a patched
one (wrapping it with PEFT when needed).
"""
from __future__ import annotations

import math
import os

from torch import nn

from kt_ops.distributed import expert_parameters, prepare_ddp
from kt_ops.hf.patch import patched_blocks


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def get_peft_model(model: nn.Module, peft_config, **kwargs):
    """``peft.get_peft_model(model, peft_config, **kwargs)`` on a model patched by
    :func:`~kt_ops.hf.patch_model`, with kt's expert LoRA (and grad anchors) still trainable.

    ``peft_config`` targets the non-expert modules (``target_modules``); the experts' LoRA is
    kt's (``patch_model(lora_rank=...)``), so ``target_parameters`` must be empty. For one
    adapter holding both, use the same ``r`` and ``lora_alpha`` for both (see
    :func:`kt_ops.save_adapter`)."""
    import peft

    if not patched_blocks(model):
        raise ValueError("get_peft_model: model has no kt_ops-patched MoE block; call kt_ops.patch_model first")
    if getattr(peft_config, "target_parameters", None):
        raise ValueError(f"get_peft_model: peft_config.target_parameters={peft_config.target_parameters!r}: the "
                         "experts' LoRA is kt's (kt_ops.patch_model(model, lora_rank=...)); target the other "
                         "modules with target_modules")
    kt = patched_blocks(model)[0][1].experts
    if kt.lora_rank:  # checked now, not when the adapter is saved at the end of a training run
        _check_same_lora(peft_config, kt.lora_rank, kt.lora_alpha, "get_peft_model")
    keep = [p for p in expert_parameters(model) if p.requires_grad]
    peft_model = peft.get_peft_model(model, peft_config, **kwargs)
    for p in keep:
        p.requires_grad_(True)

    # PEFT's load_adapter (what Trainer calls to resume from a checkpoint) reads PEFT's own
    # modules only: this model's also reads the experts' LoRA from the same adapter.
    peft_load = peft_model.load_adapter

    def load_adapter(model_id, adapter_name, *args, **kwargs):
        result = peft_load(model_id, adapter_name, *args, **kwargs)
        from kt_ops.hf.adapters import load_expert_part, read_adapter_config
        if os.path.isdir(str(model_id)) and read_adapter_config(str(model_id)).get("target_parameters"):
            load_expert_part(peft_model.get_base_model(), str(model_id))
        for p in keep:
            p.requires_grad_(True)
        return result

    peft_model.load_adapter = load_adapter

    # ... and its save_pretrained (Trainer.save_model, Trainer checkpoints) writes the one
    # adapter holding both LoRAs (on the experts' owner; other ranks hold no expert LoRA).
    peft_save = peft_model.save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        peft_save(save_directory, *args, **kwargs)
        blocks = patched_blocks(peft_model.get_base_model())
        if len(peft_model.peft_config) == 1 and blocks[0][1].experts.is_owner:
            from kt_ops.hf.adapters import save_adapter
            save_adapter(peft_model, str(save_directory))

    peft_model.save_pretrained = save_pretrained
    prepare_ddp(peft_model)  # DistributedDataParallel(peft_model): the expert tensors by their new names
    return peft_model


def _check_same_lora(peft_config, r: int, alpha: float, who: str) -> None:
    """ValueError unless PEFT's LoRA has the experts' rank and alpha (one LoraConfig, one adapter)."""
    if peft_config.r != r or not math.isclose(float(peft_config.lora_alpha), float(alpha)):
        raise ValueError(f"{who}: peft_config has r={peft_config.r}, lora_alpha={peft_config.lora_alpha} but the "
                         f"experts' LoRA has r={r}, lora_alpha={float(alpha):g}; one PEFT adapter holds one rank and "
                         "alpha: use the same for both")


def combined_adapter(peft_model, expert_state: dict, r: int, alpha: float) -> tuple[dict, dict]:
    """``(state dict, adapter config)`` of one PEFT adapter with the PEFT LoRA of ``peft_model``
    and kt's expert LoRA (``expert_state``: PEFT keys). ValueError when the two LoRAs' rank or
    alpha differ (one LoraConfig holds one of each)."""
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config[peft_model.active_adapter]
    _check_same_lora(config, r, alpha, "save_adapter")
    state = dict(get_peft_model_state_dict(peft_model))
    overlap = sorted(set(state) & set(expert_state))
    if overlap:
        raise ValueError(f"save_adapter: PEFT's adapter already holds expert LoRA keys {overlap[:3]}")
    state.update(expert_state)
    fields = config.to_dict()
    from kt_ops.hf.adapters import TARGET_PARAMETERS
    fields["target_parameters"] = list(TARGET_PARAMETERS)
    fields["inference_mode"] = True
    for k, v in fields.items():  # sets -> lists (what PeftConfig.save_pretrained does)
        if isinstance(v, set):
            fields[k] = sorted(v)
    return state, fields


def peft_config_without_experts(config: dict):
    """The ``LoraConfig`` of an adapter's non-expert part (``target_parameters`` dropped)."""
    from peft import LoraConfig

    fields = {k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}
    fields.pop("target_parameters", None)
    fields["inference_mode"] = False
    return LoraConfig(**fields)
