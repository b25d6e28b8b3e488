"""Base checkpoints, adapters and references for the adapter-merge tests (tests/test_merge.py).

* :func:`write_base`: a tiny Qwen3-MoE (or DeepSeek-V3) checkpoint in ``bf16`` / ``fp32`` / ``fp8``
  (FP8 blocks) / ``int4`` (compressed-tensors pack-quantized) / ``gptq``, optionally in several
  shards, written by transformers' ``save_pretrained`` and ``tests/checkpoint_samples.py``'s
  writers (no tokenizer), beside the float checkpoint it was quantized from;
* :func:`write_adapter`: a PEFT adapter with LoRA on the routed experts (kt's part) and on the
  attention (PEFT's part), random nonzero A and B, as ``kt_ops.hf.save_adapter`` writes it;
* :func:`reference_logits`: the logits of the patched model with the adapter
  (``kt_ops.hf.from_pretrained`` + ``kt_ops.hf.load_adapter``), what a merged checkpoint must give;
* :func:`write_synthetic_base` / :func:`write_synthetic_adapter`: a large Qwen3-MoE checkpoint
  and an adapter for it written straight from tensors (no model in memory), for the memory and
  interruption tests.

Run as a script, it does what must happen in a fresh process:

    python tests/merge_samples.py stock-logits DIR OUT.pt        # transformers alone, no kt_ops
    python tests/merge_samples.py kt-logits DIR OUT.pt           # kt_ops.hf.from_pretrained (GPTQ)
    python tests/merge_samples.py synthetic DIR ADAPTER SHARDS   # the large base + its adapter
    python tests/merge_samples.py merge-memory BASE ADAPTER OUT REPORT.json

This module imports neither kt_ops nor transformers at import time (the ``stock-logits`` process
must not import kt_ops): they are imported where used.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch

R, ALPHA = 4, 8
QWEN_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEEPSEEK_ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FORMATS = ("bf16", "fp32", "fp8", "int4", "gptq")
QUANTIZED = ("fp8", "int4", "gptq")
# compressed-tensors' config targets every Linear: the Linear modules write_int4 leaves in float
# (q/k/v; the embeddings, router and head are not Linear modules it quantizes, or ignored) are
# named in "ignore", as llm-compressor writes them (else transformers expects them packed)
INT4_IGNORE = ["lm_head", r"re:.*self_attn\.(q|k|v)_proj$", r"re:.*mlp\.gate$"]


def _tests_path() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)


def input_ids(vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))


def _max_shard_size(model, shards: int) -> int:
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return total // shards + 1


def write_base(root, fmt: str, *, shards: int = 1, family: str = "qwen3_moe", seed: int = 0, **overrides) -> dict:
    """A tiny base checkpoint in ``root/base`` in format ``fmt`` (see :data:`FORMATS`), in about
    ``shards`` shards (``save_pretrained(max_shard_size=...)``), and the float checkpoint it
    holds (``root/float``: the base itself for bf16 / fp32; for the quantized formats the fp32
    checkpoint they were quantized from, and ``root/dequantized`` the float checkpoint of the
    values they stand for). ``overrides``: Qwen3-MoE config fields. Returns {"base", "float",
    "dequantized"} (paths as str; dequantized is None for float formats)."""
    _tests_path()
    import checkpoint_samples as samples

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    root = os.fspath(root)
    # quantized bases from an fp32 model: transformers' FP8 dequantization on the CPU gives bf16
    # weights, which a model loaded with dtype=float32 from a bf16 config cannot multiply with its
    # float32 activations; an fp32 config keeps them fp32, and the logits compare in fp32
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    if family == "qwen3_moe":
        model = samples.tiny_qwen3_moe(dtype, seed=seed, **overrides)
    elif not overrides:
        model = samples.tiny_deepseek_v3(dtype, seed=seed)
    else:
        raise ValueError("config overrides are for qwen3_moe only")
    base = os.path.join(root, "base")
    floats = base if fmt in ("bf16", "fp32") else os.path.join(root, "float")
    kwargs = {"max_shard_size": _max_shard_size(model, shards)} if shards > 1 else {}
    model.save_pretrained(floats, **kwargs)
    dequantized = None
    if fmt in QUANTIZED:
        dequantized = os.path.join(root, "dequantized")
        writer = {"fp8": samples.write_fp8, "int4": samples.write_int4, "gptq": samples.write_gptq}[fmt]
        writer(floats, base, dequantized)
        if fmt == "int4":
            path = os.path.join(base, "config.json")
            with open(path) as f:
                config = json.load(f)
            config["quantization_config"]["ignore"] = list(INT4_IGNORE)
            with open(path, "w") as f:
                json.dump(config, f)
    return {"base": base, "float": floats, "dequantized": dequantized}


def lora_config(target_modules=None, r: int = R, alpha: float = ALPHA, **kwargs):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules or QWEN_ATTENTION),
                      lora_dropout=0.0, **kwargs)


def write_adapter(base_dir, adapter_dir, *, r: int = R, alpha: float = ALPHA, target_modules=None,
                  seed: int = 1, scale: float = 0.15, use_rslora: bool = False) -> None:
    """An adapter for the checkpoint ``base_dir`` in ``adapter_dir``: LoRA of rank ``r`` on the
    routed experts (gate_up and down) and on ``target_modules`` (default q/k/v/o_proj), every A
    and B drawn ``scale * N(0, 1)`` (PEFT and kt start B at zero: an adapter that changes
    nothing), written by ``kt_ops.hf.save_adapter`` in PEFT's layout (fp32 tensors)."""
    _tests_path()
    import kt_ops
    from moe_testing import randomize_lora

    model = kt_ops.hf.from_pretrained(os.fspath(base_dir), lora_rank=r, lora_alpha=alpha, dtype=torch.float32,
                                      progress=False)
    peft_model = kt_ops.hf.get_peft_model(model, lora_config(target_modules, r, alpha, use_rslora=use_rslora))
    randomize_lora(peft_model, lambda name: "lora_" in name.lower(), seed=seed, scale=scale)
    kt_ops.hf.save_adapter(peft_model, os.fspath(adapter_dir))


