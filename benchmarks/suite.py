"""Benchmark suite: ``kt.moe`` against eager PyTorch, ``torch._grouped_mm``, the ``torch.mm``
ceiling, the memory bandwidth and (when installed) KTransformers' own kernels, on several MoE
shapes, in one run.

Run from the repository root::

    .venv/bin/python -m benchmarks.suite                     # every case below (tens of minutes)
    .venv/bin/python -m benchmarks.suite --quick             # smoke test: tiny shapes, seconds
    .venv/bin/python -m benchmarks.suite --cases tiny,mid --repeats 3 --json out/suite.json
    .venv/bin/python -m benchmarks.suite --cases 'qwen3*' --modes fwd,lora
    .venv/bin/python -m benchmarks.suite --list              # the cases

Cases (``--cases``: comma-separated names or shell patterns; ``decode`` = ``*decode*``, ``all``):

    tiny                         H=256   I=128   E=8    K=2  T=512
    mid                          H=1024  I=512   E=32   K=4  T=2048
    qwen3-30b-a3b-t1024          H=2048  I=768   E=128  K=8  T=1024
    qwen3-30b-a3b-t4096          H=2048  I=768   E=128  K=8  T=4096   (hf-loop skipped, see below)
    deepseek-v2-lite-t2048       H=2048  I=1408  E=64   K=6  T=2048
    qwen3-30b-a3b-decode-t1/4/16 H=2048  I=768   E=128  K=8  T=1, 4, 16
    (``--quick`` runs tiny and tiny-t1 = the tiny shape at T=1; both can also be named.)

Modes (``--modes``, default all three), bf16 weights and activations throughout:

* ``fwd``   forward only, no LoRA, under ``torch.no_grad()`` (inference);
* ``lora``  forward + backward, LoRA rank 8 (alpha 16, scale 2): base frozen, the six LoRA
            tensors and the hidden states require grad;
* ``full``  forward + backward, no LoRA: the three base weights and the hidden states require
            grad.

Routing weights never require grad. Backward is ``y.backward(dy)`` with a fixed random ``dy``;
gradients are set to ``None`` before every step (``zero_grad(set_to_none=True)``). The problem
(weights, hidden states, softmax-top-k routing of random logits) comes from
``benchmarks.common.make_problem`` with ``--seed``, exactly as in ``bench_moe.py``.

Implementations (``--impls`` to pick):

* ``kt.moe``     this library's op (``kt_ops.moe``);
* ``sorted-mm``  well-written eager PyTorch (``benchmarks.baselines.SortedMoE``): sort the pairs
                 by expert, ``index_select`` the hidden states once, ``split``, one fused
                 gate|up ``mm`` per expert on a fused ``[E, 2I, H]`` copy, SwiGLU, down ``mm``,
                 one ``index_add_``; eager autograd for backward. It is the correctness
                 reference of every other implementation;
* ``grouped-mm`` the same with ``torch._grouped_mm`` (``GroupedMMMoE``; a private op, bf16
                 on CPU): ``n/a`` with the reason if it raises;
* ``hf-loop``    the Hugging Face / PEFT-style per-expert loop of ``bench_moe.py``
                 (``HFLoopMoE``). Skipped on cases marked so (qwen3-30b-a3b-t4096: minutes per
                 mode and a second copy of the weights); ``--loop always`` runs it anyway,
                 ``--loop never`` skips it everywhere;
* ``kt-kernel``  KTransformers' CPU SFT kernels, ``kt-kernel==0.7.2`` (never a dependency: used
                 when ``import kt_kernel`` works, else reported as ``not installed``). Install
                 beside the project with ``pip install --no-deps kt-kernel==0.7.2`` plus numpy,
                 safetensors, pyyaml, packaging and gguf. Driven through
                 ``KTMoEWrapper(..., gpu_experts_mask=None, method="AMXBF16_SFT", mode="sft",
                 lora_rank=..., full_weight_grad=...)`` with ``load_weights_from_tensors``,
                 ``init_lora_weights`` / ``init_full_weight_grad_buffers``, ``forward``,
                 ``backward``; LoRA mode uses rank 8, full and fwd modes ``lora_rank=0,
                 full_weight_grad=True``. Its tensor layouts, LoRA scale (alpha / r) and
                 routing-weight semantics are this project's, so nothing is converted; the
                 header shows which CPU build it loaded (``cpu variant amx`` on AMX machines).
                 Its thread pool is a per-process singleton sized by ``--threads``. Any
                 failure is reported as ``n/a`` with the reason.

Measured in the same run, and how the derived numbers are defined:

* FLOPs: as in ``bench_moe.py`` (multiply-add = 2 FLOPs; P = T·K pairs): F_base = 6·P·H·I,
  F_lora = 6·P·r·(H + I); fwd = F_base, lora = 2·F_base + 3·F_lora, full = 3·F_base.
  GFLOP/s = FLOPs / median time; tokens/s = T / median time.
* ``mm-ceiling`` (a pseudo-implementation timed in the same alternation as the others): the
  base-weight GEMMs of the mode and nothing else, as plain ``torch.mm`` calls in nn.Linear
  layout, at the *real* per-expert row counts of the case's routing, each expert with its own
  weights (so weights stream from memory as they do in the MoE; a single reused weight would sit
  in the L3 cache and overstate small-M rates). Per expert with n rows: fwd: ``[n,H]x[H,2I]``
  and ``[n,I]x[I,H]``; lora adds the input-gradient GEMMs ``[n,H]x[H,I]`` and
  ``[n,2I]x[2I,H]``; full adds also the weight-gradient GEMMs ``[H,n]x[n,I]`` and
  ``[2I,n]x[n,H]``. Its rate (6, 12, 18·P·H·I FLOPs / time) is the ceiling; ``% ceil`` =
  an implementation's GFLOP/s / that rate (the LoRA FLOPs, about 4% at the Qwen3 shape, are
  counted for the implementation but not in the ceiling's GEMMs). No gather, scatter, SwiGLU
  or routing is in the ceiling, so 100% is not reachable, but 60-80% is (DESIGN.md §4).
  For context each case header also gives the literal single-GEMM rate: one ``[M,H]x[H,2I]``
  mm repeated on one (cache-warm) weight, M = average rows per expert hit = round(P / experts
  hit), best of three batches.
* Memory bandwidth: a 256 MiB ``copy_`` (far larger than the L3), GB/s = 2·bytes / time (read
  + write), the best of 5 copies (load only ever slows a copy), measured at the start and end
  of the run and again before each case. ``x stream`` (fwd rows) = the forward time / the time
  to read the routed experts' base weights once at the case's rate (experts hit · 3·H·I · 2
  bytes / GB/s): about 1 means bandwidth-bound; it is the figure of merit for the decode cases
  (T = 1, 4, 16), where the weights dominate. Values somewhat below 1 are possible (a pure read
  stream can beat a copy's combined read+write rate). For large T it shows how compute-bound
  the case is.
* Speedups in the summary (``vs X``) = X's median time / kt.moe's median time (> 1: kt.moe is
  faster).
* Errors: ``out err`` = ‖y − y_ref‖ / ‖y_ref‖ (Frobenius, in fp32) against ``sorted-mm``'s
  bf16 output from one untimed call per case and mode; ``grad err`` = the largest such error
  over the gradients of the tensors that require grad. Both sides are bf16, so this is their
  disagreement (a few 1e-3 expected), not an error against exact math.
* Peak memory (``--memory``): ``/proc/self/status`` VmHWM (peak resident set), reset to the
  current RSS by writing ``5`` to ``/proc/self/clear_refs`` right before the measured step, in
  a fresh subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every
  allocation of 64 KiB or more separately and returns it on free, so RSS follows live memory
  instead of keeping freed blocks in malloc's arenas). ``tracemalloc`` does not see torch's CPU
  allocations. For each (mode, impl): build the impl, one untimed step, reset its gradients,
  then ``state MiB`` = RSS growth from building it (its own weight copies, packed weights,
  persistent buffers) and ``step MiB`` = VmHWM during one step − RSS before it (activations,
  saved tensors, gradients, workspaces of one forward(+backward)). ``--memory case`` (default)
  runs one subprocess per case with the impls one after another (each freed before the next);
  ``--memory impl`` one subprocess per (case, mode, impl), slower and cleanest; ``off`` skips.
  The timing process itself runs with the default allocator settings.

Timing: per case and mode, one untimed correctness call per implementation, ``--warmup``
untimed steps, then ``--repeats`` timed steps (median); the implementations (and the
mm-ceiling) alternate step by step so that all see the same machine load. Decode cases run 4x
``--repeats`` steps (their steps take milliseconds). ``CPU/wall`` is process CPU time / wall
time of the timed steps (near the thread count when nothing else competes). Never run two
benchmarks at once on a small machine: two processes that each use 2 threads slow small ops
10-15x.

``--json PATH`` also writes everything (machine, cases, every row with its step times, the
summary, the notes) as JSON; it is rewritten after each case, so an interrupted run keeps
what finished.
"""
import argparse
import fnmatch
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `kt_ops` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kt_ops  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.baselines import GroupedMMMoE, HFLoopMoE, SortedMoE  # noqa: E402
from benchmarks.common import (  # noqa: E402
    BASE, LORA, Impl, cpu_model, flops, load_average, make_problem, make_step, mark_updated_in_place,
    rel_err)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("fwd", "lora", "full")
