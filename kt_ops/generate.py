"""Greedy generation from a checkpoint with kt_ops' experts and, optionally, a trained LoRA
adapter applied as it is (no merge): prefill and every decode step run the routed experts through
``kt.moe`` (decode steps, one token each, on its streaming row-dot-product path), with the KV cache.

    python -m kt_ops.generate --model DIR [--adapter DIR] --prompt TEXT [--max-new-tokens 32]
        [--expert-format bf16|fp8|int8|int4|mxfp4|nvfp4] [--dtype float32|bfloat16] [--threads N]

Prints the generated text on stdout and the prefill and decode tokens/s on stderr (one cold run:
first-call costs included; ``benchmarks/generate_decode.py`` warms up and repeats). The model is
read by :func:`kt_ops.hf.from_pretrained` (shard by shard, with the adapter's LoRA rank), the
adapter by :func:`kt_ops.hf.load_adapter` (which wraps the model with PEFT where the adapter also
has LoRA on attention), the tokenizer from the model directory by transformers' AutoTokenizer.
:func:`load` and :func:`generate` are the same steps for scripts and tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int  # per sequence
    new_tokens: int  # per sequence
    prefill_s: float  # the prompt's forward and the first new token
    decode_s: float  # the other new tokens, one forward each
    batch: int = 1

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - 1
        return self.batch * steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


class _TokenClock:
    """A transformers streamer that only notes when each batch of tokens arrives: first the
    prompt (before prefill), then each new token (the first one right after prefill)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def adapter_rank(adapter_dir: str) -> tuple[int, float]:
    """(r, lora_alpha) of ``adapter_dir``'s adapter_config.json, checked as loading checks it
    (ValueError naming the directory where there is none or it does not fit)."""
    from kt_ops.hf.adapters import lora_fields, read_adapter_config

    r, alpha, _ = lora_fields(read_adapter_config(adapter_dir, "--adapter"), f"--adapter {adapter_dir!r}")
    return r, alpha


def load(model_dir: str, adapter_dir: Optional[str] = None, expert_format: Optional[str] = None,
         dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The patched model of ``model_dir`` with ``adapter_dir``'s adapter loaded (possibly a PEFT
    model wrapping it: see :func:`kt_ops.hf.load_adapter`), in eval mode."""
    import kt_ops

    r, alpha = adapter_rank(adapter_dir) if adapter_dir else (0, None)
    model = kt_ops.hf.from_pretrained(model_dir, lora_rank=r, lora_alpha=alpha, expert_format=expert_format,
                                      dtype=dtype, progress=False)
    if adapter_dir:
        model = kt_ops.hf.load_adapter(model, adapter_dir)
    return model.eval()


def generate_ids(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                 min_new_tokens: int = 0) -> tuple[torch.Tensor, GenerationStats]:
    """Greedy ``model.generate`` with the KV cache: (the new token ids [B, n], timings)."""
    device = model.get_input_embeddings().weight.device
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=torch.ones_like(input_ids, device=device),
                             do_sample=False, use_cache=True, max_new_tokens=max_new_tokens,
                             min_new_tokens=min_new_tokens, streamer=clock)
    new = out[:, input_ids.shape[1]:]
    # clock.times: the prompt, then one entry per step (the batch's new tokens together)
    first, last = (clock.times[1], clock.times[-1]) if len(clock.times) > 1 else (start, start)
    return new, GenerationStats(prompt_tokens=input_ids.shape[1], new_tokens=new.shape[1], prefill_s=first - start,
                                decode_s=last - first, batch=input_ids.shape[0])


def generate(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int = 32,
             min_new_tokens: int = 0) -> tuple[str, GenerationStats]:
    """The greedy continuation of ``prompt`` (text) and its timings."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError(f"prompt {prompt!r} is empty once tokenized")
    new, stats = generate_ids(model, ids, max_new_tokens, min_new_tokens)
    return tokenizer.decode(new[0], skip_special_tokens=True), stats


# A saved tokenizer has one of these (tokenizer_config.json from save_pretrained; the others are
# the vocabularies older repositories ship alone).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(model_dir: str):
    """transformers' AutoTokenizer of ``model_dir``; ValueError naming --model without one."""
    from transformers import AutoTokenizer

    # Checked first: transformers 5 builds an empty tokenizer of the config's model type from a
    # directory without tokenizer files (every prompt then encodes to no tokens).
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"--model {model_dir!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}; "
                         f"save one there with tokenizer.save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"--model {model_dir!r} has no tokenizer that transformers' AutoTokenizer can load "
                         f"(save one there with tokenizer.save_pretrained): {error}") from error


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kt_ops.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--adapter", help="PEFT LoRA adapter directory (experts, and attention if it has it)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--expert-format", help="the routed experts' format (default: the checkpoint's dtype)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="the model's dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, path in (("--model", args.model), ("--adapter", args.adapter)):
        if path is not None and not os.path.isdir(path):
            parser.error(f"{flag} {path!r} is not a directory")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        tokenizer = load_tokenizer(args.model)
        model = load(args.model, args.adapter, args.expert_format, DTYPES.get(args.dtype))
        text, stats = generate(model, tokenizer, args.prompt, args.max_new_tokens)
    except ValueError as error:  # what the arguments named could not be used: say which and why
        parser.error(str(error))
    print(text)
    print(f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s; "
          f"decode: {stats.new_tokens - 1} tokens, {stats.decode_tokens_per_s:.1f} tokens/s "
          f"({torch.get_num_threads()} threads)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
