"""PEFT LoRA on the rest of a patched model (attention, dense MLPs) beside kt's expert LoRA.

PEFT's own ``get_peft_model`` reaches the experts as one of its auxiliary training wrappers
(:mod:`kt_ops.hf.peft_experts`): kt's LoRA stays trainable and follows PEFT's switches. Two
things PEFT still cannot do from a ``LoraConfig`` that targets other modules: add the experts'
part of a new named adapter (it injects only into what the config targets), and name the
experts in the adapter config it writes (``target_parameters``). :func:`get_peft_model` is
PEFT's call whose PEFT model does both: its ``add_adapter`` / ``load_adapter`` /
``save_pretrained`` add, read and write the experts' part of each named adapter (so
``Trainer.save_model``, Trainer checkpoints, resuming and TRL's ``"ref"`` adapter carry it). One
adapter then holds both halves, in the format PEFT writes for the unpatched model with
``LoraConfig(target_modules=[...], target_parameters=["experts.gate_up_proj",
"experts.down_proj"])``: :func:`kt_ops.save_adapter` writes it from the PEFT-wrapped patched
model, plain PEFT loads it into the unpatched model, :func:`kt_ops.load_adapter` into a patched
one (wrapping it with PEFT when needed). This module holds :func:`load_adapter` for that reason;
:mod:`kt_ops.hf.adapters` holds the adapter format and imports nothing from here.
"""
from __future__ import annotations

import copy
import os
import types
import warnings

from torch import nn

from kt_ops.distributed import prepare_ddp
from kt_ops.hf.adapters import (_blocks, _check_config, _check_same_lora, _load_peft_part, _read_adapter_weights,
                                _split_expert_keys, is_peft_model, load_adapter_state_dict, load_expert_part,
                                peft_config_without_experts, read_adapter_config, save_adapter)
from kt_ops.hf.patch import add_expert_adapter, delete_expert_adapter, patched_blocks