IMPLS = ("kt.moe", "sorted-mm", "grouped-mm", "hf-loop", "kt-kernel")
REFERENCE = "sorted-mm"
CEILING = "mm-ceiling"
DTYPE = torch.bfloat16
PROBE_TAG = "KT_SUITE_PROBE "
KT_KERNEL_VERSION = "0.7.2"


@dataclass(frozen=True)
class Case:
    name: str
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    T: int
    decode: bool = False
    skip_loop: str = ""  # why hf-loop is skipped by default ("" = runs)
    quick_only: bool = False

    def shape(self) -> str:
        return f"T={self.T} H={self.H} I={self.I} E={self.E} K={self.K}"


_QWEN = dict(H=2048, I=768, E=128, K=8)
CASES = [
    Case("tiny", H=256, I=128, E=8, K=2, T=512),
    Case("mid", H=1024, I=512, E=32, K=4, T=2048),
    Case("qwen3-30b-a3b-t1024", T=1024, **_QWEN),
    Case("qwen3-30b-a3b-t4096", T=4096, **_QWEN,
         skip_loop="the per-expert loop takes minutes per mode at T=4096 and holds a second "
                   "copy of the weights; --loop always runs it"),
    Case("deepseek-v2-lite-t2048", H=2048, I=1408, E=64, K=6, T=2048),
    Case("qwen3-30b-a3b-decode-t1", T=1, decode=True, **_QWEN),
    Case("qwen3-30b-a3b-decode-t4", T=4, decode=True, **_QWEN),
    Case("qwen3-30b-a3b-decode-t16", T=16, decode=True, **_QWEN),
    Case("tiny-t1", H=256, I=128, E=8, K=2, T=1, decode=True, quick_only=True),
]
CASE_BY_NAME = {c.name: c for c in CASES}
ALIASES = {"all": "*", "decode": "*decode*"}
QUICK_CASES = "tiny,tiny-t1"


class Unavailable(Exception):
    """An implementation that cannot run here (the message says why)."""


# --------------------------------------------------------------------------------------------
# arguments


