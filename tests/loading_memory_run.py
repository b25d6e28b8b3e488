"""Peak memory of loading a checkpoint, in a fresh process (VmHWM: the peak of this process's
own memory since exec; not ru_maxrss, which Linux carries over from the parent at fork + exec,
so that under a pytest process of 2 GB it read 2 GB before loading anything).

    python tests/loading_memory_run.py make DIR          # a Qwen3-MoE of >= 1 GiB in bf16, saved
    python tests/loading_memory_run.py kt DIR OUT.json   # kt_ops.hf.from_pretrained(expert_format="int4")
    python tests/loading_memory_run.py hf DIR OUT.json   # from_pretrained + patch_model(expert_format="int4")
    python tests/loading_memory_run.py shard DIR OUT.json S R   # rank R of S with expert_shards=S, bf16 as stored

``kt`` and ``hf`` write the peak and final resident sizes (``hf`` also patch_model's own peak),
the largest layer's bf16 expert bytes and the logits of a fixed input to OUT.json / OUT.pt.
"""
import json
import sys
import time

import torch

# hidden 1024, 64 experts of intermediate 512, 6 layers: 1.13 GiB of bf16 experts
CONFIG = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
              num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=64,
              num_experts_per_tok=4, tie_word_embeddings=False, max_position_embeddings=128)


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def anon_bytes() -> int:
    """RssAnon: the resident memory of this process's own allocations (no file pages)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def reset_peak() -> None:
    """Restart the kernel's peak resident size (VmHWM) from the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_since_reset() -> int:
    """VmHWM: the peak resident size since exec or the last reset_peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def make(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG), dtype=torch.bfloat16)
    model.save_pretrained(path)  # transformers' default shard size: one big shard


def load(kind: str, path: str, out: str) -> None:
    import kt_ops

    start = time.perf_counter()
    baseline = resident_bytes()
    patching = {}
    if kind == "kt":
        model = kt_ops.hf.from_pretrained(path, expert_format="int4", progress=False)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        # patch_model's own peak: it quantizes one experts module at a time and drops that
        # module's bf16 copy before the next.
        patching["before_patch"] = resident_bytes()
        patching["load_peak"] = peak_since_reset()
        reset_peak()
        kt_ops.patch_model(model, expert_format="int4")
        patching["patch_peak"], patching["after_patch"] = peak_since_reset(), resident_bytes()
    seconds = time.perf_counter() - start
    peak, final = max(peak_since_reset(), patching.get("load_peak", 0)), resident_bytes()
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    torch.save(logits, out.replace(".json", ".pt"))
    c = CONFIG
    layer_bf16 = c["num_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2
    experts = sum(kt.expert_nbytes() for _, kt in kt_ops.hf.patched_experts(model))
    with open(out, "w") as f:
        json.dump({"peak": peak, "final": final, "baseline": baseline, "layer_bf16_experts": layer_bf16,
                   "expert_bytes": experts, "bf16_expert_bytes": layer_bf16 * c["num_hidden_layers"],
                   "seconds": seconds, **patching}, f)


def load_shard(path: str, out: str, shards: int, rank: int) -> None:
    """Rank ``rank`` of a job of ``shards`` ranks with ``expert_shards=shards`` (``RANK`` /
    ``WORLD_SIZE`` only: from_pretrained needs no process group, so one process stands for one
    rank): how much this owner's own resident memory grows while loading its shard (its peak),
    and VmHWM's growth, which also counts the mapped checkpoint pages."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(shards))
    import transformers  # noqa: F401  (imported before the baseline: the libraries are not the load)
    from transformers import Qwen3MoeForCausalLM  # noqa: F401

    import kt_ops

    import threading

    # The process's own memory (RssAnon: not the checkpoint's pages mapped while reading, which
    # VmHWM counts too, up to the loader's REMAP_BYTES), sampled every 2 ms for its peak.
    anon = {"peak": anon_bytes()}
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            anon["peak"] = max(anon["peak"], anon_bytes())

    baseline, anon_baseline = resident_bytes(), anon["peak"]
    reset_peak()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = kt_ops.hf.from_pretrained(path, expert_shards=shards, progress=False, dtype=torch.bfloat16)
    done.set()
    sampler.join()
    anon["peak"] = max(anon["peak"], anon_bytes())
    experts = sum(kt.expert_nbytes() for _, kt in kt_ops.hf.patched_experts(model))
    with open(out, "w") as f:
        json.dump({"growth": anon["peak"] - anon_baseline, "rss_growth": peak_since_reset() - baseline,
                   "expert_bytes": experts, "expert_tensors_read": model.kt_load_stats["expert_tensors_read"]}, f)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "shard":
        load_shard(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        load(sys.argv[1], sys.argv[2], sys.argv[3])
