"""Failure propagation between the ranks of a KT MoE job.

Only the owner rank computes the experts. If it fails there (an exception in kt.moe's
forward or backward), the other ranks are already waiting for its rows inside a kt
collective and would wait forever. So:

* every kt kernel that fails while a process group is registered here writes its rank and
  message to the group's store (:func:`report_failure`, called by the kernels' wrappers);
* every kt collective blocks on its work (no spinning: the waiting thread sleeps on the work's
  completion) and, once a second while it has not completed, asks the store
  (:func:`wait_for`); when another rank has reported, it raises ``RemoteRankFailure``
  (a ``RuntimeError``) carrying that rank's message. A rank that fails under
  :func:`fail_fast` also aborts its process groups, which completes the others' works with an
  error at once; the store check covers failures without that abort.

The store lives in one rank's process (rank 0, often the expert owner), so every query is
work for that process: a rank asks it at most once per ``CHECK_INTERVAL_S`` (:func:`store_queries`
counts what this process asked).

After a failure the group is poisoned: later kt collectives on it raise at once, since
the ranks are no longer in step.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

import torch.distributed as dist

_KEY_PREFIX = "kt_ops/faults"
CHECK_INTERVAL_S = 1.0  # the most often a rank asks the store whether another rank failed


class RemoteRankFailure(RuntimeError):
    """Raised on every rank when a rank of the group failed inside a kt op."""


class _Channel:
    def __init__(self, group_name: str, store, rank: int, world_size: int):
        self.group_name = group_name
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.failure: Optional[str] = None  # set once a failure is seen: the group is poisoned
        self.reported_here = False  # this rank reported a failure of its own
        self.queries = 0  # store round trips made by this channel (benchmarks read it)
        self._last_check = float("-inf")  # time.monotonic() of the last "count" query

    def key(self, what: str) -> str:
        return f"{_KEY_PREFIX}/{self.group_name}/{what}"

    def report(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = f"rank {self.rank} failed: {message}"
        self.reported_here = True
        try:
            self.store.set(self.key(f"message/{self.rank}"), message)
            self.store.add(self.key("count"), 1)
        except Exception:  # the store itself is gone: nothing more can be told
            pass

    def remote_failure(self) -> Optional[str]:
        """Message of the first rank (by rank order) that reported, or None. Asks the store
        at most once per CHECK_INTERVAL_S (None in between, unless a failure is known)."""
        if self.failure is not None:
            return self.failure
        now = time.monotonic()
        if now - self._last_check < CHECK_INTERVAL_S:
            return None
        self._last_check = now
        try:
            self.queries += 1
            reported = self.store.add(self.key("count"), 0)
        except Exception as error:  # the store's host (usually rank 0) is gone
            self.failure = f"the job's store is unreachable, a rank probably died ({error})"
            return self.failure
        if reported == 0:
            return None
        self.failure = self._messages(range(self.world_size)) or "another rank failed"
        return self.failure

    def failure_of_others(self) -> Optional[str]:
        """What the other ranks reported (read from the store now), or None."""
        try:
            self.queries += 1
            if self.store.add(self.key("count"), 0) == 0:
                return None
            return self._messages(r for r in range(self.world_size) if r != self.rank) or None
        except Exception:  # noqa: BLE001  the store is gone with its host: nothing to read
            return None

    def _messages(self, ranks) -> str:
        """The messages these ranks reported, in rank order, joined ("" when none did)."""
        found = []
        for r in ranks:
            key = self.key(f"message/{r}")
            self.queries += 1
            if self.store.check([key]):
                found.append(f"rank {r} failed: {self.store.get(key).decode(errors='replace')}")
        return "; ".join(found)


_channels: dict[str, _Channel] = {}
_lock = threading.Lock()


def register_group(group: dist.ProcessGroup) -> None:
    """Watch `group` for failures of kt ops (idempotent). Called by the kt collectives."""
    name = group.group_name
    with _lock:
        if name not in _channels:
            store = dist.distributed_c10d._get_default_store()
            _channels[name] = _Channel(name, store, group.rank(), group.size())


def _channel(group: dist.ProcessGroup) -> _Channel:
    register_group(group)
    return _channels[group.group_name]


def report_failure(error: BaseException) -> None:
    """Tell every registered group that this rank failed with `error`."""
    message = f"{type(error).__name__}: {error}"
    with _lock:
        channels = list(_channels.values())
    for channel in channels:
        channel.report(message)


def check_group(group: dist.ProcessGroup) -> None:
    """Raise RemoteRankFailure if any rank of `group` has failed in a kt op."""
    failure = _channel(group).remote_failure()
    if failure is not None:
        raise RemoteRankFailure(f"kt_ops: {failure}")


def wait_for(works, group: dist.ProcessGroup) -> None:
    """Wait for async c10d works, raising RemoteRankFailure if a rank reports a failure.

    On gloo the thread sleeps on each work's future (woken when it completes or fails) for
    CHECK_INTERVAL_S at a time and asks the store between those sleeps: a waiting rank costs
    no CPU and at most one store query a second. Works that cannot be watched from the host
    (NCCL's complete on the GPU stream) are waited for normally: their collectives are
    enqueued, not blocking.
    """
    pending = [w for w in works if w is not None]
    if group.size() > 1 and dist.get_backend(group) == "gloo":
        start, cpu_start = time.perf_counter(), time.process_time()
        for work in pending:
            try:
                future = work.get_future()
            except RuntimeError:  # a work without a future: its completion polled, 20 times a second
                while not work.is_completed():
                    check_group(group)  # asks the store at most once per CHECK_INTERVAL_S
                    time.sleep(0.05)
                continue
            finished = threading.Event()
            future.then(lambda _future: finished.set())  # runs on success and on error
            while not finished.wait(CHECK_INTERVAL_S):
                check_group(group)
        _waited[0] += time.perf_counter() - start
        _waited[1] += time.process_time() - cpu_start
    for w in pending:
        w.wait()  # surfaces the work's own error, if any


_waited = [0.0, 0.0]  # wall seconds this process spent in wait_for, and its CPU seconds meanwhile


def waiting_time() -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) spent waiting in kt collectives on gloo:
    the CPU share of a waiting rank, gloo's own transfer threads included (for benchmarks)."""
    return _waited[0], _waited[1]


def store_queries() -> int:
    """Store round trips this process's failure channels have made (for benchmarks)."""
    with _lock:
        return sum(channel.queries for channel in _channels.values())


# ---- fault injection, for tests of the failure paths ---------------------------------------
_injected: dict[str, str] = {}


def inject_failure(where: str, message: str = "injected failure") -> None:
    """Make the next kt kernel call at `where` ("moe_forward" or "moe_backward") on this
    process raise RuntimeError(message). For testing the failure paths."""
    if where not in ("moe_forward", "moe_backward"):
        raise ValueError(f"inject_failure: where must be 'moe_forward' or 'moe_backward', got {where!r}")
    _injected[where] = message


def maybe_inject(where: str) -> None:
    message = _injected.pop(where, None)
    if message is not None:
        raise RuntimeError(message)


# ---- the whole job: a failure on one rank ends every rank ---------------------------------
def _world_channel() -> Optional[_Channel]:
    """The failure channel of the default process group, or None without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        return _channel(dist.group.WORLD)
    except Exception:  # noqa: BLE001  no store to report through (a rank died with it)
        return None


@contextlib.contextmanager
def fail_fast():
    """Make an exception on this rank end the job on every rank within seconds.

    On an exception inside the block (from any code: kt ops, the Trainer, data loading), this
    rank reports it through the job's store (so kt collectives on the other ranks raise
    :class:`RemoteRankFailure` with its message at their next poll), then aborts its process
    groups: a rank blocked in any other collective with it (DDP's all-reduce, the Trainer's
    all-gather) gets "connection closed" at once instead of waiting out the group's timeout.
    The exception is then re-raised. If another rank had reported a failure first, and this
    rank's own error is only its consequence, the error raised is a ``RemoteRankFailure``
    carrying that rank's message (the original error chained to it).

    Cleanup code after a failure must not enter a collective (a barrier would wait for ranks
    still training). Does nothing in a single process.
    """
    try:
        yield
    except BaseException as error:
        channel = _world_channel()
        if channel is None:
            raise
        # The origin (a kt op here already reported, or a RemoteRankFailure names it), or a
        # consequence of what another rank reported, or this rank's own failure to report.
        origin_known = isinstance(error, RemoteRankFailure) or channel.reported_here
        remote = None if origin_known else channel.failure_of_others()
        if remote is not None and f"{type(error).__name__}: {error}" in remote:
            remote = None  # the same error on both ranks (a check every rank makes): this rank's own
        if remote is None and not origin_known:
            report_failure(error)  # to every registered group, the default one's channel included
        try:
            dist.distributed_c10d._abort_process_group()  # every group, the default one included
        except Exception:  # noqa: BLE001  already gone: nothing left to release
            pass
        if remote is not None:
            raise RemoteRankFailure(f"kt_ops: {remote}") from error
        raise
