"""The timing process: for each case and mode, build the implementations, check them against
the reference once, time them and the ceilings step by step in alternation, and turn the times
into rows; ``run_suite`` runs every case with the header, the tables and the JSON."""
import gc
import os
import statistics
import time
from dataclasses import asdict
from typing import Dict, List, Tuple

import torch

from benchmarks.common import Impl, Unavailable, code_path, cpu_model, flops, load_average, rel_err
from benchmarks.suite import report
from benchmarks.suite.cases import Case, case_problem, problem_config, routing_stats
from benchmarks.suite.ceilings import (CEILING, CEILING_FP32, CEILINGS, build_ceiling, timed_ceilings,
                                       ceiling_flops, copy_bandwidth, single_mm_gflops)
from benchmarks.suite.impls import IMPLS, REFERENCE, build_impl, close_quietly
from benchmarks.suite.kt_kernel import INSTALL_NOTE, kt_kernel_status
from benchmarks.suite.memory import estimate_peak_gib, mem_available_gib, measure_memory

def required(reference: str) -> tuple:
    """The implementations whose failure stops the run."""
    return ("kt.moe", reference) + CEILINGS
ROW_ORDER = {n: i for i, n in enumerate(IMPLS + CEILINGS)}


def _drop(impl: Impl, impls: List[Impl], unavailable: Dict[str, str], e: Exception) -> None:
    """An optional implementation raised: report it as n/a and free it."""
    unavailable[impl.name] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    impls.remove(impl)
    close_quietly(impl)
    gc.collect()


def _build_impls(case: Case, mode: str, prob, cfg, args) -> Tuple[List[Impl], Dict[str, str]]:
    """The implementations of ``args.impls`` that can be built, and why the others are not."""
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
    return impls, unavailable


def _check(impls: List[Impl], mode: str, unavailable: Dict[str, str], reference: str = REFERENCE) -> Dict[str, tuple]:
    """One untimed call each, the reference first; the others are compared with it right away
    (so only two sets of gradients are alive at a time): ``{name: (out_err, grad_err)}``.
    rel_err compares in fp32, so kt.moe-fp32 is held to the same bf16 reference. An optional
    implementation that raises is dropped as n/a."""
    impls.sort(key=lambda i: i.name != reference)
    errs = {}
    ref_out = ref_grads = None
    for impl in list(impls):
        impl.reset()
        try:
            y = impl.step().detach()
            g = impl.grads() if mode != "fwd" else {}
            if impl.name == reference:
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
            if impl.name in required(reference):
                raise
            _drop(impl, impls, unavailable, e)
            continue
        impl.reset()
    del ref_out, ref_grads
    gc.collect()
    return errs


def _time(impls: List[Impl], ceilings: List[Impl], unavailable: Dict[str, str], warmup: int,
          repeats: int, reference: str = REFERENCE) -> None:
    """``warmup`` then ``repeats`` timed steps, alternating step by step over the
    implementations and the ceilings so that all see the same machine load; times go to each
    Impl's ``times`` and ``cpu``."""
    timed = impls + ceilings
    for i in range(warmup + repeats):
        for impl in list(timed):
            impl.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                y = impl.step()
            except Exception as e:  # only optional baselines may fail here
                if impl.name in required(reference):
                    raise
                _drop(impl, impls, unavailable, e)
                timed.remove(impl)
                continue
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            del y
            impl.reset()
            if i >= warmup:
                impl.times.append(dt)
                impl.cpu.append(dc)


def _rows(case: Case, mode: str, timed: List[Impl], errs: Dict[str, tuple], args,
          info: dict) -> List[dict]:
    """One ok row per timed implementation or ceiling (see the package docstring)."""
    T, H, I, K = case.T, case.H, case.I, case.K  # noqa: E741
    fl = flops(mode, T, K, H, I, args.rank)
    rate = {c.name: ceiling_flops(mode, T * K, H, I) / statistics.median(c.times) / 1e9
            for c in timed if c.name in CEILINGS}
    rows = []
    for impl in timed:
        s = statistics.median(impl.times)
        gflops = rate[impl.name] if impl.name in rate else fl / s / 1e9
        out_err, grad_err = errs.get(impl.name, (None, None))
        rows.append(dict(
            case=case.name, mode=mode, impl=impl.name, status="ok", ms=s * 1e3,
            tok_s=T / s, gflops=gflops, pct_ceiling=100.0 * gflops / rate[CEILING] if CEILING in rate else None,
            pct_ceiling_fp32=100.0 * gflops / rate[CEILING_FP32],
            x_stream=(s * 1e3 / info["stream_ms"]) if mode == "fwd" else None,
            out_err=out_err, grad_err=grad_err, util=sum(impl.cpu) / sum(impl.times),
            step_mib=None, state_mib=None, times_ms=[t * 1e3 for t in impl.times]))
    return rows