def read_adapter_config(adapter_dir) -> dict:
    with open(os.path.join(os.fspath(adapter_dir), "adapter_config.json")) as f:
        return json.load(f)


def reference_logits(base_dir, adapter_dir=None, ids=None, dtype=torch.float32) -> torch.Tensor:
    """Logits (float64) of ``kt_ops.hf.from_pretrained(base_dir)`` (the base dequantized to
    ``dtype``) with the adapter ``adapter_dir`` loaded by ``kt_ops.hf.load_adapter`` (None: the
    base alone), on ``ids`` (default :func:`input_ids`)."""
    import kt_ops

    ids = input_ids() if ids is None else ids
    if adapter_dir is None:
        model = kt_ops.hf.from_pretrained(os.fspath(base_dir), dtype=dtype, progress=False)
    else:
        config = read_adapter_config(adapter_dir)
        model = kt_ops.hf.from_pretrained(os.fspath(base_dir), lora_rank=config["r"], lora_alpha=config["lora_alpha"],
                                          dtype=dtype, progress=False)
        model = kt_ops.hf.load_adapter(model, os.fspath(adapter_dir))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


# ---------------------------------------------------------------------------------------------
# Fresh-process loaders


def stock_logits(path: str, dtype=torch.float32, ids=None) -> torch.Tensor:
    """The logits of ``AutoModelForCausalLM.from_pretrained(path)`` (transformers alone: FP8
    blocks dequantized on the CPU by its FineGrainedFP8 quantizer, compressed-tensors INT4 by
    compressed-tensors) in float64; called in a process that has not imported kt_ops."""
    from transformers import AutoModelForCausalLM

    assert "kt_ops" not in sys.modules
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = input_ids(model.config.vocab_size) if ids is None else ids
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    assert "kt_ops" not in sys.modules, "transformers imported kt_ops"
    return logits


def kt_logits(path: str, dtype=torch.float32) -> torch.Tensor:
    """The logits of ``kt_ops.hf.from_pretrained(path)`` (reads GPTQ, which stock transformers
    needs gptqmodel / optimum for)."""
    return reference_logits(path, None, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Large synthetic checkpoints, written from tensors


def synthetic_config(**overrides) -> dict:
    """Qwen3-MoE of 1.5 GiB of bf16 experts: hidden 1024, 64 experts of intermediate 1024, 4 layers."""
    fields = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=64,
                  num_experts_per_tok=4, tie_word_embeddings=False, max_position_embeddings=128)
    fields.update(overrides)
    return fields


def synthetic_shapes(c: dict) -> dict:
    """{checkpoint key: shape} of a Qwen3-MoE of config fields ``c``, experts per expert (the hub
    layout, what save_pretrained writes)."""
    H, I, E, D = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], H)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "mlp.gate.weight": (E, H)})
        for e in range(E):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (I, H), f"{p}mlp.experts.{e}.up_proj.weight": (I, H),
                           f"{p}mlp.experts.{e}.down_proj.weight": (H, I)})
    shapes.update({"model.norm.weight": (H,), "lm_head.weight": (c["vocab_size"], H)})
    return shapes


def _random_pool(shapes, dtype, seed: int, std: float = 0.02) -> dict:
    """One random tensor per distinct shape (cloned for every tensor of that shape: drawing
    1.5 GiB of normals would take longer than the test)."""
    g = torch.Generator().manual_seed(seed)
    return {s: (std * torch.randn(s, generator=g)).to(dtype) for s in set(shapes)}


