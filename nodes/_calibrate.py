"""Thread counts from this machine, not from the one a recipe was tuned on (``threads: auto``).

A stage whose threads are ``auto`` (stt=whisper's ``cpu_threads``, tts=piper's ``threads``) times a
short piece of its own work at each count its budget allows when its model loads, once per process,
and keeps the fewest threads within ``CLOSE`` of the fastest: extra threads that buy little take a
core from the stages running beside it. The budget is half the cores (at least one): the LLM server
and the other stage share the machine (on 2 cores, 1 thread was measured best in the engine although
2 were faster alone: STT 127 -> 75 ms p50 in a bench=latency sweep). What was chosen, and the times
behind it, go to the run's trace as a ``calibration`` event of each session, so metrics.json, the
run's table and a sweep's rows show the settings each figure was measured with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from s2s_flow.errors import ConfigError

__all__ = ["AUTO", "budget", "calibrate", "cores", "check_threads"]

AUTO = "auto"
CLOSE = 0.10  # a count within 10 % of the fastest is as good: the fewest such is kept
TRIALS = 2  # timed runs per count (after one untimed), the fastest counts


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def budget(n_cores: int | None = None) -> list[int]:
    """The thread counts a stage may use on ``n_cores``: 1, 2, 4 ... up to half of them."""
    top = max(1, (n_cores or cores()) // 2)
    return [n for n in (1, 2, 4, 8, 16) if n <= top] or [1]


def check_threads(value: Any, option: str, what: str) -> None:
    """``auto`` or a whole number >= 0 (0: the library's own default)."""
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{option}={value!r} must be a whole number >= 0 ({what}; 0: the library's default) "
                          f"or {AUTO} (timed on this machine when the model loads)")


def calibrate(candidates: list[int], build: Callable[[int], Any], work: Callable[[Any], None]) -> tuple[Any, dict]:
    """The built thing for the fewest threads within ``CLOSE`` of the fastest, and the record of it:
    ``{"threads": n, "ms": {count: fastest ms}, "cores": c}``. ``build(n)`` makes it with n threads,
    ``work(it)`` is the piece of work timed."""
    built: dict[int, Any] = {}
    ms: dict[int, float] = {}
    for n in candidates:
        built[n] = build(n)
        if len(candidates) == 1:
            break
        work(built[n])  # untimed: first-run allocations
        times = []
        for _ in range(TRIALS):
            start = time.perf_counter()
            work(built[n])
            times.append(1000 * (time.perf_counter() - start))
        ms[n] = round(min(times), 1)
    best = min(ms.values()) if ms else 0.0
    chosen = next((n for n in candidates if n in ms and ms[n] <= best * (1 + CLOSE)), candidates[0])
    for n in list(built):
        if n != chosen:
            del built[n]  # freed now, not with the run
    return built[chosen], {"threads": chosen, "ms": {str(n): t for n, t in ms.items()}, "cores": cores()}