def select_cases(spec: str) -> List[Case]:
    out: List[Case] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        pat = ALIASES.get(part, part)
        if pat in CASE_BY_NAME:
            hits = [CASE_BY_NAME[pat]]
        else:
            hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pat)
                    and (not c.quick_only or pat != "*")]
        if not hits:
            raise ValueError(f"no case matches {part!r}; cases: {', '.join(CASE_BY_NAME)}")
        out += [c for c in hits if c not in out]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None,
                   help="comma-separated case names or patterns (default: all but the "
                        "quick-only ones; --quick: tiny,tiny-t1); see --list")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default all)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)} (default all; kt.moe and "
                        f"{REFERENCE}, the correctness reference, always run)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps per impl (default 5; --quick 3); decode cases run 4x")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per impl after the correctness call (default 2: with it, "
                        "the three calls after which kt.moe packs weights that stay unchanged)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads, also kt-kernel's thread count (default: "
                        "torch's default)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: cases tiny,tiny-t1 and 3 repeats (explicit flags win)")
    p.add_argument("--memory", choices=("case", "impl", "off"), default="case",
                   help="peak-memory measurement: one subprocess per case (default), per "
                        "(case, mode, impl), or off")
    p.add_argument("--loop", choices=("auto", "always", "never"), default="auto",
                   help="hf-loop baseline: skip it on the cases marked so (auto, default), "
                        "run it everywhere, or nowhere")
    p.add_argument("--copy-mib", type=int, default=256,
                   help="size of the copy_ that measures memory bandwidth (default 256 MiB)")
    p.add_argument("--rank", "-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="LoRA alpha; scale = alpha / rank (default 16)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write all results as JSON to PATH")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cases is None:
        args.cases = QUICK_CASES if args.quick else "all"
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    try:
        args.case_list = select_cases(args.cases)
    except ValueError as e:
        p.error(str(e))
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES}")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        p.error(f"unknown impl(s) {bad}; choose from {IMPLS}")
    args.impls = [i for i in IMPLS if i in impls or i in ("kt.moe", REFERENCE)]
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.rank < 1:
        p.error("--rank must be >= 1")
    args.lora_scale = args.lora_alpha / args.rank
    return args


def problem_config(case: Case, args) -> SimpleNamespace:
    """The namespace ``common.make_problem`` and the builders read."""
    return SimpleNamespace(tokens=case.T, hidden=case.H, intermediate=case.I, experts=case.E,
                           topk=case.K, rank=args.rank, torch_dtype=DTYPE, seed=args.seed,
                           lora_alpha=args.lora_alpha, lora_scale=args.lora_scale)


# --------------------------------------------------------------------------------------------
# kt-kernel (optional)


def kt_kernel_status() -> str:
    """'ok <version> (cpu variant <v>)', 'not installed' or 'import failed: ...'. The variant
    is the extension kt-kernel loaded for this CPU (``amx`` on AMX machines, else an AVX512 or
    AVX2 build; ``KT_KERNEL_CPU_VARIANT`` overrides it)."""
    try:
        import kt_kernel  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "kt_kernel":
            return "not installed"
        return f"import failed: {e}"
    except Exception as e:  # a broken install must not stop the suite
        return f"import failed: {type(e).__name__}: {e}"
    variant = getattr(kt_kernel, "__cpu_variant__", None)
    return (f"ok {getattr(kt_kernel, '__version__', '(version unknown)')}"
            + (f" (cpu variant {variant})" if variant else ""))


def _kt_kernel_wrapper_class():
    import kt_kernel
    cls = getattr(kt_kernel, "KTMoEWrapper", None)
    if cls is None:
        from kt_kernel.experts import KTMoEWrapper as cls  # noqa: N813
    return cls


# --------------------------------------------------------------------------------------------
# implementations: each is an Impl (step, reset, grads) plus .close()


def _module_fns(model, x, ids, w, stacked_grads):
    """forward / reset / grads / close of a baseline module called as ``model(x, ids, w)``;
    ``close`` drops the module so that its weights are freed."""
    held = {"model": model}

    def forward():
        return held["model"](x, ids, w)

    def reset():
        x.grad = None
        held["model"].zero_grad(set_to_none=True)

    def grads():
        return {"hidden": x.grad, **stacked_grads(held["model"])}

    def close():
        held["model"] = None

    return forward, reset, grads, close


def build_impl(name: str, mode: str, prob: Dict[str, torch.Tensor], cfg) -> Impl:
    train = mode != "fwd"
    use_lora = mode == "lora"
    trained = LORA if use_lora else BASE if mode == "full" else ()
    ids, w, dy = prob["topk_ids"], prob["topk_weights"], prob["dy"]
    close = None

    if name == "kt.moe":
        x = prob["hidden"].detach().requires_grad_(train)
        wt = {n: prob[n].detach().requires_grad_(n in trained)
              for n in BASE + (LORA if use_lora else ())}
        lora = [wt[n] for n in LORA] if use_lora else [None] * 6

        def forward():
            return kt_ops.moe(x, ids, w, wt["gate_proj"], wt["up_proj"], wt["down_proj"],
                              *lora, cfg.lora_scale)

        def reset():
            x.grad = None
            for t in wt.values():
                t.grad = None
            if mode == "full":
                mark_updated_in_place(wt[n] for n in BASE)

        def grads():
            return {"hidden": x.grad, **{n: wt[n].grad for n in trained}}

        close = kt_ops.release_packed_weights  # the packed copies must not outlive the impl

    elif name in ("sorted-mm", "grouped-mm"):
        cls = SortedMoE if name == "sorted-mm" else GroupedMMMoE
        model = cls(*(prob[n] for n in BASE), *((prob[n] for n in LORA) if use_lora else ()),
                    lora_scale=cfg.lora_scale, w13=prob["w13"])
        model.set_trainable(trained)
        x = prob["hidden"].detach().requires_grad_(train)
        forward, reset, grads, close = _module_fns(model, x, ids, w, lambda m: m.stacked_grads(trained))

    elif name == "hf-loop":
        model = HFLoopMoE(*(prob[n] for n in BASE),
                          *((prob[n] for n in LORA) if use_lora else [None] * 6),
                          lora_scale=cfg.lora_scale)
        for pname, p in model.named_parameters():
            leaf = pname.rsplit(".", 1)[0]  # e.g. experts.3.gate_proj.lora_A
            is_lora = leaf.endswith("lora_A") or leaf.endswith("lora_B")
            p.requires_grad_(train and (is_lora if use_lora else not is_lora))
        x = prob["hidden"].detach().clone().requires_grad_(train)
        forward, reset, grads, close = _module_fns(model, x, ids, w, lambda m: m.stacked_grads(trained, prob))

    elif name == "kt-kernel":
        return _build_kt_kernel(mode, prob, cfg)

    else:
        raise ValueError(name)

    impl = Impl(name, make_step(forward, train, dy), reset, grads)
    impl.close = close or (lambda: None)
    return impl


