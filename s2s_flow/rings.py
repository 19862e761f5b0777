"""Bounded rings: the only way messages move between nodes.

Every edge of the graph is a :class:`Ring` with a capacity and an overflow policy:

- ``block``: the producer waits for room (backpressure; text and replies),
- ``drop_oldest``: the oldest item is discarded (live audio: freshest wins),
- ``drop_newest``: the new item is discarded.

All rings that feed one node share that node's :class:`Inbox` (one lock, one wake-up),
so a node sleeps until *any* of its inputs or its control lane has something, without
polling. A consumer takes everything available in one lock acquisition. Put times are kept
beside the items, not wrapped with them, so a hop allocates nothing per message.

Waking a thread costs the most on a hop, so it is done once and at the right moment. A
node that hands over a batch defers its consumers' wake-ups (``deferred``) to the moment it
blocks itself (:func:`block` releases them, then sleeps), so a batch costs its consumer one
wake-up, not one per item. A stream that hands over each item as it is made (a source, an
LLM yielding tokens) cannot wait for its next block, which may be a network read: it wakes
its consumer at once with :func:`wake_now`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

__all__ = ["POLICIES", "Ring", "RingClosed", "RingStats", "Inbox", "Waiter", "block", "wake_all", "wake_now"]

POLICIES = ("block", "drop_oldest", "drop_newest")
_now = time.monotonic


class Waiter:
    """A one-shot lock a sleeping thread waits on; ``release()`` wakes it."""

    __slots__ = ("_lock", "_released")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lock.release()


def block(waiter: Waiter, wakes: list[Any], timeout: float) -> bool:
    """Release the waiters in ``wakes`` (emptying it), then wait on ``waiter`` (``timeout`` < 0:
    for ever); True when woken."""
    for w in wakes:
        w.release()
    wakes.clear()
    woken = waiter._lock.acquire(True, -1 if timeout < 0 else timeout)
    if woken:
        waiter._lock.release()  # once woken, it stays woken
    return woken


def wake_now(wakes: list[Any]) -> None:
    """Release the waiters in ``wakes`` (emptying it) for a thread that goes on running."""
    wake_all(wakes)


_NONE: list[Any] = []  # "nothing to wake"; never appended to


class RingClosed(Exception):
    """Put on a closed ring (the consumer is gone or the graph is stopping)."""


@dataclass(frozen=True, slots=True)
class RingStats:
    name: str
    capacity: int
    policy: str
    puts: int
    drops: int
    high_water: int
    blocked_s: float


class Inbox:
    """The consumer side shared by every ring into one node, plus its control lane."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rings: list[Ring] = []
        self.open = 0  # rings not closed yet
        self.control: deque[Any] = deque()
        self._waiter: Any = None  # the Waiter the sleeping consumer blocks on, else None

    def wake(self, deferred: list[Any] | None = None) -> None:
        """Call with ``lock`` held, after adding something the consumer may want.

        Cheaper than Condition.notify on the hot path: nothing to do unless the consumer
        sleeps, and then one lock release wakes it. With ``deferred``, the release is left
        to the caller (:func:`wake_all`), to do just before it sleeps itself.
        """
        if self._waiter is not None:
            if deferred is None:
                self._waiter.release()
            else:
                deferred.append(self._waiter)
            self._waiter = None

    def sleep(self, timeout: float | None, deferred: list[Any] | None = None) -> bool:
        """Call with ``lock`` held: release it until woken or timed out, then retake it.

        The ``deferred`` wakes are done after this inbox's lock is let go, the last thing
        before blocking (see :func:`wake_all`).
        """
        waiter = Waiter()
        self._waiter = waiter
        self.lock.release()
        try:
            woken = block(waiter, _NONE if deferred is None else deferred,
                           -1.0 if timeout is None else max(0.0, timeout))
        finally:
            self.lock.acquire()
            if self._waiter is waiter:
                self._waiter = None
        return woken

    def post_control(self, item: Any) -> None:
        """Control never waits behind data: it has its own unbounded lane (rare items)."""
        with self.lock:
            self.control.append(item)
            self.wake()

    def wait(self, timeout: float | None = None, deferred: list[Any] | None = None,
             ) -> tuple[list[Any], list[tuple[Ring, list[Any], list[float]]], bool]:
        """Block until there is control or data; return (control, data, all_inputs_done).

        ``data`` is every item available, ring by ring: [(ring, items, put_times)], each in
        FIFO order. ``all_inputs_done`` is true once every input ring is closed and empty.
        ``deferred`` wakes are done before this returns or sleeps.
        """
        rings, lock, control = self.rings, self.lock, self.control
        lock.acquire()
        try:
            while not control:
                for ring in rings:
                    if ring._items:
                        break
                else:  # nothing yet
                    if self.open == 0:
                        return [], [], True
                    if self.sleep(timeout, deferred):
                        continue
                break  # something came, or the time ran out
            taken: list[Any] = []
            if control:
                taken = list(control)
                control.clear()
            data = []
            for ring in rings:
                items = ring._items
                if items:
                    data.append((ring, list(items), list(ring._times)))
                    items.clear()
                    ring._times.clear()
                    if ring._room:
                        ring._room_made(deferred)  # woken below, once this lock is let go
            return taken, data, False
        finally:
            lock.release()
            if deferred:
                wake_all(deferred)  # when it did not sleep


def wake_all(deferred: list[Any]) -> None:
    """Wake the threads whose wake-up was deferred (see :meth:`Inbox.wake`), and forget them."""
    for waiter in deferred:
        waiter.release()
    deferred.clear()


