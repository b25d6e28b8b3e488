"""Where kt.moe's expert tensors are in a transformers experts module.

transformers' experts modules hold ``gate_up_proj`` and ``down_proj`` in one of the layouts its
``@use_experts_implementation`` flags name (transformers/integrations/moe.py):

* ``is_transposed=False`` (most families): ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
  ``True`` (gpt-oss, Aria): ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``;
* ``is_concatenated=True``: gate|up halves of the 2I outputs; ``False`` (gpt-oss): interleaved,
  gate at the even outputs and up at the odd ones;
* ``has_bias=True`` (gpt-oss): ``gate_up_proj_bias [E, 2I]`` (same order) and
  ``down_proj_bias [E, H]``.

:class:`ExpertsLayout` reads the flags and gives kt.moe's tensors (``gate_proj``/``up_proj``
``[E, I, H]``, ``down_proj [E, H, I]``, biases ``[E, I]``/``[E, H]``) as views of the module's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ExpertsLayout:
    transposed: bool = False
    interleaved: bool = False  # gate/up outputs interleaved (is_concatenated=False)
    has_bias: bool = False

    @classmethod
    def of(cls, module: nn.Module) -> "ExpertsLayout":
        return cls(transposed=bool(getattr(module, "is_transposed", False)),
                   interleaved=not getattr(module, "is_concatenated", True),
                   has_bias=bool(getattr(module, "has_bias", False)))

    def sizes(self, gate_up: Tensor) -> tuple[int, int, int]:
        """(E, I, H) of a ``gate_up_proj`` in this layout."""
        E, a, b = gate_up.shape
        two_i, H = (b, a) if self.transposed else (a, b)
        return E, two_i // 2, H

    def split_gate_up(self, fused: Tensor) -> tuple[Tensor, Tensor]:
        """A tensor whose dim 1 runs over the 2I fused outputs -> (gate part, up part)."""
        if self.interleaved:
            return fused[:, 0::2], fused[:, 1::2]
        half = fused.shape[1] // 2
        return fused[:, :half], fused[:, half:]

    def fuse_gate_up(self, gate: Tensor, up: Tensor) -> Tensor:
        """Inverse of :meth:`split_gate_up` (a new tensor)."""
        if self.interleaved:
            return torch.stack([gate, up], dim=2).flatten(1, 2)
        return torch.cat([gate, up], dim=1)

    def weights(self, module: nn.Module) -> dict[str, Tensor]:
        """kt.moe's ``gate_proj``, ``up_proj`` ``[E, I, H]`` and ``down_proj [E, H, I]`` as views
        of the module's tensors (differentiable; not contiguous unless the layout is kt's own)."""
        gate_up, down = module.gate_up_proj, module.down_proj
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        gate, up = self.split_gate_up(gate_up)
        return {"gate_proj": gate, "up_proj": up, "down_proj": down}

    def biases(self, module: nn.Module) -> dict[str, Optional[Tensor]]:
        """kt.moe's ``gate_bias``, ``up_bias`` ``[E, I]`` and ``down_bias [E, H]`` (views,
        differentiable), or Nones without biases."""
        if not self.has_bias:
            return {"gate_bias": None, "up_bias": None, "down_bias": None}
        gate, up = self.split_gate_up(module.gate_up_proj_bias)
        return {"gate_bias": gate, "up_bias": up, "down_bias": module.down_proj_bias}
