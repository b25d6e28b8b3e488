"""Named expert-LoRA adapters of a :class:`~kt_ops.hf.KTExperts`, switched as PEFT switches its own.

PEFT keeps one set of LoRA tensors per named adapter in each of its layers and switches them
with ``set_adapter`` / ``disable_adapter()`` / ``delete_adapter``. TRL's ``DPOTrainer`` computes
the reference log-probabilities under those switches (a ``"ref"`` adapter, or the adapter
disabled), between the policy's forward and backward. kt's expert LoRA must follow them, with
a tensor set of its own per adapter.

``experts.adapters`` (:class:`ExpertAdapters`) holds them: ``adapters.lora[<name>]`` is an
:class:`ExpertLoRA` with the adapter's ``{gate,up,down}_lora_{a,b}`` (gate and up A tied, as
PEFT's one LoRA on the fused ``gate_up_proj``) and its scale. How PEFT reaches it is
:mod:`kt_ops.hf.peft_experts`'s. The tensors stay on the owner's CPU whatever ``.to()`` the
model gets (only a dtype change applies), as the base experts do; a non-owner's
:class:`ExpertLoRA` holds the scale and no tensor. Importing this module imports neither
transformers nor PEFT.
"""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor, nn

DEFAULT_ADAPTER = "default"  # PEFT's name for the first adapter
LORA_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


class ExpertLoRA(nn.Module):
    """One named adapter's expert LoRA: the six tensors (on an owner) and the scale."""

    # Declared the transformers way, so that save_pretrained keeps one copy of the tied A
    # instead of refusing the shared tensor, and loading the one copy fills both names.
    _tied_weights_keys = {"up_lora_a": "gate_lora_a"}

    def __init__(self, lora_alpha: float, lora_scale: float):
        super().__init__()
        self.lora_alpha, self.lora_scale = float(lora_alpha), float(lora_scale)

    def tensors(self) -> Optional[tuple[Tensor, ...]]:
        """The six LoRA tensors in kt.moe's order, or None where this rank holds none."""
        if "gate_lora_a" not in self._parameters:
            return None
        return tuple(getattr(self, n) for n in LORA_NAMES)

    def _apply(self, fn, recurse=True):
        # Like the base experts (KTMoE._apply): a dtype change applies, a device change does not.
        import torch

        for param in self._parameters.values():
            if param is not None and param.device.type != "meta":
                target = fn(torch.empty(0, dtype=param.dtype))
                if target.dtype != param.dtype and target.dtype.is_floating_point:
                    param.data = param.data.to(target.dtype)
        return self


class ExpertAdapters(nn.Module):
    """The named expert adapters of one kt experts module and PEFT's switches over them (one
    adapter active at a time; see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.lora = nn.ModuleDict()
        self.active_adapter = DEFAULT_ADAPTER
        self.disabled = False

    def check_set_adapter(self, adapter_name: Union[str, list[str]]) -> str:
        """The one adapter to activate; ValueError for several, or for one kt has no tensors of."""
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        if len(names) != 1:
            raise ValueError(f"kt experts run one expert adapter at a time; got {names!r}")
        if names[0] not in self.lora:
            raise ValueError(
                f"kt experts have no expert adapter {names[0]!r} (they have {sorted(self.lora)}): add and load named "
                "adapters through the PEFT model kt_ops.hf.get_peft_model returns (its add_adapter / load_adapter "
                "make the experts' part too)")
        return names[0]

    def set_adapter(self, adapter_names: Union[str, list[str]], inference_mode: bool = False) -> None:
        """Make ``adapter_names`` (one name) the active adapter: trainable unless
        ``inference_mode``, every other adapter frozen (as PEFT's LoRA layers do)."""
        name = self.check_set_adapter(adapter_names)
        for key, adapter in self.lora.items():
            adapter.requires_grad_(key == name and not inference_mode)
        self.active_adapter = name

    def enable(self, enabled: bool) -> None:
        """Off: the base experts alone (``disable_adapter()``), every adapter frozen; on: the
        active adapter again, trainable (PEFT's LoRA layers do the same)."""
        if enabled:
            self.set_adapter(self.active_adapter)
        else:
            for adapter in self.lora.values():
                adapter.requires_grad_(False)
        self.disabled = not enabled

    def set_requires_grad(self, adapter_names: Union[str, list[str]], requires_grad: bool = True) -> None:
        names = {adapter_names} if isinstance(adapter_names, str) else set(adapter_names)
        for key, adapter in self.lora.items():
            if key in names:
                adapter.requires_grad_(requires_grad)

    def delete(self, adapter_name: str, new_active_adapters: Optional[list[str]] = None) -> None:
        """Remove ``adapter_name``; when it was active, PEFT's new active adapter (or the first
        remaining one by name, the same on every layer) becomes active."""
        if adapter_name not in self.lora:
            return
        del self.lora[adapter_name]
        if self.active_adapter == adapter_name:
            remaining = [n for n in (new_active_adapters or sorted(self.lora)) if n in self.lora]
            if remaining:
                self.set_adapter(remaining[0])

    def current(self) -> Optional[ExpertLoRA]:
        """The adapter the experts compute with now: the active one, None when disabled."""
        return None if self.disabled else self.lora[self.active_adapter]

    def active(self) -> ExpertLoRA:
        """The active adapter (created, empty, on first use: the layer's constructor fills it)."""
        if self.active_adapter not in self.lora:
            self.lora[self.active_adapter] = ExpertLoRA(1.0, 1.0)
        return self.lora[self.active_adapter]

    def parameters_of_all(self) -> list[nn.Parameter]:
        """Every adapter's tensors, each once."""
        return list({id(p): p for p in self.lora.parameters()}.values())
