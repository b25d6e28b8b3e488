"""Hugging Face integration: run transformers MoE models with KTMoE experts, PEFT adapters.

- :func:`patch_model` replaces the MoE blocks of Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2
  and DeepSeek-V3 models (transformers 5.x) with KTMoE-backed blocks, in place.
- :func:`save_adapter` / :func:`load_adapter` write and read the expert LoRA in PEFT's
  adapter format (``adapter_model.safetensors`` + ``adapter_config.json``), interchangeable
  with ``PeftModel`` on the unpatched model.

Importing this package does not import transformers or peft (they are imported lazily).
"""
from kt_ops.hf.adapters import load_adapter, save_adapter
from kt_ops.hf.patch import SUPPORTED_ARCHITECTURES, KTSparseMoeBlock, patch_model

__all__ = ["patch_model", "save_adapter", "load_adapter", "KTSparseMoeBlock", "SUPPORTED_ARCHITECTURES"]