def _unavailable_rows(case: Case, mode: str, unavailable: Dict[str, str],
                      notes: List[str]) -> List[dict]:
    """A status row per implementation that did not run, each reason once in ``notes``."""
    rows = []
    for name, why in unavailable.items():
        rows.append(dict(case=case.name, mode=mode, impl=name, status=why))
        if name.startswith("kt-kernel") and why == "n/a: not installed":
            note = INSTALL_NOTE
        elif why.startswith("skipped"):
            note = f"{case.name}: {name} {why}"
        else:
            note = f"{case.name}/{mode}: {name} {why}"
        if note not in notes:
            notes.append(note)
    return rows


def run_mode(case: Case, mode: str, prob, cfg, args, info: dict, notes: List[str]) -> List[dict]:
    """The rows of every implementation of ``args.impls`` and both ceilings for one mode."""
    impls, unavailable = _build_impls(case, mode, prob, cfg, args)
    errs = _check(impls, mode, unavailable, args.reference)
    ceilings = [build_ceiling(name, mode, prob, info["counts"], cfg) for name in timed_ceilings()]
    _time(impls, ceilings, unavailable, args.warmup, args.repeats * (4 if case.decode else 1), args.reference)
    rows = _rows(case, mode, impls + ceilings, errs, args, info)
    rows += _unavailable_rows(case, mode, unavailable, notes)
    rows.sort(key=lambda r: ROW_ORDER[r["impl"]])
    for impl in impls + ceilings:
        impl.close()
    del impls, ceilings
    gc.collect()
    return rows


def run_case(case: Case, args, notes: List[str]) -> Tuple[dict, List[dict]]:
    """Every mode of one case: the case's info (routing, bandwidth, single-mm rate) and rows."""
    cfg = problem_config(case, args)
    t0 = time.perf_counter()
    prob = case_problem(cfg)
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
          f"[M={M},H]x[H,2I]: {report.fmt('gflops', info['single_mm']['gflops'])} GFLOP/s",
          flush=True)
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
        print("   " + report.progress_line(mode, mode_rows)
              + f" | {time.perf_counter() - t1:.1f}s", flush=True)
    del prob
    gc.collect()
    return info, rows


def run_meta(args) -> dict:
    """The machine, the code path kt_ops takes, kt-kernel's status and the run's settings."""
    return dict(torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu_model(),
                logical_cpus=os.cpu_count(), **code_path(), kt_kernel=kt_kernel_status(),
                cases=[c.name for c in args.case_list], modes=args.modes, impls=args.impls,
                repeats=args.repeats, warmup=args.warmup, rank=args.rank,
                lora_alpha=args.lora_alpha, seed=args.seed, memory=args.memory,
                load_before=load_average())


def run_suite(args) -> None:
    """Every case of ``args.case_list``: header, per-case progress, tables, JSON."""
    meta = run_meta(args)
    report.print_header(meta, args)
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
            report.write_json(args.json, meta, cases, rows, notes, finished=False)
        print(flush=True)

    meta["load_after"] = load_average()
    meta["wall_s"] = time.perf_counter() - t_start
    meta["copy_gbps_after"] = copy_bandwidth(args.copy_mib)
    print(f"done in {meta['wall_s']:.0f}s | memory copy after the run: "
          f"{meta['copy_gbps_after']:.1f} GB/s"
          + (f" | load average (1 min) after: {meta['load_after']:.2f} (includes this "
             f"benchmark's own {meta['threads']} threads)" if meta["load_after"] is not None
             else ""))
    report.print_tables(rows, args, meta, notes)
    if args.json:
        report.write_json(args.json, meta, cases, rows, notes, finished=True)
        print()
        print(f"JSON: {args.json}")
