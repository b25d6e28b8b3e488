"""The benchmark scripts still run end to end and agree with kt.moe (a smoke run on a tiny
shape; no timing is asserted)."""
import json
import os
import subprocess
import sys

import pytest

from kt_ops.cpu_isa import supported_cpu_isas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_suite_smoke_run_reports_every_mode_with_small_errors(tmp_path):
    out = tmp_path / "suite.json"
    subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--cases", "tiny-t1", "--repeats", "1",
                    "--warmup", "0", "--memory", "off",
                    "--impls", "kt.moe,kt.moe-fp32,kt.moe-fp8,kt.moe-int8,kt.moe-int4,sorted-mm",
                    "--json", str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["finished"]
    rows = {(r["mode"], r["impl"]): r for r in report["rows"]}
    for mode in ("fwd", "lora", "full"):
        # kt.moe-fp32 is compared with the same bf16 reference: the error is the reference's rounding
        for impl in ("kt.moe", "kt.moe-fp32"):
            r = rows[(mode, impl)]
            assert r["status"] == "ok" and r["tok_s"] > 0, r
            assert r["out_err"] < 1e-2, r
            assert mode == "fwd" or r["grad_err"] < 1e-2, r
        assert rows[(mode, "mm-ceiling-fp32")]["status"] == "ok", rows[(mode, "mm-ceiling-fp32")]
        # the bf16 ceiling only where bf16 GEMMs are oneDNN's (see ceilings.timed_ceilings)
        native = report["meta"]["base_gemm_path"] == "onednn_bf16"
        assert ((mode, "mm-ceiling") in rows) == native
        # quantized experts: the error is the weights' quantization (int4 in groups of 32 the most)
        for impl, max_err in (("kt.moe-fp8", 0.1), ("kt.moe-int8", 0.05), ("kt.moe-int4", 0.3)):
            r = rows[(mode, impl)]
            if mode == "full":
                assert r["status"].startswith("n/a: quantized experts are frozen"), r
            else:
                assert r["status"] == "ok" and r["tok_s"] > 0 and r["out_err"] < max_err, r
    assert {(q["mode"], q["impl"]) for q in report["quantized"]} == {
        (m, f"kt.moe-{f}") for m in ("fwd", "lora") for f in ("fp8", "int8", "int4")}
    assert all(q["x_bf16"] > 0 for q in report["quantized"])
    for s in report["summary"]:
        assert s["vs_kt.moe-fp32"] > 0 and s["pct_ceiling_fp32"] > 0 and s["ceiling_fp32"] > 0, s
    meta = report["meta"]
    assert meta["cpu_isa"] in ("portable", "avx2", "avx512", "avx512_bf16"), meta
    assert meta["base_gemm_path"] in ("onednn_bf16", "bf16_to_fp32_panels"), meta
    assert set(meta["env"]) == {"KT_OPS_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"}, meta


def test_thread_scaling_runs_every_mode():
    from benchmarks import thread_scaling
    rows = thread_scaling.main(["--tokens", "16", "--hidden", "64", "--intermediate", "32", "--experts", "4",
                                "--topk", "2", "--rank", "2", "--repeats", "1"])
    assert [r[0] for r in rows] == ["fwd", "lora", "full", "mm", "peak"]
    assert all(one > 0 and many > 0 for _, one, many in rows)


def test_gemv_rows_runs_every_row_count():
    from benchmarks import gemv_rows
    rows = gemv_rows.main(["--hidden", "64", "--intermediate", "32", "--experts", "4", "--rows", "1,3",
                           "--repeats", "1"])
    assert [r[0] for r in rows] == [1, 3]
    assert all(t > 0 for row in rows for t in row[1:]) and all(len(row) == 5 for row in rows)


def test_buffer_reuse_runs_every_mode():
    from benchmarks import buffer_reuse
    rows = buffer_reuse.main(["--tokens", "16", "--hidden", "64", "--intermediate", "32", "--experts", "4",
                              "--topk", "2", "--rank", "2", "--repeats", "1"])
    assert [r[0] for r in rows] == ["full", "lora"]
    assert all(reused > 0 and fresh > 0 for _, reused, fresh in rows)