def write_synthetic_base(path, shards: int, dtype=torch.bfloat16, seed: int = 0, **overrides) -> dict:
    """The Qwen3-MoE of :func:`synthetic_config` ``(**overrides)`` as a checkpoint of ``shards``
    safetensors shards (keys in model order, cut by size) with its config.json. Returns the
    config fields."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    c = synthetic_config(**overrides)
    Qwen3MoeConfig(**c, dtype=str(dtype).removeprefix("torch.")).save_pretrained(path)
    shapes = synthetic_shapes(c)
    pool = _random_pool(shapes.values(), dtype, seed)
    norm_like = {k for k, s in shapes.items() if len(s) == 1}
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(s) * itemsize for s in shapes.values())
    target = total / shards
    keys, files, size, weight_map = list(shapes), [], 0, {}
    current: list[str] = []
    for key in keys:
        current.append(key)
        size += math.prod(shapes[key]) * itemsize
        if size >= target * (len(files) + 1) or key == keys[-1]:
            files.append(current)
            current = []
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for name, chunk in zip(names, files):
        tensors = {k: (torch.ones(shapes[k], dtype=dtype) if k in norm_like else pool[shapes[k]].clone())
                   for k in chunk}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in chunk})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return c


def write_synthetic_adapter(c: dict, adapter_dir, *, r: int = R, alpha: float = ALPHA, seed: int = 1,
                            scale: float = 0.05) -> None:
    """An adapter in the layout kt_ops.hf.save_adapter writes (PEFT's), for the Qwen3-MoE of
    config fields ``c``: LoRA on q/k/v/o_proj (``lora_A [r, in]``, ``lora_B [out, r]``) and on the
    routed experts (``experts.base_layer.lora_{A,B}``: gate_up, ``[r·E, H]`` / ``[2I, r·E]``;
    ``experts.lora_{A,B}``: down, ``[r·E, I]`` / ``[H, r·E]``), fp32, random."""
    from safetensors.torch import save_file

    adapter_dir = os.fspath(adapter_dir)
    os.makedirs(adapter_dir, exist_ok=True)
    H, I, E, D = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{layer}."
        for name, (out, inp) in {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q)}.items():
            tensors[f"{p}self_attn.{name}.lora_A.weight"] = scale * torch.randn(r, inp, generator=g)
            tensors[f"{p}self_attn.{name}.lora_B.weight"] = scale * torch.randn(out, r, generator=g)
        tensors[f"{p}mlp.experts.base_layer.lora_A.weight"] = scale * torch.randn(r * E, H, generator=g)
        tensors[f"{p}mlp.experts.base_layer.lora_B.weight"] = scale * torch.randn(2 * I, r * E, generator=g)
        tensors[f"{p}mlp.experts.lora_A.weight"] = scale * torch.randn(r * E, I, generator=g)
        tensors[f"{p}mlp.experts.lora_B.weight"] = scale * torch.randn(H, r * E, generator=g)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
              "bias": "none", "use_rslora": False, "use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
              "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, "base_model_name_or_path": None,
              "target_modules": list(QWEN_ATTENTION),
              "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def shard_paths(path) -> list[str]:
    path = os.fspath(path)
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def merge_memory(base: str, adapter: str, out: str, report: str) -> None:
    """Peak resident memory (VmHWM, reset after the imports: tests/loading_memory_run.py) of
    ``kt_ops.hf.merge_adapter(base, adapter, out)`` in this fresh process, into ``report``."""
    _tests_path()
    from loading_memory_run import peak_since_reset, reset_peak, resident_bytes

    import safetensors.torch  # noqa: F401  (the libraries are the baseline, not the merge)
    import transformers  # noqa: F401
    import kt_ops.hf
    from kt_ops.hf.merge import merge_adapter  # noqa: F401

    baseline = resident_bytes()
    reset_peak()
    summary = kt_ops.hf.merge_adapter(base, adapter, out, progress=False)
    peak = peak_since_reset()
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(base)
    layer_fp32 = c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size * 4
    with open(report, "w") as f:
        json.dump({"baseline": baseline, "peak": peak, "final": resident_bytes(),
                   "largest_shard": max(os.path.getsize(p) for p in shard_paths(base)),
                   "layer_fp32_experts": layer_fp32, "merged": len(summary.merged), "copied": summary.copied}, f)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "stock-logits":
        torch.save(stock_logits(args[0]), args[1])
    elif command == "kt-logits":
        torch.save(kt_logits(args[0]), args[1])
    elif command == "synthetic":
        c = write_synthetic_base(args[0], int(args[2]))
        write_synthetic_adapter(c, args[1])
    elif command == "merge-memory":
        merge_memory(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")