def _build_kt_kernel(mode: str, prob, cfg) -> Impl:
    """KTransformers' SFT MoE through the kt-kernel 0.7.2 API (DESIGN.md §4).

    ``KTMoEWrapper(..., mode="sft", method="AMXBF16_SFT")`` returns a
    ``kt_kernel.sft.amx.AMXSFTMoEWrapper``. Its conventions were checked against this project's
    (and against fp32 autograd) at kt-kernel 0.7.2 and match, so no tensor is transformed:

    * base weights ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]`` (nn.Linear layout),
      bf16, given by ``load_weights_from_tensors(gate, up, down, physical_to_logical_map)``;
      the C++ side copies/packs them at load time (a later change of the tensors is not seen
      until ``update_base_weights()`` reloads them);
    * LoRA ``a`` ``[E, r, in]``, ``b`` ``[E, out, r]``, delta = (alpha / r)·B·A, bf16 and
      contiguous, given with six same-shaped bf16 gradient buffers to ``init_lora_weights``
      (the kernel keeps raw pointers and overwrites the gradient buffers in every backward;
      experts without tokens get zeros);
    * ``forward(x [T, H] bf16, ids [T, K] int64, weights [T, K] fp32, save_for_backward)``:
      y = sum_k weights[t, k] · expert(x[t]) with SwiGLU, the same routing semantics as here;
      ``backward(dy) -> (grad_input [T, H] bf16, grad_routing_weights [T, K] fp32)``;
    * full mode: ``lora_rank=0, full_weight_grad=True`` and ``init_full_weight_grad_buffers``
      makes nn.Parameters over the given base tensors plus ``grad_{gate,up,down}_proj_buf``
      in the weights' layout. For AMXBF16_SFT these are "authoritative" optimizer gradients:
      a backward *accumulates* into them while the optimizer window is open (after the first
      backward), so ``reset`` closes it with ``release_authoritative_optimizer_grads()``;
      the next backward then overwrites. fwd mode uses the same constructor (``lora_rank=0``
      requires ``full_weight_grad=True``) without the gradient buffers.

    The CPU thread pool (``cpuinfer_threads``) is a process-wide singleton: the first wrapper
    of the process fixes its thread count (here torch's thread count, i.e. ``--threads``).
    Any setup failure becomes Unavailable with the reason."""
    status = kt_kernel_status()
    if not status.startswith("ok"):
        raise Unavailable(status)
    T, H, I, E, K, r = (cfg.tokens, cfg.hidden, cfg.intermediate, cfg.experts, cfg.topk,
                        cfg.rank)
    train = mode != "fwd"
    use_lora = mode == "lora"
    if use_lora and abs(cfg.lora_alpha / r - cfg.lora_scale) > 1e-12 * abs(cfg.lora_scale):
        raise Unavailable(f"kt-kernel scales LoRA by lora_alpha / r = {cfg.lora_alpha / r:g}, "
                          f"not by the suite's lora_scale {cfg.lora_scale:g}")
    try:
        wrapper_cls = _kt_kernel_wrapper_class()
        wrapper = wrapper_cls(
            layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H,
            moe_intermediate_size=I, gpu_experts_mask=None,
            cpuinfer_threads=torch.get_num_threads(), threadpool_count=1, weight_path="",
            chunked_prefill_size=max(T, 1), method="AMXBF16_SFT", mode="sft",
            num_gpu_experts=0, lora_rank=r if use_lora else 0, lora_alpha=cfg.lora_alpha,
            full_weight_grad=not use_lora)
        gate, up, down = (prob[n].to(DTYPE).contiguous() for n in BASE)
        wrapper.load_weights_from_tensors(gate, up, down, torch.arange(E, dtype=torch.int64))
        lora_grads = {}
        if use_lora:
            lora_grads = {n: torch.zeros_like(prob[n], dtype=DTYPE,
                                              memory_format=torch.contiguous_format)
                          for n in LORA}
            wrapper.init_lora_weights(*(prob[n].to(DTYPE).contiguous() for n in LORA),
                                      *(lora_grads[n] for n in LORA))
        elif mode == "full":
            wrapper.init_full_weight_grad_buffers(gate, up, down)
    except Exception as e:
        raise Unavailable(f"kt-kernel setup failed: {type(e).__name__}: {e}") from e

    x = prob["hidden"].to(DTYPE).contiguous()
    ids = prob["topk_ids"].to(torch.int64).contiguous()
    w = prob["topk_weights"].to(torch.float32).contiguous()
    dy = prob["dy"].to(DTYPE).contiguous()
    state = {}

    def step():
        if not train:
            return wrapper.forward(x, ids, w, save_for_backward=False)
        y = wrapper.forward(x, ids, w, save_for_backward=True)
        state["grad_input"], _ = wrapper.backward(dy)  # (grad_input, grad of routing weights)
        return y

    def reset():
        state.pop("grad_input", None)
        if wrapper is not None:
            # full mode: close the authoritative-gradient window, else the next backward
            # accumulates into grad_*_proj_buf (a no-op for fwd/lora, whose LoRA gradient
            # buffers are plain tensors that every backward overwrites)
            wrapper.release_authoritative_optimizer_grads()

    def grads():
        out = {"hidden": state.get("grad_input")}
        if use_lora:
            out.update(lora_grads)
        elif mode == "full":
            out.update(gate_proj=wrapper.grad_gate_proj_buf, up_proj=wrapper.grad_up_proj_buf,
                       down_proj=wrapper.grad_down_proj_buf)
        return out

    def close():
        nonlocal wrapper
        wrapper = None
        lora_grads.clear()
        state.clear()
        wrapper_cls.clear_sft_buffer_cache()  # the shared grow-only I/O buffers

    impl = Impl("kt-kernel", step, reset, grads)
    impl.close = close
    return impl


