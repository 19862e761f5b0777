"""How fast one client's events are read: a token bucket per connection (``io.max_events_per_s``).

A client that sends faster is read at the limit: uvicorn reads the next frame only when the server
asks for it, so the rest waits in the client's socket (TCP pushes back) and costs the server
nothing. It is told once (a ``rate_limited`` error event) and its session goes on, so a file
streamed faster than real time is slowed, not cut; a client still over the limit after
``GRACE_S`` (1,000 tiny events a second) is closed with 1008: its backlog would hold a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from nodes.io.realtime import protocol as events

__all__ = ["EventRate", "GRACE_S", "trim_memory_soon"]

GRACE_S = 10.0  # seconds a client may stay over the rate before it is closed


class EventRate:
    """``rate`` events a second on average, ``burst`` at once (2 s worth by default)."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else 2 * rate)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.limited_since: float | None = None  # over the rate since (not recovered to half a burst)

    def delay(self) -> float:
        """Take one event's token: seconds to wait before handling it (0 when within the rate)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= self.burst / 2:
            self.limited_since = None
        self.tokens -= 1.0
        if self.tokens >= 0:
            return 0.0
        if self.limited_since is None:
            self.limited_since = now
        return -self.tokens / self.rate

    def persistent(self) -> bool:
        """Over the rate for longer than ``GRACE_S``: the client floods, it does not burst."""
        return self.limited_since is not None and time.monotonic() - self.limited_since > GRACE_S

    async def wait(self, send: Callable[[dict], None]) -> str | None:
        """Before reading the next event: wait as the rate says, telling the client (``send``, an error
        event) as it goes over; the message to close it with once it floods, else None."""
        limited = self.limited_since is not None
        wait = self.delay()
        if not wait:
            return None
        limit = f"io.max_events_per_s={self.rate:g}"
        if self.persistent():
            return (f"events kept arriving faster than {limit} for over {GRACE_S:g} s: the session was closed; "
                    "send audio in larger appends (e.g. 100 ms each)")
        if not limited:
            send(events.error("rate_limited", f"events arrive faster than {limit}: they are read at that rate "
                              "(the session goes on); send audio in larger appends", type="invalid_request_error"))
        await asyncio.sleep(wait)
        return None


_TRIM_DELAY_S = 1.0  # after the last session's end or reply's end in a row
_trim: list[asyncio.TimerHandle] = []


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: its heap's free pages back to the OS (nothing elsewhere)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _trim_off_the_loop() -> None:
    """The trim on a thread of its own (2-8 ms, not the server loop's), which ends with it: no pool
    thread stays behind for the server's life."""
    threading.Thread(target=_malloc_trim, name="malloc-trim", daemon=True).start()


def trim_memory_soon() -> None:
    """A session ended or a reply is done: the memory its buffers left free goes back to the OS a
    moment later (once after a burst), off the server's loop.

    glibc keeps freed memory in its heap for reuse: after 10 MB frames, a storm's graphs or a long
    reply's audio, the server's RSS would stay up by tens of MB (measured: benchmarks/bench_abuse.py),
    and each session open would keep what its busiest turn took (``bench_realtime.py --memory``)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _malloc_trim()
    while _trim:
        _trim.pop().cancel()
    _trim.append(loop.call_later(_TRIM_DELAY_S, _trim_off_the_loop))
