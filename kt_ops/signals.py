"""SIGTERM handled as Ctrl-C is: ``kill``, a scheduler's stop or a container's shutdown send it, and
Python's default for it ends the process without running ``finally`` blocks or ``except``
clauses, so a long job stopped that way leaves its temporary files behind."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigterm_raises_system_exit():
    """Inside the block, SIGTERM raises ``SystemExit(143)`` (128 + SIGTERM, the shell's status for
    it) in the main thread, so cleanup runs as after Ctrl-C and the process then exits with that
    status. Outside the main thread (where handlers cannot be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