def build_ceiling(mode: str, prob, counts: List[int], cfg) -> Impl:
    """The mode's base-weight GEMMs at the real per-expert row counts (see the docstring)."""
    H, I = cfg.hidden, cfg.intermediate
    P = sum(counts)
    g = torch.Generator().manual_seed(cfg.seed + 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    xs, hs = rnd(P, H), rnd(P, I)
    dys = rnd(P, H) if mode != "fwd" else None
    dgus = rnd(P, 2 * I) if mode != "fwd" else None
    w13, w2 = prob["w13"].unbind(0), prob["down_proj"].unbind(0)
    work = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            sl = slice(start, start + n)
            work.append((w13[e], w2[e], xs[sl], hs[sl],
                         dys[sl] if dys is not None else None,
                         dgus[sl] if dgus is not None else None))
        start += n

    def step():
        for W13, W2, x, h, dy, dgu in work:
            torch.mm(x, W13.t())  # gate|up  [n,H]x[H,2I]
            torch.mm(h, W2.t())  # down     [n,I]x[I,H]
            if mode != "fwd":
                torch.mm(dy, W2)  # dh       [n,H]x[H,I]
                torch.mm(dgu, W13)  # dx     [n,2I]x[2I,H]
            if mode == "full":
                torch.mm(dy.t(), h)  # dW2   [H,n]x[n,I]
                torch.mm(dgu.t(), x)  # dW13 [2I,n]x[n,H]

    impl = Impl(CEILING, step, lambda: None, lambda: {})
    impl.close = lambda: work.clear()
    return impl


def ceiling_flops(mode: str, P: int, H: int, I: int) -> float:  # noqa: E741
    return {"fwd": 6.0, "lora": 12.0, "full": 18.0}[mode] * P * H * I


# --------------------------------------------------------------------------------------------
# machine-level measurements


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """GB/s (read + write) of a large ``copy_``: the best of ``repeats`` (load only slows it)."""
    n = mib * 2 ** 20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / min(times) / 1e9


def single_mm_gflops(w13: torch.Tensor, M: int, min_time: float = 0.05) -> float:
    """Cache-warm rate of one ``[M,H]x[H,2I]`` mm repeated on one weight ``[2I, H]`` (best of
    three batches)."""
    x = torch.randn(M, w13.shape[1], dtype=DTYPE)
    F.linear(x, w13)
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            F.linear(x, w13)
        dt = time.perf_counter() - t0
        if dt >= min_time or n >= 1 << 16:
            break
        n *= 4
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            F.linear(x, w13)
        times.append((time.perf_counter() - t0) / n)
    return 2.0 * M * w13.shape[1] * w13.shape[0] / min(times) / 1e9


def mem_available_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def estimate_peak_gib(case: Case, mode: str, impls: List[str]) -> float:
    """Rough upper estimate of the timing process's peak for one mode (for a warning only)."""
    W = 3 * case.E * case.H * case.I * 2  # base weights, bf16
    P = case.T * case.K
    act = P * (3 * case.H + 6 * case.I) * 2  # gathered x, gate/up, h, out, their grads
    total = W + 2 * W / 3 + case.T * case.H * 8  # problem + fused gate|up copy + x, dy
    grads = W if mode == "full" else 0
    for name in impls:
        total += grads + act
        if name == "hf-loop":
            total += W
        if name == "kt-kernel":
            total += 4 * W  # its packed weight copies: ~3.6 W measured (0.7.2, case mid)
    return total / 2 ** 30


# --------------------------------------------------------------------------------------------
# one case, one mode (timing process)


def routing_stats(prob, case: Case) -> dict:
    counts = torch.bincount(prob["topk_ids"].reshape(-1), minlength=case.E)
    hit = int((counts > 0).sum())
    P = case.T * case.K
    return dict(counts=counts.tolist(), experts_hit=hit, pairs=P,
                min=int(counts.min()), max=int(counts.max()), mean=P / case.E,
                avg_rows_per_hit=P / max(hit, 1))


def _drop(impl: Impl, impls: List[Impl], unavailable: Dict[str, str], e: Exception) -> None:
    """An optional implementation raised: report it as n/a and free it."""
    unavailable[impl.name] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    impls.remove(impl)
    try:
        impl.reset()
        impl.close()
    except Exception:
        pass
    gc.collect()


def run_mode(case: Case, mode: str, prob, cfg, args, info: dict, notes: List[str]) -> List[dict]:
    impls: List[Impl] = []
    unavailable: Dict[str, str] = {}
    for name in args.impls:
        if name == "hf-loop" and (args.loop == "never" or (args.loop == "auto" and case.skip_loop)):
            unavailable[name] = "skipped: " + (case.skip_loop or "--loop never")
            continue
        try:
            impls.append(build_impl(name, mode, prob, cfg))
        except Unavailable as e:
            unavailable[name] = "n/a: " + str(e)
        except Exception as e:  # a baseline that cannot even be built is n/a, not fatal
            unavailable[name] = f"n/a: {type(e).__name__}: {e}"

    # Correctness: one untimed call each, the reference first; the others are compared with it
    # right away (so only two sets of gradients are alive at a time). An implementation other
    # than kt.moe and the reference that raises becomes n/a.
    impls.sort(key=lambda i: i.name != REFERENCE)
    errs = {}
    ref_out = ref_grads = None
    for impl in list(impls):
        impl.reset()
        try:
            y = impl.step().detach()
            g = impl.grads() if mode != "fwd" else {}
            if impl.name == REFERENCE:
                ref_out, ref_grads = y, g
            else:
                grad_err = None
                if mode != "fwd":
                    grad_err = max(
                        float("inf") if g.get(n) is None or ref is None else rel_err(g[n], ref)
                        for n, ref in ref_grads.items())
                errs[impl.name] = (rel_err(y, ref_out), grad_err)
            del y, g
        except Exception as e:
            if impl.name in ("kt.moe", REFERENCE):
                raise
            _drop(impl, impls, unavailable, e)
            continue
        impl.reset()
    del ref_out, ref_grads
    gc.collect()

    ceiling = build_ceiling(mode, prob, info["counts"], cfg)
    timed = impls + [ceiling]
    repeats = args.repeats * (4 if case.decode else 1)
    for i in range(args.warmup + repeats):
        for impl in list(timed):
            impl.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                y = impl.step()
            except Exception as e:  # only optional baselines may fail here
                if impl.name in ("kt.moe", REFERENCE, CEILING):
                    raise
                _drop(impl, impls, unavailable, e)
                timed.remove(impl)
                continue
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            del y
            impl.reset()
            if i >= args.warmup:
                impl.times.append(dt)
                impl.cpu.append(dc)

    T, H, I, K, r = case.T, case.H, case.I, case.K, args.rank
    fl = flops(mode, T, K, H, I, r)
    ceil_s = statistics.median(ceiling.times)
    ceil_gflops = ceiling_flops(mode, T * K, H, I) / ceil_s / 1e9
    stream_ms = info["stream_ms"]
    rows = []
    for impl in timed:
        s = statistics.median(impl.times)
        is_ceiling = impl is ceiling
        gflops = (ceil_gflops if is_ceiling else fl / s / 1e9)
        out_err, grad_err = errs.get(impl.name, (None, None))
        rows.append(dict(
            case=case.name, mode=mode, impl=impl.name, status="ok", ms=s * 1e3,
            tok_s=T / s, gflops=gflops, pct_ceiling=100.0 * gflops / ceil_gflops,
            x_stream=(s * 1e3 / stream_ms) if mode == "fwd" else None,
            out_err=out_err, grad_err=grad_err, util=sum(impl.cpu) / sum(impl.times),
            step_mib=None, state_mib=None, times_ms=[t * 1e3 for t in impl.times]))
    for name, why in unavailable.items():
        rows.append(dict(case=case.name, mode=mode, impl=name, status=why))
        note = f"{case.name}/{mode}: {name} {why}"
        if why.startswith("skipped"):
            note = f"{case.name}: {name} {why}"
        if name == "kt-kernel" and why == "n/a: not installed":
            note = ("kt-kernel: not installed (optional; pip install --no-deps "
                    f"kt-kernel=={KT_KERNEL_VERSION} numpy safetensors pyyaml packaging gguf)")
        if note not in notes:
            notes.append(note)
    order = {n: i for i, n in enumerate(IMPLS + (CEILING,))}
    rows.sort(key=lambda r: order[r["impl"]])
    for impl in impls:
        impl.close()
    ceiling.close()
    del impls, timed, ceiling
    gc.collect()
    return rows


def run_case(case: Case, args, notes: List[str]) -> Tuple[dict, List[dict]]:
    cfg = problem_config(case, args)
    t0 = time.perf_counter()
    prob = make_problem(cfg)
    prob["w13"] = torch.cat([prob["gate_proj"], prob["up_proj"]], dim=1)
    info = routing_stats(prob, case)
    info["setup_s"] = time.perf_counter() - t0
    bandwidth = info["copy_gbps"] = copy_bandwidth(args.copy_mib)
    weight_bytes = 3 * case.E * case.H * case.I * 2
    routed_bytes = info["experts_hit"] * 3 * case.H * case.I * 2
    info.update(weights_gib=weight_bytes / 2 ** 30, routed_weight_mib=routed_bytes / 2 ** 20,
                stream_ms=routed_bytes / (bandwidth * 1e9) * 1e3)
    M = max(1, round(info["avg_rows_per_hit"]))
    first_hit = next(e for e, n in enumerate(info["counts"]) if n)
    info["single_mm"] = dict(M=M, gflops=single_mm_gflops(prob["w13"][first_hit], M))

    print(f"== {case.name}: {case.shape()} r={args.rank} bf16 | expert weights "
          f"{info['weights_gib']:.2f} GiB | setup {info['setup_s']:.1f}s", flush=True)
    print(f"   routing: pairs per expert min {info['min']} / mean {info['mean']:.1f} / max "
          f"{info['max']}; experts hit {info['experts_hit']}/{case.E}, "
          f"{info['avg_rows_per_hit']:.1f} rows per expert hit", flush=True)
    print(f"   routed weights {info['routed_weight_mib']:.1f} MiB: reading them once at "
          f"{bandwidth:.1f} GB/s takes {info['stream_ms']:.3f} ms | single cache-warm mm "
          f"[M={M},H]x[H,2I]: {fmt('gflops', info['single_mm']['gflops'])} GFLOP/s", flush=True)
    avail = mem_available_gib()
    for mode in args.modes:
        est = estimate_peak_gib(case, mode, args.impls)
        if avail is not None and est > 0.8 * avail:
            print(f"   WARNING: {mode} may need about {est:.1f} GiB; {avail:.1f} GiB available",
                  flush=True)

    rows = []
    for mode in args.modes:
        t1 = time.perf_counter()
        mode_rows = run_mode(case, mode, prob, cfg, args, info, notes)
        rows += mode_rows
        print("   " + progress_line(mode, mode_rows) + f" | {time.perf_counter() - t1:.1f}s",
              flush=True)
    del prob
    gc.collect()
    return info, rows


def progress_line(mode: str, rows: List[dict]) -> str:
    by = {r["impl"]: r for r in rows}
    kt = by["kt.moe"]
    parts = [f"[{mode}] kt.moe {kt['ms']:.2f} ms ({kt['pct_ceiling']:.0f}% of mm ceiling, "
             f"out err {kt['out_err']:.1e}"
             + (f", grad err {kt['grad_err']:.1e}" if kt["grad_err"] is not None else "") + ")"]
    for name in IMPLS[1:]:
        r = by.get(name)
        if r is None:
            continue
        if r["status"] != "ok":
            short = "not installed" if "not installed" in r["status"] else r["status"].split(":")[0]
            parts.append(f"{name} {short}")
        else:
            parts.append(f"{name} {r['ms']:.2f} ms ({r['ms'] / kt['ms']:.2f}x)")
    c = by[CEILING]
    parts.append(f"ceiling {fmt('gflops', c['gflops'])} GFLOP/s")
    return " | ".join(parts)


# --------------------------------------------------------------------------------------------
# peak memory (subprocesses)


def _status_kib(key: str) -> Optional[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def probe_main(spec: dict) -> None:
    """Child: measure state and step memory of the (mode, impl) pairs of one case."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    case = CASE_BY_NAME[spec["case"]]
    args = SimpleNamespace(rank=spec["rank"], lora_alpha=spec["lora_alpha"],
                           lora_scale=spec["lora_alpha"] / spec["rank"], seed=spec["seed"])
    t0 = time.perf_counter()
    # Warm-up pass on the tiny shape: one-time costs (shared-library code paged in, autograd
    # engine and thread-pool start-up, allocator caches) must not be charged to whichever
    # (mode, impl) happens to be measured first.
    tiny_cfg = problem_config(CASE_BY_NAME["tiny"], args)
    tiny = make_problem(tiny_cfg)
    tiny["w13"] = torch.cat([tiny["gate_proj"], tiny["up_proj"]], dim=1)
    for mode, name in dict.fromkeys(map(tuple, spec["pairs"])):
        impl = None
        try:
            impl = build_impl(name, mode, tiny, tiny_cfg)
            impl.reset()
            impl.step()
            impl.reset()
        except Exception:
            pass  # reported by the measurement below
        finally:
            if impl is not None:
                impl.close()
    del tiny, impl
    cfg = problem_config(case, args)
    prob = make_problem(cfg)
    prob["w13"] = torch.cat([prob["gate_proj"], prob["up_proj"]], dim=1)
    gc.collect()
    result = {"hwm_reset": _reset_hwm(), "base_rss_mib": _status_kib("VmRSS") / 1024,
              "setup_s": time.perf_counter() - t0, "pairs": []}
    for mode, name in spec["pairs"]:
        entry = {"mode": mode, "impl": name}
        t1 = time.perf_counter()
        impl = y = None
        try:
            gc.collect()
            anon0 = _status_kib("RssAnon")
            impl = build_impl(name, mode, prob, cfg)
            impl.reset()
            # Untimed warm-up (lazy initialisation, persistent buffers): three calls, after
            # which kt.moe has packed weights that stay unchanged (counted as its state).
            for _ in range(3):
                y = impl.step()
                del y
                impl.reset()
            gc.collect()
            entry["state_mib"] = (_status_kib("RssAnon") - anon0) / 1024
            rss1 = _status_kib("VmRSS")
            if _reset_hwm():
                y = impl.step()
                entry["step_mib"] = (_status_kib("VmHWM") - rss1) / 1024
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        finally:
            y = None
            if impl is not None:
                try:
                    impl.reset()
                    impl.close()
                except Exception:
                    pass
            impl = None
            gc.collect()
        entry["seconds"] = time.perf_counter() - t1
        result["pairs"].append(entry)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(PROBE_TAG + json.dumps(result), flush=True)


def run_probe(spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "benchmarks.suite", "--_probe", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"probe exited {proc.returncode}: {tail[0][:200]}"}


def measure_memory(case: Case, rows: List[dict], args, notes: List[str]) -> None:
    pairs = [(r["mode"], r["impl"]) for r in rows
             if r["status"] == "ok" and r["impl"] != CEILING]
    if not pairs:
        return
    base = dict(case=case.name, threads=torch.get_num_threads(), rank=args.rank,
                lora_alpha=args.lora_alpha, seed=args.seed)
    t0 = time.perf_counter()
    groups = [pairs] if args.memory == "case" else [[p] for p in pairs]
    results = {}
    for group in groups:
        res = run_probe(dict(base, pairs=group))
        if "error" in res:
            notes.append(f"{case.name}: memory probe failed: {res['error']}")
            continue
        if not res.get("hwm_reset"):
            msg = ("peak memory: /proc/self/clear_refs is not writable here, so step MiB "
                   "cannot be measured (state MiB still is)")
            if msg not in notes:
                notes.append(msg)
        for e in res["pairs"]:
            results[(e["mode"], e["impl"])] = e
    for r in rows:
        e = results.get((r["mode"], r["impl"]))
        if e is None:
            continue
        if "error" in e:
            notes.append(f"{case.name}/{r['mode']}: {r['impl']} memory probe: {e['error']}")
            continue
        r["state_mib"] = e.get("state_mib")
        r["step_mib"] = e.get("step_mib")
    print(f"   peak memory measured in {len(groups)} subprocess(es), "
          f"{time.perf_counter() - t0:.1f}s", flush=True)


# --------------------------------------------------------------------------------------------
# output


DETAIL_COLUMNS = [("case", "case"), ("mode", "mode"), ("impl", "impl"), ("ms", "median ms"),
                  ("tok_s", "tokens/s"), ("gflops", "GFLOP/s"), ("pct_ceiling", "% ceil"),
                  ("x_stream", "x stream"), ("step_mib", "step MiB"),
                  ("state_mib", "state MiB"), ("out_err", "out err"),
                  ("grad_err", "grad err"), ("util", "CPU/wall")]
SUMMARY_COLUMNS = [("case", "case"), ("mode", "mode"), ("tok_s", "kt tokens/s"),
                   ("gflops", "kt GFLOP/s"), ("ceiling", "ceil GFLOP/s"),
                   ("pct_ceiling", "% ceil"), ("vs_sorted-mm", "vs sorted-mm"),
                   ("vs_grouped-mm", "vs grouped-mm"), ("vs_hf-loop", "vs hf-loop"),
                   ("vs_kt-kernel", "vs kt-kernel"), ("x_stream", "x stream"),
                   ("step_mib", "step MiB"), ("out_err", "out err"), ("grad_err", "grad err")]
TEXT_KEYS = {"case", "mode", "impl"}


def fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if key == "ms":
        return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.1f}"
    if key == "tok_s":
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    if key in ("gflops", "ceiling"):
        return f"{v:.1f}" if v >= 1 else f"{v:.3f}"
    if key == "pct_ceiling":
        return f"{v:.0f}%"
    if key == "x_stream" or key.startswith("vs_"):
        return f"{v:.2f}x"
    if key in ("step_mib", "state_mib"):
        return f"{round(v, 1) + 0.0:.1f}"  # no "-0.0"
    if key in ("out_err", "grad_err"):
        return f"{v:.1e}"
    if key == "util":
        return f"{v:.2f}"
    return str(v)


def detail_rows(rows: List[dict]) -> List[dict]:
    out = []
    for r in rows:
        if r["status"] == "ok":
            out.append(r)
        else:  # n/a or skipped: the reason in the first numeric column
            short = r["status"]
            if r["impl"] == "kt-kernel" and "not installed" in short:
                short = "not installed"
            out.append(dict(case=r["case"], mode=r["mode"], impl=r["impl"],
                            ms=short.split(":")[0]))
    return out


def summary_rows(rows: List[dict]) -> List[dict]:
    out = []
    keys = []
    for r in rows:
        if (r["case"], r["mode"]) not in keys:
            keys.append((r["case"], r["mode"]))
    for case, mode in keys:
        by = {r["impl"]: r for r in rows if r["case"] == case and r["mode"] == mode}
        kt = by["kt.moe"]
        s = dict(case=case, mode=mode, tok_s=kt["tok_s"], gflops=kt["gflops"],
                 ceiling=by[CEILING]["gflops"], pct_ceiling=kt["pct_ceiling"],
                 x_stream=kt["x_stream"], step_mib=kt["step_mib"], out_err=kt["out_err"],
                 grad_err=kt["grad_err"])
        for name in IMPLS[1:]:
            r = by.get(name)
            if r is None:
                v = "-"
            elif r["status"] == "ok":
                v = r["ms"] / kt["ms"]
            elif "not installed" in r["status"]:
                v = "not installed"
            else:
                v = r["status"].split(":")[0]
            s["vs_" + name] = v
        out.append(s)
    return out


def print_tables(rows: List[dict], args, meta: dict, notes: List[str]) -> dict:
    detail = detail_rows(rows)
    summary = summary_rows(rows)
    right_d = {k for k, _ in DETAIL_COLUMNS if k not in TEXT_KEYS}
    right_s = {k for k, _ in SUMMARY_COLUMNS if k not in TEXT_KEYS}
    print()
    print("Summary (kt.moe; vs X = X's time / kt.moe's time, > 1 means kt.moe is faster):")
    print()
    print(common.text_table(summary, SUMMARY_COLUMNS, right_s, fmt))
    print()
    print("All implementations:")
    print()
    print(common.text_table(detail, DETAIL_COLUMNS, right_d, fmt))
    if notes:
        print()
        print("Notes:")
        for n in notes:
            print(f"- {n}")
    print()
    print("Markdown:")
    print()
    print(f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}; bf16, LoRA r="
          f"{args.rank}; median of {args.repeats} (decode cases {4 * args.repeats}); memory "
          f"copy {meta['copy_gbps']:.1f} GB/s at the start. vs X = X's time / kt.moe's time; "
          f"% ceil = GFLOP/s / the mode's base GEMMs as plain torch.mm at the same "
          f"per-expert rows; x stream = forward time / time to read the routed weights "
          f"once; errors vs sorted-mm (bf16).")
    print()
    print(common.markdown_table(summary, SUMMARY_COLUMNS, right_s, fmt))
    print()
    print(common.markdown_table(detail, DETAIL_COLUMNS, right_d, fmt))
    if notes:
        print()
        for n in notes:
            print(f"- {n}")
    return dict(summary=summary)


def write_json(path: str, meta: dict, cases: List[dict], rows: List[dict], notes: List[str],
               finished: bool) -> None:
    doc = dict(meta=meta, finished=finished, cases=cases, rows=rows,
               summary=summary_rows(rows) if rows else [], notes=notes)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if args._probe is not None:
        probe_main(json.loads(args._probe))
        return
    if args.list:
        for c in CASES:
            extra = " (decode)" if c.decode else ""
            extra += " (--quick only)" if c.quick_only else ""
            extra += " (hf-loop skipped by default)" if c.skip_loop else ""
            print(f"{c.name:28s} {c.shape()}{extra}")
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    kt_status = kt_kernel_status()
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu_model(),
                logical_cpus=os.cpu_count(), kt_kernel=kt_status,
                cases=[c.name for c in args.case_list], modes=args.modes, impls=args.impls,
                repeats=args.repeats, warmup=args.warmup, rank=args.rank,
                lora_alpha=args.lora_alpha, seed=args.seed, memory=args.memory,
                load_before=load_average())
    print(f"torch {meta['torch']} | threads {meta['threads']} | CPU: {meta['cpu']} "
          f"({meta['logical_cpus']} logical CPUs) | bf16, LoRA r={args.rank} "
          f"(scale {args.lora_scale:g})")
    print(f"cases {','.join(meta['cases'])} | modes {','.join(args.modes)} | repeats "
          f"{args.repeats} (median; decode cases x4) after {args.warmup} warmup + 1 check step")
    print(f"impls {','.join(args.impls)} + {CEILING} | kt-kernel: {kt_status}"
          + ("" if not kt_status.startswith("ok") or KT_KERNEL_VERSION in kt_status
             else f" (expected {KT_KERNEL_VERSION}; its API may differ)"))
    print(f"peak memory: {args.memory}" + (
        "" if args.memory == "off" else
        " (VmHWM with a clear_refs reset in fresh subprocesses, MALLOC_MMAP_THRESHOLD_=65536)"))
    if meta["load_before"] is not None:
        busy = meta["load_before"] > 0.5 * (os.cpu_count() or 1)
        print(f"load average (1 min) before the run: {meta['load_before']:.2f}"
              + ("  <-- other processes are busy: timings will be unreliable (multi-threaded "
                 "torch ops suffer most; --threads 1 is far less sensitive)" if busy else ""))
    meta["copy_gbps"] = copy_bandwidth(args.copy_mib)
    print(f"memory copy ({args.copy_mib} MiB copy_): {meta['copy_gbps']:.1f} GB/s read+write")
    print(flush=True)

    notes: List[str] = []
    rows: List[dict] = []
    cases: List[dict] = []
    t_start = time.perf_counter()
    for case in args.case_list:
        info, case_rows = run_case(case, args, notes)
        if args.memory != "off":
            measure_memory(case, case_rows, args, notes)
        rows += case_rows
        cases.append(dict(asdict(case), **info))
        if args.json:
            write_json(args.json, meta, cases, rows, notes, finished=False)
        print(flush=True)

    meta["load_after"] = load_average()
    meta["wall_s"] = time.perf_counter() - t_start
    meta["copy_gbps_after"] = copy_bandwidth(args.copy_mib)
    print(f"done in {meta['wall_s']:.0f}s | memory copy after the run: "
          f"{meta['copy_gbps_after']:.1f} GB/s"
          + (f" | load average (1 min) after: {meta['load_after']:.2f} (includes this "
             f"benchmark's own {meta['threads']} threads)" if meta["load_after"] is not None
             else ""))
    print_tables(rows, args, meta, notes)
    if args.json:
        write_json(args.json, meta, cases, rows, notes, finished=True)
        print()
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
