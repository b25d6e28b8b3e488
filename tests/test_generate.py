"""Generation with a trained adapter before merging (issue 44, part 4): ``kt_ops.generate``.

For two families with different routing (Qwen3-MoE: softmax top-k; DeepSeek-V3: sigmoid scores
with a bias, MLA attention, a shared expert), in float32, 32 greedy tokens with the KV cache from
kt_ops (``kt_ops.hf.from_pretrained`` + ``kt_ops.hf.load_adapter``) equal the unpatched
transformers model's under plain PEFT holding the same adapter (LoRA with nonzero B on the experts
and on attention, written by PEFT), and without an adapter; the adapter changes the tokens.

The decode steps (one token each) take kt.moe's streaming row-dot-product path
(``thin_gemm_nt``, or the quantized GEMVs: no GEMM, no dequantized panel per token), and the
prefill its GEMM path. What shows it: in ``kt._moe_forward_cpu`` the GEMM path calls ATen's GEMM
(``aten::mm``, on the weights or on each dequantized panel; ``mkldnn`` linear on packed bf16
weights), a dispatched op the profiler records; the row-dot-product kernels are kt's own and
dispatch none. Recorded on one thread: the profiler does not see ops of OpenMP's worker threads.
Not covered by this: bf16 activations on quantized experts where the CPU has AMX (kt's own AMX
GEMM dispatches no ATen GEMM either, so the prefill check could not tell the paths apart).
"""
import copy
import functools
import os
import re
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
import checkpoint_samples as samples  # noqa: E402
from kt_ops import generate as gen  # noqa: E402
from moe_testing import randomize_lora  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R, ALPHA, NEW_TOKENS = 4, 8, 32
# 20 tokens x top-2 over 4 experts: some expert gets more than kt.moe's 4 decode-sized rows, so
# the prefill takes the GEMM path (the decode-path test checks that it does).
PROMPT = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
FAMILIES = {
    "qwen3_moe": (samples.tiny_qwen3_moe, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "deepseek_v3": (samples.tiny_deepseek_v3, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
}


def write_adapter(base, attention, out_dir, seed=1):
    """What a fine-tune leaves: PEFT LoRA on the unpatched model's experts and attention, with
    random A and B (B is zero at init), saved in PEFT's format."""
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=attention, lora_dropout=0.0,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(copy.deepcopy(base), config)
    randomize_lora(model, lambda name: "lora_" in name, seed)
    model.save_pretrained(out_dir)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(model dir, adapter dir) of a tiny random model of the family."""
    build, attention = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = build()
    base.save_pretrained(root / "model")
    write_adapter(base, attention, root / "adapter")
    return str(root / "model"), str(root / "adapter")


@functools.lru_cache(maxsize=None)
def reference_tokens(model_dir, adapter_dir):
    """The unpatched transformers model's greedy tokens, under plain PEFT with the adapter."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return tuple(gen.generate_ids(model.eval(), PROMPT, NEW_TOKENS, NEW_TOKENS)[0][0].tolist())


@pytest.mark.parametrize("with_adapter", [True, False], ids=["adapter", "plain"])
def test_greedy_tokens_equal_unpatched_transformers_with_peft(checkpoint, with_adapter):
    model_dir, adapter_dir = checkpoint
    adapter_dir = adapter_dir if with_adapter else None
    model = gen.load(model_dir, adapter_dir, dtype=torch.float32)
    assert kt_ops.hf.patched_experts(model)  # the experts are kt's
    new, stats = gen.generate_ids(model, PROMPT, NEW_TOKENS, NEW_TOKENS)
    assert (stats.prompt_tokens, stats.new_tokens) == (PROMPT.shape[1], NEW_TOKENS)
    assert tuple(new[0].tolist()) == reference_tokens(model_dir, adapter_dir)


def test_the_adapter_changes_the_tokens(checkpoint):
    """Else the adapter test above could pass with the adapter ignored."""
    model_dir, adapter_dir = checkpoint
    assert reference_tokens(model_dir, adapter_dir) != reference_tokens(model_dir, None)


@pytest.mark.parametrize("part", ["experts", "attention"])
def test_each_part_of_the_adapter_changes_the_tokens(checkpoint, part):
    """kt's tokens without the adapter's expert LoRA, or without its attention LoRA, are not the
    adapter's: the equality above needs both parts loaded."""
    model_dir, adapter_dir = checkpoint
    model = gen.load(model_dir, adapter_dir, dtype=torch.float32)
    b_factors = [p for name, p in model.named_parameters()
                 if "lora_b" in name.lower() and (".experts." in name) == (part == "experts")]
    assert b_factors
    with torch.no_grad():
        for p in b_factors:
            p.zero_()
    assert tuple(gen.generate_ids(model, PROMPT, NEW_TOKENS, NEW_TOKENS)[0][0].tolist()) != reference_tokens(
        model_dir, adapter_dir)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def _dispatched_ops(event):
    for child in event.cpu_children:
        yield child.name
        yield from _dispatched_ops(child)


def expert_calls(model, prompt):
    """(tokens, whether a GEMM op ran inside) of each kt.moe forward of a greedy generation."""
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every op on the profiled thread
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            gen.generate_ids(model, prompt, 8, 8)
    finally:
        torch.set_num_threads(threads)
    return [(e.input_shapes[0][0],
             any(n in GEMM_OPS or n.startswith("mkldnn::") for n in _dispatched_ops(e)))
            for e in prof.events() if e.name == "kt::_moe_forward_cpu"]


@pytest.mark.parametrize("dtype, expert_format", [(torch.float32, None), (torch.float32, "int4"),
                                                  (torch.bfloat16, None)], ids=["fp32", "int4", "bf16"])
def test_decode_steps_stream_the_experts_without_gemms(checkpoint, dtype, expert_format):
    model_dir, adapter_dir = checkpoint
    model = gen.load(model_dir, adapter_dir, expert_format=expert_format, dtype=dtype)
    calls = expert_calls(model, PROMPT)
    layers = len(kt_ops.hf.patched_experts(model))
    prefill = [gemm for tokens, gemm in calls if tokens == PROMPT.shape[1]]
    decode = [gemm for tokens, gemm in calls if tokens == 1]
    assert len(prefill) == layers and len(decode) == 7 * layers, calls
    assert all(prefill), calls  # the GEMM path shows where it runs ...
    assert not any(decode), calls  # ... and no decode step takes it


def tokenizer_checkpoint(root):
    """A tiny Qwen3-MoE with the project's byte-level tokenizer saved beside it (no download)."""
    from kt_ops.finetune.hf_tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    base = samples.tiny_qwen3_moe(vocab_size=len(tokenizer))
    base.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_adapter(base, FAMILIES["qwen3_moe"][1], root / "adapter")
    return root / "model", root / "adapter"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kt_ops.generate", *map(str, args)], cwd=REPO, timeout=120,
                          capture_output=True, text=True)


def test_cli_prints_text_and_rates(tmp_path):
    model_dir, adapter_dir = tokenizer_checkpoint(tmp_path)
    done = run_cli("--model", model_dir, "--adapter", adapter_dir, "--prompt", "Hello", "--max-new-tokens", 8,
                   "--dtype", "float32", "--threads", 1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "prefill:" in done.stderr and "decode: 7 tokens" in done.stderr and "tokens/s" in done.stderr


def test_cli_names_the_bad_argument(tmp_path, capsys):
    done = run_cli("--model", tmp_path / "missing", "--prompt", "Hello")
    assert done.returncode != 0 and "--model" in done.stderr and "not a directory" in done.stderr, done.stderr
    # transformers 5 would build an empty tokenizer from a model directory without one
    samples.tiny_qwen3_moe().save_pretrained(tmp_path / "no_tokenizer")
    for args, named in ((["--model", tmp_path / "no_tokenizer"], "--model .* has no tokenizer"),
                        (["--model", tmp_path / "no_tokenizer", "--adapter", tmp_path / "none"], "--adapter .* not a dir")):
        with pytest.raises(SystemExit) as raised:
            gen.main([*map(str, args), "--prompt", "Hello"])
        assert raised.value.code != 0
        assert re.search(named, capsys.readouterr().err)
