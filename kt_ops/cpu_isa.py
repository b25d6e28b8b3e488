"""Which instruction set kt_ops' hand-written CPU kernels use.

The kernels (fused SwiGLU passes, the thin LoRA GEMMs) exist for AVX512-BF16, AVX-512,
AVX2 and portable C++; the best path the CPU supports is picked at import. The environment
variable ``KT_OPS_CPU_ISA`` (``auto``, ``portable``, ``avx2``, ``avx512``, ``avx512_bf16``)
forces one at import; :func:`set_cpu_isa` / :func:`use_cpu_isa` change it at run time.
Asking for a path the CPU cannot run raises instead of dying with an illegal instruction.
"""
import contextlib
from typing import Iterator

import torch

ISAS = ("portable", "avx2", "avx512", "avx512_bf16")


def cpu_isa() -> str:
    """The path the kernels use now."""
    return torch.ops.kt._cpu_isa()


def best_cpu_isa() -> str:
    """The best path this CPU supports."""
    return torch.ops.kt._best_cpu_isa()


def supported_cpu_isas() -> tuple:
    """Every path this CPU can run, slowest first."""
    return ISAS[: ISAS.index(best_cpu_isa()) + 1]


def set_cpu_isa(isa: str) -> None:
    """Use ``isa`` (one of ``ISAS`` or ``"auto"``) from now on, in every thread."""
    torch.ops.kt._set_cpu_isa(isa)


@contextlib.contextmanager
def use_cpu_isa(isa: str) -> Iterator[None]:
    """``with use_cpu_isa("avx2"): ...`` runs the block on that path, then restores the old one."""
    old = cpu_isa()
    set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(old)


cpu_isa()  # a bad KT_OPS_CPU_ISA raises here, at import, not at the first kernel call
