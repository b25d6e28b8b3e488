"""The command line: arguments, case selection, and ``main`` (the timing run, ``--list``, or
the memory probe child ``--_probe``)."""
import argparse
import json

import torch

from benchmarks import suite
from benchmarks.suite.cases import CASES, MODES, QUICK_CASES, select_cases
from benchmarks.suite.impls import IMPLS, REFERENCE
from benchmarks.suite.memory import probe_main
from benchmarks.suite.run import run_suite


def parse_args(argv=None) -> argparse.Namespace:
    """The options (``--help``), with ``case_list`` (Case objects), ``modes`` and ``impls``
    (lists; kt.moe and the reference always included) and ``lora_scale`` added."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite",
                                description=suite.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None,
                   help="comma-separated case names or patterns (default: all but the "
                        "quick-only ones; --quick: tiny,tiny-t1); see --list")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default all)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)} (default all; kt.moe and "
                        f"the correctness reference (--reference) always run)")
    p.add_argument("--reference", choices=(REFERENCE, "kt.moe-fp32", "kt.moe-fp8-fp32", "kt.moe-int4-fp32"), default=REFERENCE,
                   help=f"the implementation every other is compared with (default {REFERENCE}); "
                        "kt.moe-fp32 on CPUs without native bf16 GEMMs, where a bf16 eager "
                        "step takes minutes")
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
    args.impls = [i for i in IMPLS if i in impls or i in ("kt.moe", args.reference)]
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.rank < 1:
        p.error("--rank must be >= 1")
    args.lora_scale = args.lora_alpha / args.rank
    return args


def list_cases() -> None:
    for c in CASES:
        extra = " (decode)" if c.decode else ""
        extra += " (--quick only)" if c.quick_only else ""
        extra += " (hf-loop skipped by default)" if c.skip_loop else ""
        print(f"{c.name:28s} {c.shape()}{extra}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._probe is not None:
        probe_main(json.loads(args._probe))
    elif args.list:
        list_cases()
    else:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        run_suite(args)
