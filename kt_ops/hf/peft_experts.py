"""How PEFT reaches kt's experts: a KTExperts that is also one of PEFT's auxiliary training wrappers.

PEFT walks a model for two kinds of modules: its tuner layers (the LoRA it injected) and its
``AuxiliaryTrainingWrapper`` s (what ``modules_to_save`` makes: modules that keep trainable
state of their own per adapter). Every switch PEFT has (``set_adapter``, ``disable_adapter()``,
``enable_adapter_layers``, ``delete_adapter``, ``set_requires_grad``) is called on both kinds,
PEFT's ``get_peft_model`` leaves a wrapper's parameters' ``requires_grad`` as they are (it
freezes everything else it did not create), and PEFT's ``save_pretrained`` /
``load_adapter`` ask each wrapper for its part of an adapter, under the wrapper's own name.

So with PEFT installed, :func:`kt_ops.hf.experts.kt_experts_class` gives :class:`~kt_ops.hf.KTExperts` that
interface (:class:`PeftKTExperts`): the switches act on its named adapters
(:mod:`kt_ops.hf.expert_adapters`), and its part of a PEFT adapter is the expert LoRA in the
layout PEFT writes for the unpatched model (``<block>.experts.base_layer.lora_A.weight`` ...,
:mod:`kt_ops.hf.adapters`), so PEFT's own save of a patched model writes the adapter plain PEFT
loads, and PEFT's own load reads one. (A tuner layer instead would make ``get_peft_model`` take
the patched model for one already wrapped, and leave the base model trainable.)

What PEFT cannot do through this interface: add an adapter (it injects only into the modules
its config targets): the PEFT model :func:`kt_ops.hf.get_peft_model` returns adds the experts'
part. With sharded experts, an owner holds some experts' rows: PEFT's save / load carry no
expert part there; :func:`kt_ops.save_adapter` gathers them.

Importing this module imports PEFT.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Union

from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from kt_ops.hf.experts import KTExperts

_LOAD_PREFIX = "_peft_adapter."  # where PEFT's load puts our part of an adapter, converted on load


class PeftKTExperts(KTExperts, AuxiliaryTrainingWrapper):
    """A :class:`~kt_ops.hf.KTExperts` with PEFT's auxiliary-wrapper interface (module docstring).
    Built by :func:`kt_ops.patch_model` where PEFT is installed."""

    adapter_layer_names: tuple = ()  # PEFT's generic helpers over these are replaced below
    other_param_names: tuple = ()
    merged_adapters: list = []

    # -- the switches
    @property
    def active_adapter(self) -> str:
        return self.adapters.active_adapter

    @property
    def active_adapters(self) -> list[str]:
        return [self.adapters.active_adapter]

    @property
    def disable_adapters(self) -> bool:
        return self.adapters.disabled

    @property
    def _adapters(self) -> set:
        return set(self.adapters.lora)

    def _get_available_adapters(self) -> set:
        return set(self.adapters.lora)

    def enable_adapters(self, enabled: bool) -> None:
        self.adapters.enable(enabled)

    def check_set_adapter(self, adapter_name: Union[str, list[str]]) -> Optional[str]:
        return self.adapters.check_set_adapter(adapter_name)

    def set_adapter(self, adapter_names: Union[str, list[str]], inference_mode: bool = False) -> None:
        self.adapters.set_adapter(adapter_names, inference_mode=inference_mode)

    def set_requires_grad(self, adapter_names: Union[str, list[str]], requires_grad: bool = True) -> None:
        self.adapters.set_requires_grad(adapter_names, requires_grad)

    def delete_adapter(self, adapter_name: str, new_active_adapters: Optional[list[str]] = None) -> None:
        self.adapters.delete(adapter_name, new_active_adapters)

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names) -> nn.Module:
        if merge:
            raise NotImplementedError("merging kt's expert LoRA into the experts is not supported yet; save the "
                                      "adapter (kt_ops.save_adapter) and merge it with plain PEFT on the unpatched model")
        return self

    # -- PEFT's save and load of this module's part of an adapter
    def _holds_whole_lora(self, adapter_name: str) -> bool:
        return (self.lora_rank > 0 and self.is_owner and self.expert_shards == 1
                and adapter_name in self.adapters.lora)

    def adapter_state_dict(self, adapter_name: str, state_dict: Optional[dict] = None) -> dict:
        """The named adapter's expert LoRA in PEFT's layout, keys relative to this module."""
        from kt_ops.hf.adapters import _LORA_PARTS, kt_experts_to_peft

        if not self._holds_whole_lora(adapter_name):
            return {}
        lora = self.adapters.lora[adapter_name]
        return kt_experts_to_peft(self, {n: getattr(lora, n) for n in _LORA_PARTS})

    def adapter_state_dict_load_map(self, adapter_name: str) -> dict:
        """PEFT's keys of our part -> where its load puts them (converted by
        :meth:`_load_from_state_dict`). Empty where this rank holds no whole LoRA."""
        from kt_ops.hf.adapters import PEFT_EXPERT_KEYS

        if not self._holds_whole_lora(adapter_name):
            return {}
        return {key: f"{_LOAD_PREFIX}{adapter_name}.{key}" for key in PEFT_EXPERT_KEYS}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        from kt_ops.hf.adapters import peft_block_to_kt

        ours = [k for k in state_dict if k.startswith(prefix + _LOAD_PREFIX)]
        by_adapter: dict[str, dict] = {}
        for key in ours:
            name, _, peft_key = key[len(prefix + _LOAD_PREFIX):].partition(".")
            by_adapter.setdefault(name, {})[peft_key] = state_dict.pop(key)
        # Converted into this module's own keys, which the adapters' modules then load as usual
        # (torch hands each child the state dict after this method: nothing reported missing).
        mine = slice(self.expert_range.start, self.expert_range.stop)
        for name, tensors in by_adapter.items():
            converted = peft_block_to_kt({f"experts.{k}": v for k, v in tensors.items()}, SimpleNamespace(experts=self),
                                         self.lora_rank, "load_adapter")
            if "gate_lora_a" in converted:
                converted["up_lora_a"] = converted["gate_lora_a"]  # tied
            for kt_name, value in converted.items():
                state_dict[f"{prefix}adapters.lora.{name}.{kt_name}"] = value[mine]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
