"""How fast one client's events are read: a token bucket per connection (``io.max_events_per_s``).

A client that sends faster (1,000 tiny events a second) is read at the limit: uvicorn reads the next
frame only when the server asks for it, so the rest waits in the client's socket (TCP pushes back)
and costs the server nothing; the client is told once per burst with a ``rate_limited`` error event,
and its session goes on. A file streamed faster than real time is slowed, never cut.
"""

from __future__ import annotations

import time

__all__ = ["EventRate"]


class EventRate:
    """``rate`` events a second on average, ``burst`` at once (2 s worth by default)."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else 2 * rate)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.limited = False  # within a burst that was told

    def delay(self) -> float:
        """Take one event's token: seconds to wait before handling it (0 when within the rate)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= 1.0
        if self.tokens >= 0:
            if self.tokens >= self.burst / 2:
                self.limited = False
            return 0.0
        return -self.tokens / self.rate
