"""transformers.Trainer integration: kt checkpoints that resume on any number of ranks, and a
failure on one rank that ends the job on every rank.

``Trainer`` checkpoints hold the model (``model.safetensors``) and resume from it.
:class:`KTAdapterCallback` leaves the *frozen* expert base weights out of them (by default:
they are the base checkpoint's, hundreds of GB for the models kt_ops is for, and the Trainer's
resume loads checkpoints non-strictly, so the experts already in memory stay), writes the
expert LoRA in PEFT's adapter format (:func:`kt_ops.save_adapter`) into each
``checkpoint-<step>`` folder, each rank's own optimizer state (only expert owners hold the
expert LoRA, so the ranks' optimizers differ; the Trainer saves rank 0's alone) and, last,
the layout record that makes the checkpoint complete (:mod:`kt_ops.hf.checkpoints`).

:class:`KTTrainer` (or :class:`KTTrainerMixin` before another Trainer class) reads them back:
``resume_from_checkpoint`` a folder, or ``True`` / ``"latest"`` for the newest complete one;
each rank loads its own optimizer state; an incomplete or unreadable checkpoint, or one of
another layout, is refused on every rank before any step. An exception on any rank inside
``train()`` ends the job on every rank within seconds (:func:`kt_ops.faults.fail_fast`)::

    trainer = KTTrainer(model=patched_model, args=args, train_dataset=data)  # adds KTAdapterCallback
    trainer.train(resume_from_checkpoint="latest")

Importing this module imports transformers.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist
import transformers
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from kt_ops import faults
from kt_ops.distributed import create_process_groups, expert_parameter_names
from kt_ops.hf import checkpoints
from kt_ops.hf.adapters import save_adapter
from kt_ops.hf.patch import patched_experts
from kt_ops.layer import _BASE_NAMES, _BIAS_NAMES, _GLOBAL_SCALE_NAMES, _SCALE_NAMES

_BASE_AND_SCALES = set(_BASE_NAMES + _SCALE_NAMES + _GLOBAL_SCALE_NAMES + _BIAS_NAMES)  # the frozen base: weights, scales, biases


def _sharded(model) -> bool:
    experts = patched_experts(model) if model is not None else []
    return bool(experts) and experts[0][1].expert_shards > 1


def _own_optimizer_files(args) -> bool:
    """Whether kt writes the ranks' optimizer files (the Trainer's plain DDP path); FSDP and
    DeepSpeed save per-rank optimizer state of their own."""
    return not (args.save_only_model or args.fsdp or args.deepspeed)


class KTAdapterCallback(TrainerCallback):
    """Writes, into each checkpoint folder the Trainer saves: the expert adapter (on the first
    rank that owns experts), each rank r >= 1's optimizer state (``optimizer_<r>.pt``) and,
    on rank 0, ``kt_checkpoint.json`` (the layout and the files the checkpoint holds).
    ``save_frozen_experts=False`` (default): the frozen expert base weights (and scales) are
    left out of the checkpoints' model files, through transformers' ``_keys_to_ignore_on_save``;
    trainable ones (``train_base=True``) are always saved."""

    def __init__(self, save_frozen_experts: bool = False):
        self.save_frozen_experts = save_frozen_experts
        self.layout: Optional[checkpoints.JobLayout] = None  # set by KTTrainer, else at train begin

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return control
        if self.layout is None:
            self.layout = checkpoints.job_layout(model)  # every rank is here: a collective is safe
        if self.save_frozen_experts:
            return control
        params = dict(model.named_parameters(remove_duplicate=False))  # gate_lora_a's tied twin too
        frozen = {n for n in expert_parameter_names(model) if n.rsplit(".", 1)[-1] in _BASE_AND_SCALES
                  and not params[n].requires_grad}
        if _sharded(model):
            # Each owner holds other experts under the same names: rank 0's model file would give
            # every owner shard 0's tensors on resume. The LoRA travels in the checkpoint's adapter
            # instead (gathered on save, each owner's rows read back on resume).
            if any(params[n].requires_grad and n.rsplit(".", 1)[-1] in _BASE_AND_SCALES
                   for n in expert_parameter_names(model)):
                raise ValueError("kt_ops: Trainer checkpoints of sharded experts (expert_shards > 1) with trainable "
                                 "base weights (train_base=True) are not supported: the checkpoint holds the expert "
                                 "LoRA only; train LoRA, or use one owner (expert_shards=1)")
            frozen |= set(expert_parameter_names(model))
        # on the model whose save_pretrained the Trainer calls (a PEFT model saves adapters only)
        model._keys_to_ignore_on_save = set(getattr(model, "_keys_to_ignore_on_save", None) or ()) | frozen
        return control

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        rank, world = args.process_index, args.world_size
        own_optimizers = _own_optimizer_files(args) and optimizer is not None
        if own_optimizers and rank > 0:
            os.makedirs(folder, exist_ok=True)
            checkpoints.save_atomically(optimizer.state_dict(), os.path.join(folder, checkpoints.optimizer_file(rank)))
        experts = patched_experts(model) if model is not None else []
        has_lora = bool(experts) and bool(experts[0][1].lora_rank)
        owners = self.layout.expert_owners if self.layout is not None else ()
        if has_lora:  # every rank takes part (sharded experts are gathered), the first owner writes
            save_adapter(model, folder, write=rank == (owners[0] if owners else 0))
        if rank == 0 and self.layout is not None:
            per_rank = [checkpoints.rng_file(r, world) for r in range(world)]
            if own_optimizers:
                per_rank += [checkpoints.optimizer_file(r) for r in range(world)]
            if has_lora:
                per_rank += list(checkpoints.ADAPTER_FILES)
            checkpoints.write_layout(folder, self.layout, per_rank)
        return control


class KTTrainerMixin:
    """Put before a ``transformers.Trainer`` class (``class MyTrainer(KTTrainerMixin, SFTTrainer)``)
    for kt's checkpoints and failure handling; see the module's docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if dist.is_initialized():  # owners="per-node": the groups made here, before a compiled step traces
            create_process_groups(self.model)
        if not any(isinstance(c, KTAdapterCallback) for c in self.callback_handler.callbacks):
            self.add_callback(KTAdapterCallback())
        self._kt_resume: Optional[checkpoints.CheckpointReader] = None

    def _kt_callback(self) -> KTAdapterCallback:
        return next(c for c in self.callback_handler.callbacks if isinstance(c, KTAdapterCallback))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        with faults.fail_fast():
            layout = checkpoints.job_layout(self.model)
            self._kt_callback().layout = layout
            saves = self.args.save_strategy != "no"
            if layout.expert_owners and 0 not in layout.expert_owners and (saves or resume_from_checkpoint):
                raise ValueError(f"kt_ops: Trainer checkpoints need rank 0 to own experts (rank 0 writes the "
                                 f"model's trained tensors); this job has {layout.describe()}")
            if resume_from_checkpoint is True:
                resume_from_checkpoint = "latest"
            if resume_from_checkpoint:
                self._kt_resume = checkpoints.open_for_resume(str(resume_from_checkpoint), self.args.output_dir,
                                                              layout)
                resume_from_checkpoint = self._kt_resume.folder
            try:
                return super().train(resume_from_checkpoint or None, *args, **kwargs)
            finally:
                self._kt_resume = None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        kt_model = self.model
        if _sharded(kt_model) and patched_experts(kt_model)[0][1].lora_rank:
            # The expert LoRA is not in the model file of sharded experts: each owner reads its
            # rows of the checkpoint's adapter (kt_ops.hf.adapters.load_expert_part).
            from kt_ops.hf.adapters import is_peft_model, load_expert_part

            load_expert_part(kt_model.get_base_model() if is_peft_model(kt_model) else kt_model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        reader = self._kt_resume
        if (checkpoint is None or reader is None or reader.folder != checkpoint or reader.optimizer_state is None
                or reader.scheduler_state is None or not _own_optimizer_files(self.args)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # This rank's own optimizer state and the scheduler's, already read and checked by open_for_resume.
        self.optimizer.load_state_dict(reader.optimizer_state)
        self.lr_scheduler.load_state_dict(reader.scheduler_state)
        reader.optimizer_state = reader.scheduler_state = None


class KTTrainer(KTTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with kt's checkpoints and failure handling (:class:`KTTrainerMixin`)."""
