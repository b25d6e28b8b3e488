"""Benchmark ``kt.moe`` against an eager Hugging Face-style MoE loop with PEFT LoRA.

Run from the repository root (either form works)::

    .venv/bin/python benchmarks/bench_moe.py            # Qwen3-30B-A3B layer, T=1024, bf16
    .venv/bin/python benchmarks/bench_moe.py --quick    # tiny shape, a smoke test
    .venv/bin/python -m benchmarks.bench_moe --tokens 256 --repeats 3

Modes (``--modes``, comma-separated; default ``fwd,lora,full``):

* ``fwd``      forward only, no LoRA, under ``torch.no_grad()`` for both implementations
               (inference);
* ``fwd_lora`` forward only with the LoRA adapters applied, under ``torch.no_grad()``;
* ``lora``     forward + backward, LoRA rank ``--rank``: the base weights are frozen, only the
               six LoRA tensors and the hidden states require grad;
* ``full``     forward + backward, no LoRA, the three base weights and the hidden states
               require grad.

The routing weights never require grad here (the router lives outside the layer). Backward is
``y.backward(dy)`` with a fixed random ``dy``; gradients are reset to ``None`` between steps.

The baseline (``benchmarks/baselines.py``) is the transformers 4.x sparse-MoE block: one
``nn.Module`` per expert with ``nn.Linear`` gate/up/down (bias=False), PEFT-style LoRA as two
extra ``nn.Linear`` calls per projection, and HF's ``one_hot``/``torch.where``/``index_add_``
routing loop. Its weights are copies of the stacked tensors given to ``kt.moe``.

FLOP count (multiply-add = 2 FLOPs; element-wise work such as SiLU, scaling and the routing
sums is not counted). With P = T·K routed (token, expert) pairs and r the LoRA rank:

    base forward   F_base = 6·P·H·I                 (gate, up: 2·H·I each; down: 2·I·H)
    LoRA forward   F_lora = 6·P·r·(H + I)           (per projection A: 2·in·r, B: 2·r·out)
    fwd            F_base
    fwd_lora       F_base + F_lora
    lora  (fwd+bwd) F_base + F_lora  +  F_base + 2·F_lora
                   (backward: input gradients through the frozen base weights, ≈ 1× forward,
                    plus the LoRA input gradients and dA, dB: 2× the LoRA forward)
    full  (fwd+bwd) F_base  +  2·F_base
                   (backward: input gradients 1× and weight gradients 1× the forward)

GFLOP/s = FLOPs / median time; tokens/s = T / median time. ``speedup`` is the loop's median
time over ``kt.moe``'s. ``out err`` is ‖y_kt − y_loop‖ / ‖y_loop‖ (Frobenius norm, computed in
fp32, or fp64 for fp64 runs) from one untimed call per mode; ``grad err`` is the largest such
relative error over the gradients of every tensor that requires grad (hidden states and the
trained weights). Both implementations run in ``--dtype``, so in bf16 this measures their
disagreement (a few 1e-3 is expected), not the error of either against exact math; with
``--dtype fp64`` both agree to about 1e-15.

Timing: per mode, one untimed correctness call per implementation, ``--warmup`` untimed steps,
then ``--repeats`` timed steps; the two implementations alternate step by step so that both see
the same machine load. Never run two benchmarks at once on a small machine.
"""
import argparse
import gc
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `kt_ops` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kt_ops  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.baselines import HFLoopMoE  # noqa: E402
from benchmarks.common import (  # noqa: E402,F401  (re-exported: older imports keep working)
    BASE, DTYPES, LORA, Impl, cpu_model, flops, load_average, make_problem, make_step,
    mark_updated_in_place, rel_err)

MODES = ("fwd", "fwd_lora", "lora", "full")
DEFAULT_SHAPE = dict(tokens=1024, hidden=2048, intermediate=768, experts=128, topk=8)
QUICK_SHAPE = dict(tokens=256, hidden=256, intermediate=128, experts=8, topk=2)


