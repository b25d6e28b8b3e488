"""transformers.Trainer integration: the kt expert adapter in every Trainer checkpoint.

``Trainer`` checkpoints hold the model (``model.safetensors``) and resume from it.
:class:`KTAdapterCallback` leaves the *frozen* expert base weights out of them (by default:
they are the base checkpoint's, hundreds of GB for the models kt_ops is for, and the Trainer's
resume loads checkpoints non-strictly, so the experts already in memory stay), and writes the
expert LoRA in PEFT's adapter format (:func:`kt_ops.save_adapter`) into each
``checkpoint-<step>`` folder, so that a checkpoint's adapter loads with
:func:`kt_ops.load_adapter` or plain PEFT without the experts::

    trainer = transformers.Trainer(model=patched_model, args=args, train_dataset=data,
                                   callbacks=[KTAdapterCallback()])

Importing this module imports transformers.
"""
from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from kt_ops.distributed import expert_parameter_names
from kt_ops.hf.adapters import save_adapter
from kt_ops.hf.patch import patched_experts
from kt_ops.layer import _BASE_NAMES, _BIAS_NAMES, _SCALE_NAMES

_BASE_AND_SCALES = set(_BASE_NAMES + _SCALE_NAMES + _BIAS_NAMES)  # the frozen base: weights, scales, biases


class KTAdapterCallback(TrainerCallback):
    """Writes the expert adapter into each checkpoint folder the Trainer saves (on the rank
    that owns the experts; other ranks hold no expert LoRA). ``save_frozen_experts=False``
    (default): the frozen expert base weights (and scales) are left out of the checkpoints'
    model files, through transformers' ``_keys_to_ignore_on_save``; trainable ones
    (``train_base=True``) are always saved."""

    def __init__(self, save_frozen_experts: bool = False):
        self.save_frozen_experts = save_frozen_experts

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or self.save_frozen_experts:
            return control
        params = dict(model.named_parameters())
        frozen = {n for n in expert_parameter_names(model) if n.rsplit(".", 1)[-1] in _BASE_AND_SCALES
                  and not params[n].requires_grad}
        # on the model whose save_pretrained the Trainer calls (a PEFT model saves adapters only)
        model._keys_to_ignore_on_save = set(getattr(model, "_keys_to_ignore_on_save", None) or ()) | frozen
        return control

    def on_save(self, args, state, control, model=None, **kwargs):
        experts = patched_experts(model) if model is not None else []
        if experts and experts[0][1].is_owner and experts[0][1].lora_rank:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_adapter(model, folder)
        return control
