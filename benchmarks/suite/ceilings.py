"""What the machine can do, measured in the same run: the mm ceilings (a mode's base-weight
GEMMs as plain ``torch.mm``, in bf16 and in float32), their FLOPs, the memory copy bandwidth
and the cache-warm rate of a single mm."""
import time
from typing import List

import torch
import torch.nn.functional as F

from benchmarks.common import Impl

CEILING = "mm-ceiling"
CEILING_FP32 = "mm-ceiling-fp32"
CEILING_DTYPES = {CEILING: torch.bfloat16, CEILING_FP32: torch.float32}
CEILINGS = tuple(CEILING_DTYPES)


def timed_ceilings() -> tuple:
    """The ceilings timed on this path: the bf16 one only where bf16 GEMMs are oneDNN's.
    Elsewhere ATen's bf16 ``torch.mm`` is a slow fallback that kt.moe never calls (its
    ``[n,H]x[H,I]`` layout took minutes a LoRA step at the Qwen3 shape on an AVX2 Zen), so
    only the fp32 ceiling is measured and ``% ceil`` is left empty."""
    native = torch.ops.kt._base_gemm_path(torch.bfloat16) == "onednn_bf16"
    return CEILINGS if native else (CEILING_FP32,)


def build_ceiling(name: str, mode: str, prob, counts: List[int], cfg) -> Impl:
    """Ceiling ``name`` (one of CEILINGS): the mode's base-weight GEMMs at the real per-expert
    row counts ``counts``, each expert on its own weights (so that they stream from memory as
    in the MoE), in ``CEILING_DTYPES[name]`` (see the package docstring)."""
    dtype = CEILING_DTYPES[name]
    H, I = cfg.hidden, cfg.intermediate
    P = sum(counts)
    g = torch.Generator().manual_seed(cfg.seed + 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    xs, hs = rnd(P, H), rnd(P, I)
    dys = rnd(P, H) if mode != "fwd" else None
    dgus = rnd(P, 2 * I) if mode != "fwd" else None
    # bf16: views of the problem's weights; float32: copies, which `work` holds until close
    w13, w2 = prob["w13"].to(dtype).unbind(0), prob["down_proj"].to(dtype).unbind(0)
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

    impl = Impl(name, step, lambda: None, lambda: {})
    impl.close = work.clear
    return impl


def ceiling_flops(mode: str, P: int, H: int, I: int) -> float:  # noqa: E741
    """FLOPs of the ceiling's GEMMs for P pairs (2, 4 or 6 GEMMs of 3·P·H·I multiply-adds)."""
    return {"fwd": 6.0, "lora": 12.0, "full": 18.0}[mode] * P * H * I


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
    """Cache-warm rate of one ``[M,H]x[H,2I]`` mm repeated on one weight ``[2I, H]`` (in its
    dtype; best of three batches)."""
    x = torch.randn(M, w13.shape[1], dtype=w13.dtype)
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