# --------------------------------------------------------------------------------------------
# setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", "-T", type=int, default=None, help="tokens T (default 1024)")
    p.add_argument("--hidden", "-H", type=int, default=None, help="hidden size H (default 2048)")
    p.add_argument("--intermediate", "-I", type=int, default=None,
                   help="expert intermediate size I (default 768)")
    p.add_argument("--experts", "-E", type=int, default=None, help="experts E (default 128)")
    p.add_argument("--topk", "-K", type=int, default=None, help="experts per token K (default 8)")
    p.add_argument("--rank", "-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="LoRA alpha; scale = alpha / rank (default 16)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="dtype of weights and activations (default bf16)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per impl (default 5)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per impl after the correctness call (default 2: with it, "
                        "the three calls after which kt.moe packs weights that stay unchanged)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--modes", default="fwd,lora,full",
                   help=f"comma-separated subset of {','.join(MODES)} (default fwd,lora,full)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shape for smoke tests: T=256 H=256 I=128 E=8 K=2 "
                        "(explicit shape flags still win)")
    args = p.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else DEFAULT_SHAPE
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.topk > args.experts:
        p.error("--topk must be <= --experts")
    args.torch_dtype = DTYPES[args.dtype]
    args.lora_scale = args.lora_alpha / args.rank
    shape_now = {k: getattr(args, k) for k in DEFAULT_SHAPE}
    args.case = ("qwen3-30b-a3b" if shape_now == DEFAULT_SHAPE
                 else "quick" if shape_now == QUICK_SHAPE else "custom")
    return args


# --------------------------------------------------------------------------------------------
# one mode


def build_impls(mode: str, prob: Dict[str, torch.Tensor], args):
    use_lora = mode in ("fwd_lora", "lora")
    train = mode in ("lora", "full")
    trained = (LORA if mode == "lora" else BASE if mode == "full" else ())
    lora_names = LORA if use_lora else ()
    scale = args.lora_scale
    dy = prob["dy"]
    ids, w = prob["topk_ids"], prob["topk_weights"]

    # kt.moe: leaves sharing storage with the stacked tensors; grads land in their .grad.
    kt_x = prob["hidden"].detach().requires_grad_(train)
    kt_w = {n: prob[n].detach().requires_grad_(n in trained) for n in BASE + lora_names}
    kt_lora = [kt_w[n] for n in LORA] if use_lora else [None] * 6

    def kt_forward():
        return kt_ops.moe(kt_x, ids, w, kt_w["gate_proj"], kt_w["up_proj"], kt_w["down_proj"],
                          *kt_lora, scale)

    # HF loop: per-expert nn.Linear copies of the same weights.
    model = HFLoopMoE(*(prob[n] for n in BASE),
                      *((prob[n] for n in LORA) if use_lora else [None] * 6),
                      lora_scale=scale)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[0]  # e.g. experts.3.gate_proj.lora_A
        is_lora = leaf.endswith("lora_A") or leaf.endswith("lora_B")
        p.requires_grad_(train and (is_lora if mode == "lora" else not is_lora))
    loop_x = prob["hidden"].detach().clone().requires_grad_(train)

    def loop_forward():
        return model(loop_x, ids, w)

    def kt_reset():
        kt_x.grad = None
        for t in kt_w.values():
            t.grad = None
        if mode == "full":
            mark_updated_in_place(kt_w[n] for n in BASE)

    def loop_reset():
        loop_x.grad = None
        model.zero_grad(set_to_none=True)

    def kt_grads():
        out = {"hidden": kt_x.grad}
        out.update({n: kt_w[n].grad for n in trained})
        return out

    def loop_grads():
        out = {"hidden": loop_x.grad}
        out.update(model.stacked_grads(trained, prob))
        return out

    impls = [Impl("kt.moe", make_step(kt_forward, train, dy), kt_reset, kt_grads),
             Impl("hf-loop", make_step(loop_forward, train, dy), loop_reset, loop_grads)]
    return impls, model


def run_mode(mode: str, prob, args) -> List[dict]:
    train = mode in ("lora", "full")
    impls, model = build_impls(mode, prob, args)
    kt, loop = impls

    # Correctness: one untimed call each.
    outs, grads = {}, {}
    for impl in impls:
        impl.reset()
        outs[impl.name] = impl.step().detach()
        if train:
            grads[impl.name] = impl.grads()
    out_err = rel_err(outs["kt.moe"], outs["hf-loop"])
    grad_err: Optional[float] = None
    if train:
        errs = {}
        for n, ref in grads["hf-loop"].items():
            got = grads["kt.moe"][n]
            errs[n] = float("inf") if got is None or ref is None else rel_err(got, ref)
        grad_err = max(errs.values())
    del outs, grads
    for impl in impls:
        impl.reset()
    gc.collect()

    # Warmup, then timed steps; the two implementations alternate.
    for i in range(args.warmup + args.repeats):
        for impl in impls:
            impl.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            y = impl.step()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            del y
            if i >= args.warmup:
                impl.times.append(dt)
                impl.cpu.append(dc)
    for impl in impls:
        impl.reset()

    fl = flops(mode, args.tokens, args.topk, args.hidden, args.intermediate, args.rank)
    med = {impl.name: statistics.median(impl.times) for impl in impls}
    rows = []
    for impl in impls:
        s = med[impl.name]
        is_kt = impl is kt
        rows.append(dict(
            case=args.case, mode=mode, impl=impl.name, ms=s * 1e3,
            tok_s=args.tokens / s, gflops=fl / s / 1e9,
            speedup=(med["hf-loop"] / s) if is_kt else 1.0,
            out_err=out_err if is_kt else None,
            grad_err=grad_err if is_kt else None,
            times=impl.times,
            util=sum(impl.cpu) / sum(impl.times),
        ))
    del impls, model
    gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# output

