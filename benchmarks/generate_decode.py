"""Greedy decode tokens/s of a kt-patched model against the unpatched transformers model, on the
same CPU in one run, with and without a LoRA adapter (before merging).

A synthetic Qwen3-MoE (random weights; default H=1024, moe_intermediate 512, 32 experts, top-4,
4 layers) is saved once per dtype (bf16, fp32) and loaded both ways: kt_ops' as
``python -m kt_ops.generate`` does (``kt_ops.hf.from_pretrained`` + ``kt_ops.hf.load_adapter``),
transformers' with ``AutoModelForCausalLM.from_pretrained`` (its default experts implementation)
+ ``peft.PeftModel.from_pretrained``. The adapter is PEFT LoRA on q/k/v/o and the experts
(``target_parameters``), B nonzero. Each configuration generates ``--new-tokens`` tokens after a
``--prompt-tokens`` prompt, KV cache on, the two models alternating, one untimed run each first;
the median of ``--repeats`` runs is printed, with whether the two produced the same tokens.

    .venv/bin/python -m benchmarks.generate_decode            # the size above
    .venv/bin/python -m benchmarks.generate_decode --smoke    # a tiny model: checks that it runs
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from benchmarks.common import cpu_model, text_table
from kt_ops import generate as gen

MODEL = dict(hidden_size=1024, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4, num_hidden_layers=4,
             intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=4096)
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
RANK, ALPHA = 8, 16


def save_model(fields: dict, dtype: torch.dtype, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**fields, tie_word_embeddings=False, max_position_embeddings=4096)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(out_dir)


def save_adapter(model_dir: str, out_dir: str) -> None:
    """PEFT LoRA on attention and the experts of the unpatched model, B drawn (it starts at 0)."""
    import peft
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir)


def load_transformers(model_dir: str, adapter_dir, dtype: torch.dtype):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return (peft.PeftModel.from_pretrained(model, adapter_dir) if adapter_dir else model).eval()


def compare(model_dir: str, adapter_dir, dtype: torch.dtype, prompt: torch.Tensor, args) -> dict:
    """Decode tokens/s of both models, alternating, median of args.repeats runs."""
    models = {"transformers": load_transformers(model_dir, adapter_dir, dtype),
              "kt": gen.load(model_dir, adapter_dir, dtype=dtype)}
    rates = {name: [] for name in models}
    tokens = {}
    for run in range(args.repeats + 1):  # run 0: untimed warm-up
        for name, model in models.items():
            new, stats = gen.generate_ids(model, prompt, args.new_tokens, args.new_tokens)
            tokens[name] = new
            if run:
                rates[name].append(stats.decode_tokens_per_s)
    hf, kt = (statistics.median(rates[n]) for n in ("transformers", "kt"))
    return dict(transformers=hf, kt=kt, speedup=kt / hf, same_tokens=bool(torch.equal(*tokens.values())))


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model, few tokens, one repeat: checks that it runs")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    fields = SMOKE if args.smoke else MODEL
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.repeats = 8, 4, 1
    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, fields["vocab_size"], (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype_name in args.dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, adapter_dir = f"{tmp}/model", f"{tmp}/adapter"
            save_model(fields, DTYPES[dtype_name], model_dir)
            save_adapter(model_dir, adapter_dir)
            for adapter in (None, adapter_dir):
                result = compare(model_dir, adapter, DTYPES[dtype_name], prompt, args)
                rows.append(dict(dtype=dtype_name, adapter="yes" if adapter else "no", **result))
    print(f"Greedy decode tokens/s (median of {args.repeats}), Qwen3-MoE H={fields['hidden_size']} "
          f"I={fields['moe_intermediate_size']} E={fields['num_experts']} top-{fields['num_experts_per_tok']} "
          f"{fields['num_hidden_layers']} layers, prompt {args.prompt_tokens} + {args.new_tokens} new tokens, "
          f"{args.threads} threads, CPU {cpu_model()}")

    def fmt(key, value):
        if isinstance(value, float):
            return f"{value:.2f}x" if key == "speedup" else f"{value:.1f}"
        return "yes" if value is True else "no" if value is False else str(value)

    columns = [("dtype", "dtype"), ("adapter", "adapter"), ("transformers", "transformers tok/s"),
               ("kt", "kt tok/s"), ("speedup", "kt / transformers"), ("same_tokens", "same tokens")]
    print(text_table(rows, columns, {"transformers", "kt", "speedup"}, fmt))
    return rows


if __name__ == "__main__":
    main()
