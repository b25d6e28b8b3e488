"""The fine-tuning application (``python -m kt_ops.finetune``, ``kt-finetune``), apart from the
library it uses: the command line and its job (``cli``), its training run on
:class:`kt_ops.hf.trainer.KTTrainer` (``training``), the byte-level tokenizer of the built-in
demo model (``tokenizer``) and the shipped corpus (``data``). See ``cli``'s docstring.
"""
from kt_ops.finetune.cli import (BACKENDS, DEFAULT_MODEL_CONFIG, DTYPES, FinetuneResult, also_train,
                                 attach_peft_lora, batch_offsets, build_base_model, build_kt_model, compare,
                                 enable_checkpointing, expert_parameters, load_tokens, main, model_summary,
                                 parse_args, plot_losses, run, slow_bf16_note)

__all__ = ["BACKENDS", "DEFAULT_MODEL_CONFIG", "DTYPES", "FinetuneResult", "also_train", "attach_peft_lora",
           "batch_offsets", "build_base_model", "build_kt_model", "compare", "enable_checkpointing",
           "expert_parameters", "load_tokens", "main", "model_summary", "parse_args", "plot_losses", "run",
           "slow_bf16_note"]
