"""Peak memory of each (mode, impl), measured in fresh subprocesses (``--memory``), and the
rough peak estimate of the timing process that warns when RAM is short."""
import gc
import json
import os
import resource
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

import torch

from benchmarks.suite.cases import CASE_BY_NAME, Case, case_problem, problem_config
from benchmarks.suite.ceilings import CEILINGS
from benchmarks.suite.impls import build_impl, close_quietly

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE_TAG = "KT_SUITE_PROBE "  # prefixes the child's one JSON line on stdout


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


def _warm_up(pairs, args) -> None:
    """Build and step every (mode, impl) once on the tiny shape: one-time costs (shared-library
    code paged in, autograd engine and thread-pool start-up, allocator caches) must not be
    charged to whichever pair happens to be measured first. Failures are reported by the
    measurement itself."""
    cfg = problem_config(CASE_BY_NAME["tiny"], args)
    prob = case_problem(cfg)
    for mode, name in dict.fromkeys(map(tuple, pairs)):
        impl = None
        try:
            impl = build_impl(name, mode, prob, cfg)
            impl.reset()
            impl.step()
        except Exception:
            pass
        finally:
            if impl is not None:
                close_quietly(impl)


def _measure_pair(mode: str, name: str, prob, cfg) -> dict:
    """state_mib and step_mib of one (mode, impl) (see the package docstring), or error."""
    entry = {"mode": mode, "impl": name}
    t0 = time.perf_counter()
    impl = y = None
    try:
        gc.collect()
        anon0 = _status_kib("RssAnon")
        impl = build_impl(name, mode, prob, cfg)
        impl.reset()
        # Untimed warm-up (lazy initialisation, persistent buffers): three calls, after which
        # kt.moe has packed weights that stay unchanged (counted as its state).
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
            close_quietly(impl)
        impl = None
        gc.collect()
    entry["seconds"] = time.perf_counter() - t0
    return entry


def probe_main(spec: dict) -> None:
    """Child (``--_probe SPEC``): measure the (mode, impl) pairs of one case and print the
    result as one JSON line after PROBE_TAG."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    args = SimpleNamespace(rank=spec["rank"], lora_alpha=spec["lora_alpha"],
                           lora_scale=spec["lora_alpha"] / spec["rank"], seed=spec["seed"])
    t0 = time.perf_counter()
    _warm_up(spec["pairs"], args)
    cfg = problem_config(CASE_BY_NAME[spec["case"]], args)
    prob = case_problem(cfg)
    gc.collect()
    result = {"hwm_reset": _reset_hwm(), "base_rss_mib": _status_kib("VmRSS") / 1024,
              "setup_s": time.perf_counter() - t0,
              "pairs": [_measure_pair(mode, name, prob, cfg) for mode, name in spec["pairs"]]}
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(PROBE_TAG + json.dumps(result), flush=True)


def run_probe(spec: dict) -> dict:
    """Run probe_main(spec) in a fresh ``-m benchmarks.suite --_probe`` subprocess."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "benchmarks.suite", "--_probe", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"probe exited {proc.returncode}: {tail[0][:200]}"}


def measure_memory(case: Case, rows: List[dict], args, notes: List[str]) -> None:
    """Fill ``state_mib`` / ``step_mib`` of the ok rows of one case (not the ceilings) from
    one subprocess per case (``--memory case``) or per row (``impl``); failures go to notes."""
    pairs = [(r["mode"], r["impl"]) for r in rows
             if r["status"] == "ok" and r["impl"] not in CEILINGS]
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
    total += 2 * W  # mm-ceiling-fp32: float32 copies of the fused gate|up and down weights
    grads = W if mode == "full" else 0
    for name in impls:
        if name == "kt.moe-fp32":  # float32 copies of the weights; activations, grads 2x
            total += 2 * W + 2 * (grads + act)
            continue
        total += grads + act
        if name == "hf-loop":
            total += W
        if name == "kt-kernel":
            total += 4 * W  # its packed weight copies: ~3.6 W measured (0.7.2, case mid)
        if name in ("kt-kernel-fp8", "kt-kernel-int8"):
            total += 2 * W  # its packed 8-bit copies (half of bf16's bytes; not measured)
        if name == "kt-kernel-int4":
            total += W  # its packed int4 copies (a quarter of bf16's bytes; not measured)
    return total / 2 ** 30