def test_quant_gemv_times_every_format_from_memory_and_cache():
    from benchmarks import quant_gemv
    rows = quant_gemv.main(["--hidden", "128", "--intermediate", "32", "--experts", "3", "--repeats", "1"])
    assert [r["kernel"] for r in rows] == ["bf16", "fp8", "int8", "int4"]
    assert all(float(r[k]) > 0 for r in rows for k in ("memory_ms", "cache_ms", "memory_gw", "cache_gw"))


def test_quant_gemv_nn_times_panels_and_thin_per_format():
    from benchmarks import quant_gemv
    rows = quant_gemv.main(["--hidden", "128", "--intermediate", "32", "--experts", "3", "--repeats", "1", "--nn",
                            "--rows", "2"])
    assert [r["kernel"] for r in rows] == [f"{f} {k}" for f in ("bf16", "fp8", "int8", "int4") for k in ("panels", "thin")]
    assert all(float(r[k]) > 0 for r in rows for k in ("memory_ms", "cache_ms", "memory_gw", "cache_gw"))


def test_width_generic_kernels_times_every_path_it_can_run():
    from benchmarks import width_generic_kernels
    from kt_ops.cpu_isa import supported_cpu_isas

    rows = width_generic_kernels.main(["--hidden", "128", "--intermediate", "32", "--experts", "2", "--rows", "5",
                                       "--repeats", "1"])
    paths = [isa for isa in ("avx2", "avx512", "avx512_bf16") if isa in supported_cpu_isas()]
    gemv_paths = [isa for isa in paths if isa != "avx512_bf16"]
    assert [r["path"] for r in rows if r["kernel"].startswith("int4")] == gemv_paths * 8
    assert [r["path"] for r in rows if r["kernel"].startswith("swiglu")] == [isa for _ in range(2) for isa in paths
                                                                              for _ in range(2)]
    assert all(r["ms"] > 0 for r in rows)


def test_suite_fp8_reference_leaves_out_the_quantization(tmp_path):
    """--reference kt.moe-fp8-fp32: kt.moe-fp8's errors are its bf16 rounding alone (well under
    the 4e-2 of the weights' fp8 quantization); kt-kernel-fp8 runs where kt-kernel is installed,
    else its row says why not."""
    out = tmp_path / "suite.json"
    subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--cases", "tiny-t1", "--repeats", "1",
                    "--warmup", "0", "--memory", "off", "--modes", "fwd,lora", "--reference", "kt.moe-fp8-fp32",
                    "--impls", "kt.moe,kt.moe-fp8,kt-kernel-fp8", "--json", str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["impl"]): r for r in report["rows"]}
    for mode in ("fwd", "lora"):
        r = rows[(mode, "kt.moe-fp8")]
        assert r["status"] == "ok" and r["out_err"] < 1e-2 and (mode == "fwd" or r["grad_err"] < 1e-2), r
        assert rows[(mode, "kt.moe")]["out_err"] > 1e-2  # bf16 weights: the quantization shows
    kk = rows[("lora", "kt-kernel-fp8")]
    assert kk["status"].startswith("n/a") or (kk["status"] == "ok" and kk["out_err"] < 2e-2), kk
    assert rows[("fwd", "kt-kernel-fp8")]["status"].startswith("n/a"), rows[("fwd", "kt-kernel-fp8")]


