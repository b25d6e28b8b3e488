"""Runs a function on N local processes joined by a gloo process group on 127.0.0.1.

Every run is bounded by a timeout: a hang becomes a test failure (all processes are
killed), never a stalled CI. Results and exceptions come back to the caller; an exception
on a rank is returned as a RankError (so tests can assert that *every* rank raised).
"""
from __future__ import annotations

import datetime
import io
import os
import socket
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp


@dataclass
class RankError:
    type_name: str
    message: str
    traceback: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, release, pg_timeout_s, dump_after_s):
    import faulthandler
    import sys

    # If this rank hangs, print where before the parent kills it.
    faulthandler.dump_traceback_later(dump_after_s, exit=False, file=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        # As bytes: tensors put on the queue directly would be shared through file
        # descriptors that die with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001  (report everything to the parent)
        queue.put((rank, "error", RankError(type(error).__name__, str(error), traceback.format_exc())))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before exiting
        # Stay until every rank has reported: rank 0 hosts the c10d store that the others
        # may still be polling for failures.
        faulthandler.cancel_dump_traceback_later()
        release.wait(timeout=dump_after_s)
        # A rank whose peer failed may still have pending work: do not wait for it.
        os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, pg_timeout_s: float = 60.0):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the list of
    results by rank (a RankError where that rank raised). Raises AssertionError naming the
    ranks that did not finish within ``timeout_s``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    release = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, release, pg_timeout_s, max(timeout_s - 3, 1)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    import queue as queue_module
    import time
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s (hang?); "
                                     f"finished: { {r: results[r] for r in results} }")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        raise AssertionError(f"ranks {dead} died without reporting (exit codes "
                                             f"{[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                import torch
                value = torch.load(io.BytesIO(value), weights_only=False)
            results[rank] = value
    finally:
        release.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def check_all_ok(results):
    """Raises with every failing rank's traceback if any rank raised."""
    errors = {r: v for r, v in enumerate(results) if isinstance(v, RankError)}
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e.traceback}" for r, e in errors.items()))
    return results
