"""transformers.Trainer integration: the kt expert adapter in every Trainer checkpoint.

``Trainer`` checkpoints hold the whole model (``model.safetensors``, experts included) and
resume from it unchanged. :class:`KTAdapterCallback` also writes the expert LoRA in PEFT's
adapter format (:func:`kt_ops.save_adapter`) into each ``checkpoint-<step>`` folder, so that a
checkpoint's adapter loads with :func:`kt_ops.load_adapter` or plain PEFT without the experts::

    trainer = transformers.Trainer(model=patched_model, args=args, train_dataset=data,
                                   callbacks=[KTAdapterCallback()])

Importing this module imports transformers.
"""
from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from kt_ops.hf.adapters import save_adapter
from kt_ops.hf.patch import patched_experts


class KTAdapterCallback(TrainerCallback):
    """Writes the expert adapter into each checkpoint folder the Trainer saves (on the rank
    that owns the experts; other ranks hold no expert LoRA)."""

    def on_save(self, args, state, control, model=None, **kwargs):
        experts = patched_experts(model) if model is not None else []
        if experts and experts[0][1].is_owner and experts[0][1].lora_rank:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_adapter(model, folder)
        return control