def get_peft_model(model: nn.Module, peft_config, **kwargs):
    """``peft.get_peft_model(model, peft_config, **kwargs)`` on a model patched by
    :func:`~kt_ops.hf.patch_model`, whose PEFT model also adds, loads and saves the experts'
    part of named adapters (module docstring).

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
    # kt's expert LoRA stays trainable: the experts modules are PEFT auxiliary wrappers
    # (kt_ops.hf.peft_experts), whose parameters PEFT leaves as they are.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are trying to modify a model with PEFT for a second time")
        peft_model = peft.get_peft_model(model, peft_config, **kwargs)
    _give_named_adapters_expert_parts(peft_model)
    prepare_ddp(peft_model)  # DistributedDataParallel(peft_model): the expert tensors by their new names
    return peft_model


def _give_named_adapters_expert_parts(peft_model) -> None:
    """The PEFT model's ``add_adapter`` / ``load_adapter`` / ``save_pretrained`` also add, read
    and write the experts' part of each named adapter (PEFT only injects into, and writes, what
    its config targets; the experts modules switch with PEFT's own calls). Bound methods, so
    that a deep copy of the model calls them on the copy."""
    for name, method in (("add_adapter", _add_adapter), ("load_adapter", _load_adapter),
                         ("save_pretrained", _save_pretrained)):
        setattr(peft_model, name, types.MethodType(method, peft_model))


def _add_adapter(self, adapter_name, peft_config, *args, **kwargs):
    base = self.get_base_model()
    kt = patched_blocks(base)[0][1].experts
    if kt.lora_rank:
        _check_same_lora(peft_config, kt.lora_rank, float(peft_config.lora_alpha), "add_adapter")
    if getattr(peft_config, "target_parameters", None):  # an adapter read from disk: kt holds that part
        peft_config = copy.deepcopy(peft_config)
        peft_config.target_parameters = []
    add_expert_adapter(base, adapter_name, peft_config)
    try:
        result = type(self).add_adapter(self, adapter_name, peft_config, *args, **kwargs)
    except BaseException:
        delete_expert_adapter(base, adapter_name)
        raise
    prepare_ddp(self)
    return result


def _load_adapter(self, model_id, adapter_name, *args, **kwargs):
    """PEFT's load_adapter (what Trainer calls to resume from a checkpoint) adds a new name
    through :func:`_add_adapter`; PEFT's load reads the experts' part where one owner holds it
    whole, kt's read here sets the scale and reads a shard's rows."""
    result = type(self).load_adapter(self, model_id, adapter_name, *args, **kwargs)
    if os.path.isdir(str(model_id)) and read_adapter_config(str(model_id)).get("target_parameters"):
        load_expert_part(self.get_base_model(), str(model_id), adapter_name=adapter_name)
    return result


def _save_pretrained(self, save_directory, *args, selected_adapters=None, **kwargs):
    """PEFT's save_pretrained (Trainer.save_model, Trainer checkpoints), then each adapter
    again with both parts and the config naming them (on the experts' owner; other ranks hold
    no expert LoRA). Sharded experts need every rank to gather them, which a call on one rank
    cannot do: there kt_ops.save_adapter on every rank (KTTrainer's checkpoints do) writes the
    whole."""
    type(self).save_pretrained(self, save_directory, *args, selected_adapters=selected_adapters, **kwargs)
    kt = patched_blocks(self.get_base_model())[0][1].experts
    if not (kt.lora_rank and kt.is_owner and kt.expert_shards == 1):
        return
    for name in selected_adapters or list(self.peft_config):
        folder = str(save_directory) if name == "default" else os.path.join(str(save_directory), name)
        save_adapter(self, folder, adapter_name=name)


def load_adapter(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Load a PEFT expert-LoRA adapter (e.g. one written by :func:`save_adapter`, or by PEFT
    from ``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`` on
    the unpatched model) into a patched model, in place.

    Reads ``adapter_dir/adapter_config.json`` and ``adapter_model.safetensors`` (or
    ``adapter_model.bin``); copies the LoRA into the experts' ``{gate,up,down}_lora_{a,b}``
    (see :mod:`kt_ops.hf.adapters` for the layout mapping) and sets the LoRA scale to PEFT's
    (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``). Projections the adapter does
    not target get ``B = 0``. On non-owner ranks only the configuration is checked and the
    scale set (they hold no expert weights).

    An adapter that also has ``target_modules`` (LoRA on attention, ..., as
    :func:`save_adapter` writes from a PEFT-wrapped patched model) loads those through PEFT:
    into ``model`` if it is a PEFT model, else into ``kt_ops.hf.get_peft_model(model, <the
    adapter's LoraConfig without the experts>)``, which is returned.

    Returns:
        ``model`` (or the PEFT model wrapping it, see above).

    Raises:
        ValueError: ``model`` is not patched or its ``lora_rank`` differs from the adapter's
            ``r``; ``adapter_dir`` is not a LoRA adapter, uses what kt_ops cannot represent
            (DoRA, LoRA bias, rank/alpha patterns), or holds tensors that fit neither the
            experts nor PEFT's modules.
    """
    peft_model = model if is_peft_model(model) else None
    base = peft_model.get_base_model() if peft_model is not None else model
    blocks = _blocks(base, "load_adapter")
    config = read_adapter_config(adapter_dir)
    r, alpha, scaling = _check_config(config, adapter_dir)
    has_peft_part = bool(config.get("target_modules"))
    owner = blocks[0][1].experts.is_owner
    # A non-owner holds no expert LoRA: it reads the weights only for PEFT's part.
    state = _read_adapter_weights(adapter_dir) if owner or has_peft_part else {}
    if has_peft_part:
        if peft_model is None:
            peft_model = get_peft_model(base, peft_config_without_experts(config))
        _load_peft_part(peft_model, blocks, state, adapter_dir)
        state, _ = _split_expert_keys(blocks, state)
    load_adapter_state_dict(base, state if owner else {}, r=r, scaling=scaling, lora_alpha=alpha)
    return peft_model if peft_model is not None else model
