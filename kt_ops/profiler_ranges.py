"""Named profiler ranges (``kt.experts.forward``, ``kt.gather_to_owner``, ...) that cost nothing
when no profiler runs.

A ``torch.profiler.record_function`` range is opened and closed through two dispatched ops even
with no profiler running. On an Intel Xeon (2 cores, KVM) that cost about 0.1 ms a kt.moe call
right after the call's experts had streamed through the caches (7% of an int4 decode step,
``python -m benchmarks.call_overhead``), against 7 µs in a loop of ranges alone; so a range is
only opened while a profiler (torch.profiler, the autograd profiler, emit_nvtx / emit_itt) is on.
"""
import contextlib

import torch


def profiler_range(name: str):
    """``torch.profiler.record_function(name)`` while a profiler runs, else a no-op context."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