COLUMNS = [("case", "case"), ("mode", "mode"), ("impl", "impl"), ("ms", "median ms"),
           ("tok_s", "tokens/s"), ("gflops", "GFLOP/s"), ("speedup", "speedup"),
           ("out_err", "out err"), ("grad_err", "grad err")]
RIGHT = {"ms", "tok_s", "gflops", "speedup", "out_err", "grad_err"}


def fmt(key, v) -> str:
    if v is None:
        return "-"
    if key == "ms":
        return f"{v:.2f}" if v < 100 else f"{v:.1f}"
    if key == "tok_s":
        return f"{v:,.0f}"
    if key == "gflops":
        return f"{v:.1f}"
    if key == "speedup":
        return f"{v:.2f}x"
    if key in ("out_err", "grad_err"):
        return f"{v:.1e}"
    return str(v)


def text_table(rows) -> str:
    return common.text_table(rows, COLUMNS, RIGHT, fmt)


def markdown_table(rows) -> str:
    return common.markdown_table(rows, COLUMNS, RIGHT, fmt)


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    T, H, I, E, K, r = args.tokens, args.hidden, args.intermediate, args.experts, args.topk, args.rank
    shape = (f"T={T} H={H} I={I} E={E} K={K} r={r} (lora scale {args.lora_scale:g}) "
             f"{args.dtype}")
    print(f"torch {torch.__version__} | threads {torch.get_num_threads()} | CPU: {cpu_model()} "
          f"({os.cpu_count()} logical CPUs)")
    print(f"case {args.case}: {shape} | modes {','.join(args.modes)} | "
          f"repeats {args.repeats} (median) after {args.warmup} warmup + 1 check step")
    weight_gib = 3 * E * I * H * torch.empty((), dtype=args.torch_dtype).element_size() / 2 ** 30
    print(f"base expert weights {weight_gib:.2f} GiB (the loop holds its own copy)")

    t0 = time.perf_counter()
    prob = make_problem(args)
    counts = torch.bincount(prob["topk_ids"].reshape(-1), minlength=E)
    print(f"routing: softmax top-{K} of random logits (seed {args.seed}); tokens per expert "
          f"min {counts.min().item()} / mean {counts.float().mean().item():.1f} / "
          f"max {counts.max().item()}; experts hit {(counts > 0).sum().item()}/{E} "
          f"| setup {time.perf_counter() - t0:.1f}s")
    print("FLOPs: F_base = 6*T*K*H*I, F_lora = 6*T*K*r*(H+I); fwd = F_base, "
          "fwd_lora = F_base + F_lora, lora = 2*F_base + 3*F_lora, full = 3*F_base")
    load = load_average()
    if load is not None:
        busy = load > 0.5 * (os.cpu_count() or 1)
        print(f"load average (1 min) before the run: {load:.2f}"
              + ("  <-- other processes are busy: timings will be unreliable" if busy else ""))
    print()

    rows = []
    for mode in args.modes:
        t0 = time.perf_counter()
        mode_rows = run_mode(mode, prob, args)
        rows += mode_rows
        kt_row = mode_rows[0]
        print(f"[{mode}] done in {time.perf_counter() - t0:.1f}s: kt.moe {kt_row['ms']:.2f} ms, "
              f"hf-loop {mode_rows[1]['ms']:.2f} ms, speedup {kt_row['speedup']:.2f}x, "
              f"out err {kt_row['out_err']:.1e}"
              + (f", grad err {kt_row['grad_err']:.1e}" if kt_row["grad_err"] is not None else ""),
              flush=True)
        for row in mode_rows:
            spread = ", ".join(f"{t * 1e3:.1f}" for t in row["times"])
            print(f"    {row['impl']:8s} step times (ms): {spread}  "
                  f"[CPU/wall {row['util']:.2f}]", flush=True)

    load = load_average()
    if load is not None:
        print(f"load average (1 min) after the run: {load:.2f} (includes this benchmark's own "
              f"{torch.get_num_threads()} threads); a kt.moe CPU/wall well below the thread "
              "count also hints at a shared machine")
    print()
    print(text_table(rows))
    print()
    print("Markdown:")
    print()
    print(f"`{shape}`, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_model()}; median of {args.repeats}. Speedup = hf-loop time / kt.moe time; "
          f"errors are kt.moe vs hf-loop (relative Frobenius norm).")
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