def test_suite_int4_reference_and_kt_kernel_integer_formats(tmp_path):
    """--reference kt.moe-int4-fp32: kt.moe-int4's errors are its bf16 rounding alone (the
    weights' int4 quantization, ~1e-1, left out); kt-kernel-int4 (RAWINT4 on the same bytes)
    and kt-kernel-int8 (its own quantization of the bf16 weights) run in lora mode where
    kt-kernel is installed, else their rows say why not; fwd mode is n/a for both."""
    out = tmp_path / "suite.json"
    subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--cases", "tiny-t1", "--repeats", "1",
                    "--warmup", "0", "--memory", "off", "--modes", "fwd,lora", "--reference", "kt.moe-int4-fp32",
                    "--impls", "kt.moe,kt.moe-int4,kt-kernel-int4,kt-kernel-int8", "--json", str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    rows = {(r["mode"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    for mode in ("fwd", "lora"):
        r = rows[(mode, "kt.moe-int4")]
        assert r["status"] == "ok" and r["out_err"] < 1e-2 and (mode == "fwd" or r["grad_err"] < 1e-2), r
        assert rows[(mode, "kt.moe")]["out_err"] > 3e-2  # bf16 weights: the quantization shows
        for kk in ("kt-kernel-int4", "kt-kernel-int8"):
            assert mode == "lora" or rows[(mode, kk)]["status"].startswith("n/a"), rows[(mode, kk)]
    kk = rows[("lora", "kt-kernel-int4")]  # the same int4 bytes: its own (activation) rounding
    assert kk["status"].startswith("n/a") or (kk["status"] == "ok" and kk["out_err"] < 3e-2
                                               and kk["grad_err"] < 5e-2), kk
    kk = rows[("lora", "kt-kernel-int8")]  # other weights (int8 of the bf16 ones): int4's error
    assert kk["status"].startswith("n/a") or (kk["status"] == "ok" and kk["grad_err"] < 0.5), kk


def test_decode_formats_times_every_format():
    out = subprocess.run([sys.executable, "-m", "benchmarks.decode_formats", "--tokens", "1", "3", "--experts", "8",
                          "--hidden", "256", "--intermediate", "128", "--top-k", "2", "--rounds", "1"],
                         cwd=REPO, check=True, timeout=300, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("T=")]
    assert len(lines) == 2 and all(f" {fmt} " in f" {line}" for line in lines for fmt in ("bf16", "fp8", "int8", "int4"))


@pytest.mark.skipif("avx2" not in supported_cpu_isas(), reason="this CPU cannot run avx2")
def test_decode_formats_alternates_paths():
    """--isas times every (path, format) pair in the same rounds: one line per path and T."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.decode_formats", "--tokens", "2", "--experts", "8",
                          "--hidden", "256", "--intermediate", "128", "--top-k", "2", "--rounds", "1",
                          "--isas", "portable", "avx2"],
                         cwd=REPO, check=True, timeout=300, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("T=")]
    assert len(lines) == 2 and "  portable  " in lines[0] and "  avx2  " in lines[1]


def test_sharded_layer_times_both_placements_and_counts_the_bytes():
    """benchmarks/sharded_layer.py on a small layer: both placements run on 2 ranks, the layer
    alone in one process, its kt.moe call alone; each rank's store queries stay few (a counter); the bytes
    per token are the all-to-all's own (one owner: rank 1's half of the tokens, each way; two
    shards: more, every token reaching up to two owners)."""
    from benchmarks import sharded_layer

    H, K, T = 128, 2, 32
    rows = sharded_layer.main(["--tokens", str(T), "--hidden", str(H), "--intermediate", "64", "--experts", "8",
                               "--top-k", str(K), "--lora-rank", "4", "--dtypes", "fp32", "--steps", "1",
                               "--repeats", "1"])
    assert [r["config"] for r in rows] == list(sharded_layer.CONFIGS)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    one_owner = rows[0]["bytes_per_token"]
    # rank 1's T/2 tokens: x + ids (int64) + weights (fp32) there, out back; x's and weights' grads the same way
    per_token = (H * 4 + K * 8 + K * 4) + H * 4 + H * 4 + (H * 4 + K * 4)
    assert one_owner == per_token * (T // 2) / T
    assert rows[1]["bytes_per_token"] > 0
    assert rows[2]["bytes_per_token"] == rows[3]["bytes_per_token"] == 0  # alone: one process, no all-to-all
    assert rows[3]["op_ratio"] == 1.0 and rows[2]["ratio"] == 1.0
    assert len(rows[0]["cpu_share"]) == 2 and len(rows[2]["cpu_share"]) == len(rows[3]["cpu_share"]) == 1
    assert all(0 < share for r in rows for share in r["cpu_share"])
    assert all(q <= 10 for r in rows for q in r["queries_per_s"]), rows


def test_trl_sft_benchmark_times_both_modes():
    """benchmarks/trl_sft.py, one short run per mode: both train and report tokens/s; packing
    trains on more tokens per step than padding at the same batch size."""
    from benchmarks import trl_sft

    rows = trl_sft.main(["--steps", "3", "--repeats", "1", "--batch-size", "4", "--max-length", "256"])
    assert [r["config"] for r in rows] == list(trl_sft.CONFIGS)
    assert all(r["median"] > 0 for r in rows)
    assert rows[1]["tokens_per_step"] > rows[0]["tokens_per_step"]


def test_generate_decode_compares_both_models_with_and_without_adapter():
    """benchmarks/generate_decode.py --smoke: kt and transformers both decode, in every dtype,
    with and without the adapter, and (fp32) produce the same tokens."""
    from benchmarks import generate_decode

    rows = generate_decode.main(["--smoke"])
    assert [(r["dtype"], r["adapter"]) for r in rows] == [(d, a) for d in ("bf16", "fp32") for a in ("no", "yes")]
    assert all(r["transformers"] > 0 and r["kt"] > 0 for r in rows)
    assert all(r["same_tokens"] for r in rows if r["dtype"] == "fp32")


def test_merge_throughput_times_bf16_and_fp8_bases():
    """benchmarks/merge_throughput.py --smoke: each case merges (attention and experts of every
    layer) in a fresh process whose peak memory it reads."""
    from benchmarks import merge_throughput

    rows = merge_throughput.main(["--smoke"])
    assert [(r["base"], r["output"]) for r in rows] == [("bf16", "same"), ("fp8", "same"), ("fp8", "bf16")]
    layers, per_layer = merge_throughput.SMOKE["num_hidden_layers"], 4 + 3 * merge_throughput.SMOKE["num_experts"]
    assert rows[0]["merged"] == layers * per_layer  # q/k/v/o and each expert's gate, up, down
    assert rows[1]["merged"] == 2 * layers * per_layer  # FP8: each value tensor and its scales
    assert all(r["peak"] > 0 and r["seconds"][0] > 0 for r in rows)


def test_isa_peak_op_measures_every_path_here_and_refuses_the_others():
    """torch.ops.kt._isa_peak_flops: one positive rate per intra-op thread on each path this CPU
    runs; the portable path (no instruction of its own), a path the CPU lacks and an unknown name
    are refused by name."""
    import torch

    from kt_ops.cpu_isa import ISAS

    for isa in supported_cpu_isas()[1:]:
        rates = torch.ops.kt._isa_peak_flops(isa, 100_000)
        assert len(rates) == torch.get_num_threads() and all(r > 0 for r in rates), (isa, rates)
    with pytest.raises(RuntimeError, match="portable path"):
        torch.ops.kt._isa_peak_flops("portable", 10)
    for isa in ISAS[len(supported_cpu_isas()):]:
        with pytest.raises(RuntimeError, match=isa):
            torch.ops.kt._isa_peak_flops(isa, 10)
    with pytest.raises(Exception, match="isa"):
        torch.ops.kt._isa_peak_flops("avx3", 10)


def test_isa_peak_fraction_reports_every_path_and_mode():
    """benchmarks/isa_peak_fraction.py on the tiny case: a row per path and mode, its GFLOP/s the
    mode's FLOPs over the step time, and the fraction of that path's measured peak."""
    from benchmarks import isa_peak_fraction

    rows = isa_peak_fraction.main(["--cases", "tiny", "--repeats", "1", "--warmup", "0"])
    paths = [i for i in supported_cpu_isas() if i != "portable"]
    assert [(r["mode"], r["isa"]) for r in rows] == [(m, i) for m in ("fwd", "lora", "full") for i in paths]
    for r in rows:
        assert r["gflops"] > 0 and r["peak"] > 0 and r["fraction"] == pytest.approx(r["gflops"] / r["peak"])


def test_linear_bf16_times_every_implementation_and_pass():
    """benchmarks/linear_bf16.py on a small weight: a row per row count and implementation, a time
    for each pass except the ones skipped."""
    from benchmarks import linear_bf16

    rows = linear_bf16.main(["--in-features", "64", "--out-features", "48", "--rows", "1,40", "--repeats", "1",
                             "--skip", "torch bf16:input grad"])
    assert [(r["rows"], r["impl"]) for r in rows] == [(n, i) for n in (1, 40)
                                                      for i in ("torch bf16", "kt.linear bf16", "torch fp32")]
    for r in rows:
        for pas in linear_bf16.PASSES:
            assert (r[pas] is None) == (r["impl"] == "torch bf16" and pas == "input grad"), r
