"""Helpers shared by the benchmarks (``bench_moe.py``, the ``suite`` package,
``thread_scaling.py``, ``buffer_reuse.py``, ``gemv_rows.py``, ``quant_gemv.py``).

The problem generator, FLOP count, error metric, step container, machine description (CPU model
and flags, the code path kt_ops takes) and table rendering live here so that the scripts
measure and report the same way.
"""
import contextlib
import os
import time
import platform
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import kt_ops
from kt_ops.cpu_isa import best_cpu_isa  # (the attribute kt_ops.cpu_isa is the function)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32,
          "fp64": torch.float64, "float64": torch.float64}
BASE = ("gate_proj", "up_proj", "down_proj")
LORA = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
# The /proc/cpuinfo flags that decide kt_ops' kernels and the bf16 GEMMs of oneDNN / MKL.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
# The environment variables that override those choices.
PATH_ENV = ("KT_OPS_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo(key: str) -> Optional[str]:
    """The value of the first ``key : value`` line of /proc/cpuinfo (None where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags(names: Sequence[str] = CPU_FLAGS) -> Optional[Dict[str, bool]]:
    """``{flag: listed}`` for each of ``names`` in /proc/cpuinfo's flags (None where unreadable)."""
    listed = _cpuinfo("flags")
    if listed is None:
        return None
    listed = set(listed.split())
    return {n: n in listed for n in names}


def code_path() -> dict:
    """The CPU code path kt_ops takes in this process: ``cpu_isa`` (its kernels' instruction set
    now) and ``best_cpu_isa``, ``base_gemm_path`` of bf16 base GEMMs (``onednn_bf16`` or
    ``bf16_to_fp32_panels``), ``quantized_gemm_path`` of bf16 activations on quantized experts
    (``bf16_panels_onednn`` or ``fp32_panels_mkl``), ``weight_packing`` (bool), ``env`` (each of PATH_ENV: its value or ``unset``) and ``cpu_flags`` (cpu_flags())."""
    return dict(cpu_isa=kt_ops.cpu_isa(), best_cpu_isa=best_cpu_isa(),
                base_gemm_path=torch.ops.kt._base_gemm_path(torch.bfloat16),
                quantized_gemm_path=torch.ops.kt._quant_gemm_path(torch.bfloat16),
                weight_packing=kt_ops.weight_packing_enabled(),
                env={v: os.environ.get(v, "unset") for v in PATH_ENV}, cpu_flags=cpu_flags())


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def make_problem(args) -> Dict[str, torch.Tensor]:
    """Stacked weights, hidden states, routing and upstream gradient, from a fixed seed.

    Weights are scaled so that activations stay O(1); lora_b is non-zero (PEFT initialises it
    to zero, which would make the LoRA path invisible to the correctness check) and sized so
    that the LoRA delta is a modest fraction of the base output.
    """
    T, H, I, E, K, r = args.tokens, args.hidden, args.intermediate, args.experts, args.topk, args.rank
    dt = args.torch_dtype
    g = torch.Generator().manual_seed(args.seed)

    def randn(*shape, std):
        return torch.randn(*shape, generator=g, dtype=dt).mul_(std)

    t = {
        "gate_proj": randn(E, I, H, std=H ** -0.5),
        "up_proj": randn(E, I, H, std=H ** -0.5),
        "down_proj": randn(E, H, I, std=I ** -0.5),
        "gate_lora_a": randn(E, r, H, std=H ** -0.5),
        "gate_lora_b": randn(E, I, r, std=0.1 * r ** -0.5),
        "up_lora_a": randn(E, r, H, std=H ** -0.5),
        "up_lora_b": randn(E, I, r, std=0.1 * r ** -0.5),
        "down_lora_a": randn(E, r, I, std=I ** -0.5),
        "down_lora_b": randn(E, H, r, std=0.1 * r ** -0.5),
        "hidden": randn(T, H, std=1.0),
        "dy": randn(T, H, std=1.0),
    }
    # Router as in Qwen3-MoE: softmax over random logits in fp32, top-k, renormalise
    # (norm_topk_prob=True), cast to the model dtype. Expert ids int64 as HF produces them.
    logits = torch.randn(T, E, generator=g, dtype=torch.float32)
    probs = F.softmax(logits, dim=-1)
    topw, ids = torch.topk(probs, K, dim=-1)
    topw = topw / topw.sum(dim=-1, keepdim=True)
    t["topk_ids"] = ids
    t["topk_weights"] = topw.to(dt)
    return t


def flops(mode: str, T: int, K: int, H: int, I: int, r: int) -> float:
    """FLOPs of one step; the formula is documented in this module's docstring."""
    P = T * K
    f_base = 6.0 * P * H * I
    f_lora = 6.0 * P * r * (H + I)
    if mode == "fwd":
        return f_base
    if mode == "fwd_lora":
        return f_base + f_lora
    if mode == "lora":
        return (f_base + f_lora) + (f_base + 2.0 * f_lora)
    if mode == "full":
        return f_base + 2.0 * f_base
    raise ValueError(mode)


def mark_updated_in_place(tensors) -> None:
    """Bump the version counters of ``tensors`` as an optimizer's in-place step would. Full-mode
    benchmarks call it every step: kt.moe then sees changed base weights and never uses
    pre-packed copies, as in real full fine-tuning."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


LAYER_ARGUMENTS = ("tokens", "hidden", "intermediate", "experts", "topk", "rank")


def add_layer_arguments(p) -> None:
    """--tokens ... --rank of one MoE layer, defaulting to Qwen3-30B-A3B at T=1024, r=8."""
    for name, default in zip(LAYER_ARGUMENTS, (1024, 2048, 768, 128, 8, 8)):
        p.add_argument(f"--{name}", type=int, default=default)


def add_expert_stack_arguments(p, experts: int) -> None:
    """--hidden --intermediate --experts of a stack of expert weights [E, I, H] (Qwen3-30B-A3B's
    gate projection by default), for the one-thread kernel benchmarks."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=experts)


def expert_stack(args, gen: torch.Generator) -> torch.Tensor:
    """Random bf16 weights [experts, intermediate, hidden] from ``gen``."""
    return torch.randn(args.experts, args.intermediate, args.hidden, generator=gen).to(torch.bfloat16)


def time_pass(fn: Callable[[int], object], experts: Sequence[int]) -> float:
    """Seconds per call of ``fn(e)`` over the expert indices ``experts``."""
    t0 = time.perf_counter()
    for e in experts:
        fn(e)
    return (time.perf_counter() - t0) / len(experts)


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block (kernel timings), the thread count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def layer_problem(args) -> Dict[str, torch.Tensor]:
    """make_problem in bf16, seed 0, for the layer arguments of add_layer_arguments."""
    return make_problem(SimpleNamespace(torch_dtype=torch.bfloat16, seed=0,
                                        **{k: getattr(args, k) for k in LAYER_ARGUMENTS}))


def kt_step(prob, mode):
    """One kt.moe step: forward only (fwd), or forward+backward with LoRA (lora) or with the base
    weights trainable (full; their version counters bumped as an optimizer step would)."""
    base = {n: prob[n].detach().requires_grad_(mode == "full") for n in BASE}
    lora = {n: prob[n].detach().requires_grad_(True) for n in LORA} if mode == "lora" else {}
    x = prob["hidden"].detach().requires_grad_(mode != "fwd")

    def step():
        y = kt_ops.moe(x, prob["topk_ids"], prob["topk_weights"], **base, **lora, lora_scale=2.0)
        if mode != "fwd":
            y.backward(prob["dy"])
        for t in [x, *base.values(), *lora.values()]:
            t.grad = None
        if mode == "full":
            mark_updated_in_place(base.values())
    return step


def make_step(forward: Callable[[], torch.Tensor], train: bool, dy: Optional[torch.Tensor]) -> Callable:
    """One timed step: forward + ``backward(dy)`` when training, else forward under no_grad."""
    if train:
        def step():
            y = forward()
            y.backward(dy)
            return y
    else:
        def step():
            with torch.no_grad():
                return forward()
    return step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    acc = torch.promote_types(a.dtype, torch.float32)  # fp32, or fp64 for fp64 runs
    a, b = a.detach().to(acc), b.detach().to(acc)
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return num / den if den > 0 else num


class Unavailable(Exception):
    """An implementation that cannot run here (the message says why)."""


class Impl:
    """A callable step plus what is needed to read its output and gradients."""

    def __init__(self, name: str, step: Callable[[], torch.Tensor],
                 reset: Callable[[], None], grads: Callable[[], Dict[str, torch.Tensor]]):
        self.name, self.step, self.reset, self.grads = name, step, reset, grads
        self.times: List[float] = []
        self.cpu: List[float] = []  # process CPU seconds per timed step (all threads)


# --------------------------------------------------------------------------------------------
# tables: ``columns`` is a list of (row key, header); ``right`` the keys to right-align;
# ``fmt(key, value) -> str`` renders one cell.


def text_table(rows: Sequence[dict], columns: Sequence[Tuple[str, str]], right,
               fmt: Callable[[str, object], str]) -> str:
    cells = [[fmt(k, r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(columns)]

    def line(vals):
        return "  ".join(v.rjust(w) if k in right else v.ljust(w)
                         for (k, _), v, w in zip(columns, vals, widths))

    out = [line([h for _, h in columns]), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def markdown_table(rows: Sequence[dict], columns: Sequence[Tuple[str, str]], right,
                   fmt: Callable[[str, object], str]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---:" if k in right else "---" for k, _ in columns) + "|"
    body = ["| " + " | ".join(fmt(k, r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])
