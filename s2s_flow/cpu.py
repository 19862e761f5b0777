"""The process's CPU time by stage: how much of it each node's threads used.

Every node runs on a thread of its own per session (s2s_flow/scheduler.py: ``node:<name>``); when
one ends, its CPU time is added to its node's total here. :func:`by_stage` adds the node threads
still running (read from ``/proc/self/task``), the threads Python did not start (``native``: an
engine's own pool, such as CTranslate2's worker that runs Whisper) and the rest of the process
(``other``: a server's event loop, model loading, garbage collection), so the parts add up to the
process's CPU time. A server's ``/metrics`` serves it (io=realtime); ``benchmarks/bench_realtime.py
--conversations`` reports it per turn. Without ``/proc`` (not Linux) running threads are counted
once they end and ``native`` stays in ``other``.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["by_stage", "thread_ended"]

_PREFIX = "node:"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_lock = threading.Lock()
_ended: dict[str, float] = {}


def thread_ended(stage: str) -> None:
    """Called by a node's thread as it ends: its CPU time so far goes to ``stage``'s total."""
    with _lock:  # read under it: a running reading of this thread, taken while it waited, is never more
        _ended[stage] = _ended.get(stage, 0.0) + time.thread_time()
        threading.current_thread().cpu_counted = True  # type: ignore[attr-defined]


def _thread_cpu_s(tid: int) -> float | None:
    """A running thread's CPU seconds, None once it is gone: the scheduler's count in nanoseconds
    (``schedstat``, what ``time.thread_time()`` reads), else user + system time in clock ticks."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)


def by_stage() -> dict[str, float]:
    """CPU seconds since the process started: ``{node name: s, "native": s, "other": s}``."""
    # Under the lock a node thread is either counted as ended or still running: one that ends waits
    # in thread_ended() until the running ones are read (a server's sessions end many at once).
    with _lock:
        out = dict(_ended)
        python = threading.enumerate()  # before the listing: a thread that starts now is not taken for native
        for thread in python:
            if (thread.name.startswith(_PREFIX) and not getattr(thread, "cpu_counted", False)
                    and thread.native_id is not None and (spent := _thread_cpu_s(thread.native_id)) is not None):
                stage = thread.name[len(_PREFIX):]
                out[stage] = out.get(stage, 0.0) + spent
    known = {t.native_id for t in python}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    out["native"] = sum(s for t in tids if t not in known and (s := _thread_cpu_s(t)) is not None)
    out["other"] = max(0.0, time.process_time() - sum(out.values()))
    return out
