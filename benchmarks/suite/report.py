"""What the suite prints and writes: the run header (machine, code path), the per-mode progress
line, the summary and detail tables (text and Markdown), and the JSON file."""
import json
import os
from typing import List

from benchmarks import common
from benchmarks.suite.ceilings import CEILING, CEILING_FP32
from benchmarks.suite.impls import IMPLS, KT_MOE_FORMATS
from benchmarks.suite.kt_kernel import KT_KERNEL_VERSION

DETAIL_COLUMNS = [("case", "case"), ("mode", "mode"), ("impl", "impl"), ("ms", "median ms"),
                  ("tok_s", "tokens/s"), ("gflops", "GFLOP/s"), ("pct_ceiling", "% ceil"),
                  ("pct_ceiling_fp32", "% fp32 ceil"), ("x_stream", "x stream"),
                  ("step_mib", "step MiB"), ("state_mib", "state MiB"), ("out_err", "out err"),
                  ("grad_err", "grad err"), ("util", "CPU/wall")]
SUMMARY_COLUMNS = [("case", "case"), ("mode", "mode"), ("tok_s", "kt tokens/s"),
                   ("gflops", "kt GFLOP/s"), ("ceiling", "ceil GFLOP/s"),
                   ("pct_ceiling", "% ceil"), ("pct_ceiling_fp32", "% fp32 ceil"),
                   ("vs_kt.moe-fp32", "vs kt fp32"), ("vs_sorted-mm", "vs sorted-mm"),
                   ("vs_grouped-mm", "vs grouped-mm"), ("vs_hf-loop", "vs hf-loop"),
                   ("vs_kt-kernel", "vs kt-kernel"), ("x_stream", "x stream"),
                   ("step_mib", "step MiB"), ("out_err", "out err"), ("grad_err", "grad err")]
QUANTIZED_COLUMNS = [("case", "case"), ("mode", "mode"), ("impl", "experts"), ("tok_s", "tokens/s"),
                     ("x_bf16", "x bf16 speed"), ("x_stream", "x stream"), ("out_err", "out err"),
                     ("grad_err", "grad err")]
TEXT_KEYS = {"case", "mode", "impl"}


def fmt(key: str, v) -> str:
    """One table cell: value ``v`` of row key ``key``."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if key == "ms":
        return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.1f}"
    if key == "tok_s":
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    if key in ("gflops", "ceiling", "ceiling_fp32"):
        return f"{v:.1f}" if v >= 1 else f"{v:.3f}"
    if key in ("pct_ceiling", "pct_ceiling_fp32"):
        return f"{v:.0f}%"
    if key in ("x_stream", "x_bf16") or key.startswith("vs_"):
        return f"{v:.2f}x"
    if key in ("step_mib", "state_mib"):
        return f"{round(v, 1) + 0.0:.1f}"  # no "-0.0"
    if key in ("out_err", "grad_err"):
        return f"{v:.1e}"
    if key == "util":
        return f"{v:.2f}"
    return str(v)


def short_status(row: dict) -> str:
    """A row's status without its reason: ``n/a``, ``skipped`` or ``not installed``."""
    if "not installed" in row["status"]:
        return "not installed"
    return row["status"].split(":")[0]


def code_path_text(meta: dict) -> str:
    """The code path of ``common.code_path()`` (merged into ``meta``) in one line."""
    env = " ".join(f"{k}={v}" for k, v in meta["env"].items())
    flags = meta["cpu_flags"]
    if flags is None:
        listed = "CPU flags unknown"
    else:
        listed = "CPU flags: " + (" ".join(f for f, on in flags.items() if on) or "none")
        missing = [f for f, on in flags.items() if not on]
        listed += f" (not {' '.join(missing)})" if missing else ""
    return (f"kt_ops path {meta['cpu_isa']} (best here {meta['best_cpu_isa']}) | bf16 base "
            f"GEMM {meta['base_gemm_path']} (quantized experts {meta.get('quantized_gemm_path', '?')}) | weight packing "
            f"{'on' if meta['weight_packing'] else 'off'} | {env} | {listed}")


