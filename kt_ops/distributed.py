"""KT layers under PyTorch's own data-parallel engines (DDP, FSDP2).

Only the owner rank holds a KT layer's expert tensors (base weights, their scales, LoRA), and
their gradients already are the average over ranks (see :class:`kt_ops.KTMoE`), so the
engines must leave them alone: DDP would find different parameter sets on different ranks,
FSDP2 would issue collectives of different sizes. Everything else (router, attention, the
0-element ``grad_anchor`` every KT layer holds on every rank) is an ordinary replicated
parameter that the engine averages. Each KT layer's frozen ``expert_grad_norm`` carries, after
every backward, the owner's expert-gradient norm to the other ranks (as its ``.grad``), so that
gradient clipping by a rank's local norm clips by the same factor everywhere.

* DDP: :func:`prepare_ddp` writes the owner-only names into ``_ddp_params_and_buffers_to_ignore``
  of the module given to DDP (:func:`kt_ops.patch_model` does it for the model it patches), then
  ``DistributedDataParallel(model)`` works unmodified.
* FSDP2: ``fully_shard(module, ignored_params=kt_ops.expert_parameters(module))`` for each
  module sharded (decoder layers and the root). The grad anchors are ignored there too: FSDP2
  cannot shard a 0-element tensor (``_chunk_cat expects non-empty tensor``), and they need no
  reduction (their gradient is empty); FSDP2, unlike DDP, does not refuse a rank with nothing
  to shard.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from kt_ops.layer import _BASE_NAMES, _BIAS_NAMES, _GLOBAL_SCALE_NAMES, _REPLICATED_NAMES, _SCALE_NAMES, KTMoE



def _kt_layers(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KTMoE)]


def _owner_only(layer: KTMoE) -> list[nn.Parameter]:
    """A KT layer's owner-only tensors on this rank: base weights, scales, biases and every
    LoRA adapter's tensors (none off the owner)."""
    named = [getattr(layer, leaf, None) for leaf in _BASE_NAMES + _SCALE_NAMES + _GLOBAL_SCALE_NAMES + _BIAS_NAMES]
    tensors = named + (list(layer._all_lora_tensors()) if layer.is_owner else [])
    return list({id(p): p for p in tensors if isinstance(p, nn.Parameter)}.values())


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Fully qualified names of this rank's owner-only expert tensors in ``model`` (none off
    the owner rank), as ``model.named_parameters(remove_duplicate=False)`` spells them (a tied
    tensor under each of its names)."""
    names = []
    for prefix, layer in _kt_layers(model):
        mine = {id(p) for p in _owner_only(layer)}
        for name, p in layer.named_parameters(remove_duplicate=False):
            if id(p) in mine:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of the KT layers inside ``module`` that FSDP2 must not shard (its
    ``ignored_params``): this rank's owner-only expert tensors, every layer's grad anchor and
    its expert-gradient norm (a plain tensor whose .grad kt_ops sets)."""
    params = set()
    for _, layer in _kt_layers(module):
        params.update(_owner_only(layer))
        params.update(p for p in (getattr(layer, leaf, None) for leaf in _REPLICATED_NAMES)
                      if isinstance(p, nn.Parameter))
    return params


def prepare_ddp(model: nn.Module) -> nn.Module:
    """Mark the owner-only expert tensors of every KT layer in ``model`` as ignored by
    ``DistributedDataParallel(model)`` (adds to ``model._ddp_params_and_buffers_to_ignore``).
    Returns ``model``. Call it on the module you wrap, after the KT layers exist.

    The names are also listed as PEFT's model wrapping ``model`` spells them
    (``base_model.model.<name>``): a ``PeftModel`` that PEFT's own ``get_peft_model`` made
    around a patched model (TRL's ``peft_config`` path) reads this attribute from the model it
    wraps, and DDP matches the names against its own parameter names."""
    names = expert_parameter_names(model)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = sorted(ignored | set(names) | {PEFT_MODEL_PREFIX + n for n in names})
    return model


PEFT_MODEL_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the model: PEFT's names and adapter keys


def create_process_groups(model: nn.Module) -> None:
    """Makes the process groups of the KT layers in ``model`` placed with ``owners="per-node"``
    now, after ``init_process_group``, instead of at their first forward (where a compiled
    step would trace their making). Every rank must call it (``new_group`` is collective);
    :class:`kt_ops.hf.KTTrainer` does."""
    for _, layer in _kt_layers(model):
        layer._placement.create_groups()  # made once per layout, then shared


def set_owner_threads(model: nn.Module) -> Optional[int]:
    """On a rank that owns experts of ``model``'s KT layers, set torch's intra-op threads to what
    its CPU affinity allows (:func:`kt_ops.placement.owner_thread_count`: the mask numactl or
    taskset gave it, shared with the node's other owners when nothing bound them apart), and
    return that count; None (nothing changed) on other ranks. torchrun starts every process with
    ``OMP_NUM_THREADS=1``: without this an owner computes the experts on one core."""
    import torch

    from kt_ops.placement import owner_thread_count

    owners = [layer for _, layer in _kt_layers(model) if layer.is_owner]
    if not owners:
        return None
    threads = owner_thread_count(owners[0]._placement)
    torch.set_num_threads(threads)
    return threads
