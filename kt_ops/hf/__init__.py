"""Hugging Face integration: run transformers MoE models with KTMoE experts, PEFT adapters.

- :func:`patch_model` moves the routed experts of transformers 5.x MoE models (any family
  whose experts module follows transformers' experts contract with SwiGLU experts) onto kt:
  each experts module becomes a :class:`KTExperts` on the owner rank's CPU, in place.
- ``"kt"`` is one of transformers' experts implementations once ``kt_ops`` is imported
  (``from_pretrained(..., experts_implementation="kt")``, ``model.set_experts_implementation("kt")``:
  kt.moe on the module's own weights), registered when transformers loads its experts module
  (:mod:`kt_ops.hf.experts_registration`); :func:`register_kt_experts` does it by hand.
- :func:`from_pretrained` builds a patched model straight from a checkpoint's safetensors
  shards (bf16, FP8 blocks, compressed-tensors INT4), with bounded memory (:mod:`kt_ops.hf.loading`).
- :func:`get_peft_model` puts PEFT LoRA on the other modules (attention) of a patched model;
  one adapter then holds both. PEFT's adapter switches (``disable_adapter()``, named adapters)
  reach the experts' LoRA (:mod:`kt_ops.hf.expert_adapters`, :mod:`kt_ops.hf.peft_experts`),
  so TRL's trainers work as they ship.
- :func:`save_adapter` / :func:`load_adapter` write and read the expert LoRA in PEFT's
  adapter format (``adapter_model.safetensors`` + ``adapter_config.json``), interchangeable
  with ``PeftModel`` on the unpatched model.
- :func:`merge_adapter` merges such an adapter into its base checkpoint, streamed shard by
  shard, in the base's own format (:mod:`kt_ops.hf.merge`).

Importing this package does not import transformers or peft (they are imported lazily).
"""
from kt_ops.hf.adapters import save_adapter
from kt_ops.hf.experts import KTExperts, experts_support, register_kt_experts
from kt_ops.hf.experts_registration import register_when_transformers_loads
from kt_ops.hf.loading import from_pretrained
from kt_ops.hf.merge import merge_adapter
from kt_ops.hf.patch import patch_model, patched_experts
from kt_ops.hf.peft_attention import get_peft_model, load_adapter

__all__ = ["from_pretrained", "get_peft_model", "merge_adapter", "patch_model", "patched_experts", "save_adapter", "load_adapter", "KTExperts", "experts_support",
           "register_kt_experts"]

register_when_transformers_loads()