def print_header(meta: dict, args) -> None:
    print(f"torch {meta['torch']} | threads {meta['threads']} | CPU: {meta['cpu']} "
          f"({meta['logical_cpus']} logical CPUs) | bf16, LoRA r={args.rank} "
          f"(scale {args.lora_scale:g})")
    print(code_path_text(meta))
    print(f"cases {','.join(meta['cases'])} | modes {','.join(args.modes)} | repeats "
          f"{args.repeats} (median; decode cases x4) after {args.warmup} warmup + 1 check step")
    kt_status = meta["kt_kernel"]
    print(f"impls {','.join(args.impls)} + {CEILING}, {CEILING_FP32} | kt-kernel: {kt_status}"
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


def progress_line(mode: str, rows: List[dict]) -> str:
    """kt.moe's time, ceiling share and errors, then every other impl's time and ratio."""
    by = {r["impl"]: r for r in rows}
    kt = by["kt.moe"]
    parts = [f"[{mode}] kt.moe {kt['ms']:.2f} ms ({kt['pct_ceiling_fp32']:.0f}% of fp32 mm ceiling, "
             f"out err {kt['out_err']:.1e}"
             + (f", grad err {kt['grad_err']:.1e}" if kt["grad_err"] is not None else "") + ")"]
    for name in IMPLS[1:]:
        r = by.get(name)
        if r is None:
            continue
        if r["status"] != "ok":
            parts.append(f"{name} {short_status(r)}")
        else:
            parts.append(f"{name} {r['ms']:.2f} ms ({r['ms'] / kt['ms']:.2f}x)")
    parts.append(f"ceiling {fmt('gflops', by.get(CEILING, {}).get('gflops'))} GFLOP/s (fp32 "
                 f"{fmt('gflops', by[CEILING_FP32]['gflops'])})")
    return " | ".join(parts)


def detail_rows(rows: List[dict]) -> List[dict]:
    """The rows as the detail table shows them: n/a and skipped ones with the short status in
    the first numeric column."""
    return [r if r["status"] == "ok" else
            dict(case=r["case"], mode=r["mode"], impl=r["impl"], ms=short_status(r))
            for r in rows]


def summary_rows(rows: List[dict]) -> List[dict]:
    """One row per (case, mode): kt.moe's figures, both ceilings and ``vs_<impl>`` = that
    impl's median time / kt.moe's (or its short status)."""
    out = []
    keys = list(dict.fromkeys((r["case"], r["mode"]) for r in rows))
    for case, mode in keys:
        by = {r["impl"]: r for r in rows if r["case"] == case and r["mode"] == mode}
        kt = by["kt.moe"]
        s = dict(case=case, mode=mode, tok_s=kt["tok_s"], gflops=kt["gflops"],
                 ceiling=by.get(CEILING, {}).get("gflops"), ceiling_fp32=by[CEILING_FP32]["gflops"],
                 pct_ceiling=kt["pct_ceiling"], pct_ceiling_fp32=kt["pct_ceiling_fp32"],
                 x_stream=kt["x_stream"], step_mib=kt["step_mib"], out_err=kt["out_err"],
                 grad_err=kt["grad_err"])
        for name in IMPLS[1:]:
            r = by.get(name)
            s["vs_" + name] = ("-" if r is None else r["ms"] / kt["ms"] if r["status"] == "ok"
                               else short_status(r))
        out.append(s)
    return out


def quantized_rows(rows: List[dict]) -> List[dict]:
    """One row per (case, mode, quantized format) that ran: its tokens/s, ``x_bf16`` = kt.moe
    bf16's time / its time (> 1: the quantized experts are faster), and its errors (against the
    bf16 reference on the unquantized weights: the quantization error included)."""
    out = []
    for r in rows:
        if r["impl"] not in KT_MOE_FORMATS or r["status"] != "ok":
            continue
        kt = next(k for k in rows if k["case"] == r["case"] and k["mode"] == r["mode"] and k["impl"] == "kt.moe")
        out.append(dict(case=r["case"], mode=r["mode"], impl=r["impl"], tok_s=r["tok_s"], x_bf16=kt["ms"] / r["ms"],
                        x_stream=r["x_stream"], out_err=r["out_err"], grad_err=r["grad_err"]))
    return out


def print_tables(rows: List[dict], args, meta: dict, notes: List[str]) -> dict:
    detail = detail_rows(rows)
    summary = summary_rows(rows)
    quantized = quantized_rows(rows)
    right_q = {k for k, _ in QUANTIZED_COLUMNS if k not in TEXT_KEYS}
    right_d = {k for k, _ in DETAIL_COLUMNS if k not in TEXT_KEYS}
    right_s = {k for k, _ in SUMMARY_COLUMNS if k not in TEXT_KEYS}
    print()
    print("Summary (kt.moe; vs X = X's time / kt.moe's time, > 1 means kt.moe is faster):")
    print()
    print(common.text_table(summary, SUMMARY_COLUMNS, right_s, fmt))
    if quantized:
        print()
        print("Quantized experts (bf16 activations; x bf16 speed = kt.moe bf16's time / this one's):")
        print()
        print(common.text_table(quantized, QUANTIZED_COLUMNS, right_q, fmt))
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
    print(f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}; kt_ops path "
          f"{meta['cpu_isa']}, bf16 base GEMM {meta['base_gemm_path']}; bf16, LoRA r="
          f"{args.rank}; median of {args.repeats} (decode cases {4 * args.repeats}); memory "
          f"copy {meta['copy_gbps']:.1f} GB/s at the start. vs X = X's time / kt.moe's time "
          f"(vs kt fp32: kt.moe in float32); % ceil = GFLOP/s / the mode's base GEMMs as "
          f"plain torch.mm at the same per-expert rows (% fp32 ceil: the same GEMMs in "
          f"float32); x stream = forward time / time to read the routed bf16 weights once; "
          f"errors vs sorted-mm (bf16).")
    print()
    print(common.markdown_table(summary, SUMMARY_COLUMNS, right_s, fmt))
    if quantized:
        print()
        print(common.markdown_table(quantized, QUANTIZED_COLUMNS, right_q, fmt))
    print()
    print(common.markdown_table(detail, DETAIL_COLUMNS, right_d, fmt))
    if notes:
        print()
        for n in notes:
            print(f"- {n}")
    return dict(summary=summary, quantized=quantized)


def write_json(path: str, meta: dict, cases: List[dict], rows: List[dict], notes: List[str],
               finished: bool) -> None:
    """Write the whole run to ``path`` (atomically: a temporary file, then a rename)."""
    doc = dict(meta=meta, finished=finished, cases=cases, rows=rows,
               summary=summary_rows(rows) if rows else [], quantized=quantized_rows(rows) if rows else [],
               notes=notes)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