class Ring:
    """A bounded FIFO from one producer port to one consumer port."""

    def __init__(self, capacity: int, policy: str = "block", *, inbox: Inbox | None = None, name: str = ""):
        if capacity < 1:
            raise ValueError(f"ring {name!r}: capacity must be >= 1, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"ring {name!r}: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.name, self.capacity, self.policy = name, capacity, policy
        self.inbox = inbox or Inbox()
        self.inbox.rings.append(self)
        self.inbox.open += 1
        self._lock = self.inbox.lock
        self._room: list[Any] = []  # waiters of producers blocked until there is room
        self._items: deque[Any] = deque()
        self._times: deque[float] = deque()  # put time of each item, side by side
        self._closed = False
        self.puts = self.drops = self.high_water = 0
        self.blocked_s = 0.0

    def _wait_for_room(self, deferred: list[Any] | None) -> None:
        """With the lock held: wait until the ring has room or is closed; count the time.

        Deferred wakes are done as this thread blocks: never block with a consumer unwoken.
        """
        t0 = time.perf_counter()
        while len(self._items) >= self.capacity and not self._closed:
            waiter = Waiter()
            self._room.append(waiter)
            self._lock.release()
            try:
                block(waiter, _NONE if deferred is None else deferred, -1.0)
            finally:
                self._lock.acquire()
        self.blocked_s += time.perf_counter() - t0

    def put(self, item: Any, deferred: list[Any] | None = None) -> bool:
        """Add an item; returns False when the policy dropped something (this or the oldest).

        With ``deferred``, the consumer's wake-up is added to that list instead of done now
        (:meth:`Inbox.wake`); the caller does it with :func:`wake_all` or its next block.
        """
        with self._lock:
            if self._closed:
                raise RingClosed(self.name)
            kept: bool | None = True
            if len(self._items) >= self.capacity:
                kept = self._overflow(deferred)
                if kept is None:
                    return False  # drop_newest: this item is the one dropped
            items = self._items  # after _overflow: a flush while it waited replaces the deque
            items.append(item)
            self._times.append(_now())
            self.puts += 1
            if len(items) > self.high_water:
                self.high_water = len(items)
            if self.inbox._waiter is not None:  # the consumer sleeps
                self.inbox.wake(deferred)
            return kept

    def _overflow(self, deferred: list[Any] | None) -> bool | None:
        """With the lock held and the ring full, make room by the policy: True when the new
        item goes in with nothing dropped, False when the oldest was dropped for it, None
        when the new item itself is dropped."""
        if self.policy == "block":
            self._wait_for_room(deferred)
            if self._closed:
                raise RingClosed(self.name)
            return True
        self.drops += 1
        if self.policy == "drop_oldest":
            self._items.popleft()
            self._times.popleft()
            return False
        return None

    def put_many(self, items: list[Any], deferred: list[Any] | None = None) -> None:
        """Put several items, taking the lock once per run of items that fits.

        Policies apply as in :meth:`put`; a ``block`` ring waits for room between runs.
        """
        if self.policy != "block":
            for item in items:
                self.put(item, deferred)
            return
        i, n = 0, len(items)
        while i < n:
            with self._lock:
                if len(self._items) >= self.capacity and not self._closed:
                    self._wait_for_room(deferred)
                if self._closed:
                    raise RingClosed(self.name)
                take = min(n - i, self.capacity - len(self._items))
                self._items.extend(items[i:i + take] if i or take < n else items)
                self._times.extend(repeat(_now(), take))
                i += take
                self.puts += take
                if len(self._items) > self.high_water:
                    self.high_water = len(self._items)
                if self.inbox._waiter is not None:
                    self.inbox.wake(deferred)

    def get(self, timeout: float | None = None) -> Any:
        """Take the oldest item, waiting up to ``timeout``; raises RingClosed once closed and empty.

        For code that reads one ring on its own (tests, tools); nodes are fed by the scheduler.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._items:
                if self._closed:
                    raise RingClosed(self.name)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self.name)
                self.inbox.sleep(remaining)
            item = self._items.popleft()
            self._times.popleft()
            if self._room:
                self._room_made()
            return item

    def flush(self, stale: Callable[[Any], bool] | None = None) -> int:
        """Drop every item (or those ``stale`` says are stale); returns how many were dropped."""
        with self._lock:
            before = len(self._items)
            if stale is None:
                kept: list[tuple[Any, float]] = []
            else:
                kept = [(x, t) for x, t in zip(self._items, self._times, strict=True) if not stale(x)]
            self._items = deque(x for x, _ in kept)
            self._times = deque(t for _, t in kept)
            dropped = before - len(self._items)
            self.drops += dropped
            if dropped and self._room:
                self._room_made()
            return dropped

    def close(self, *, discard: bool = False) -> None:
        """No more puts. The consumer still drains what is queued, unless ``discard``."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.inbox.open -= 1
            if discard:
                self.drops += len(self._items)
                self._items.clear()
                self._times.clear()
            self._room_made()
            self.inbox.wake()

    def _room_made(self, deferred: list[Any] | None = None) -> None:
        """With the lock held, after items left: wake the producers waiting for room (or defer it)."""
        if deferred is None:
            wake_all(self._room)
        else:
            deferred.extend(self._room)
            self._room.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> RingStats:
        with self._lock:
            return RingStats(self.name, self.capacity, self.policy, self.puts, self.drops,
                             self.high_water, round(self.blocked_s, 6))
