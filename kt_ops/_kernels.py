"""CPU kernels of kt.moe_forward / kt.moe_backward: the C++ kernels (kt._moe_*_cpu),
called so that a failure is reported to the other ranks of a distributed job before it
is raised here (see kt_ops/faults.py). The dispatcher's crossing into this Python wrapper
cost about 75 µs a kt.moe decode call on an Intel Xeon (``python -m benchmarks.call_overhead``,
benchmarks/RESULTS.md): moving the failure reporting into the C++ kernel would save it.

While a profiler runs, each call is a profiler range, ``kt.experts.forward`` /
``kt.experts.backward`` (beside the collectives' ``kt.gather_to_owner`` /
``kt.scatter_from_owner`` ranges), so a trace shows where a step's time goes, in eager and
compiled code alike; without a profiler there is no range (kt_ops/profiler_ranges.py says why).

``calls`` counts the executions of each kernel in this process: it is read from outside
compiled code (e.g. to check that checkpointing does not re-run the CPU experts).
"""
import collections

import torch

from kt_ops import faults
from kt_ops.profiler_ranges import profiler_range

calls: collections.Counter = collections.Counter()


def _reporting_failures(kernel, where):
    range_name = f"kt.experts.{where.removeprefix('moe_')}"

    def run(*args):
        calls[where] += 1
        try:
            faults.maybe_inject(where)
            # The kernels compute in their inputs' dtypes: CPU autocast (Trainer's bf16=True on a
            # CPU) would turn the ATen calls inside them to bf16 and break their buffers.
            with profiler_range(range_name), torch.autocast("cpu", enabled=False):
                return kernel(*args)
        except Exception as error:
            faults.report_failure(error)
            raise
    return run


torch.library.impl("kt::moe_forward", "CPU")(
    _reporting_failures(torch.ops.kt._moe_forward_cpu.default, "moe_forward"))
torch.library.impl("kt::moe_backward", "CPU")(
    _reporting_failures(torch.ops.kt._moe_backward_cpu.default, "moe_backward"))
