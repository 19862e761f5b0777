"""Shared inference: one scheduler per shared model, ordered by what a listener waits for.

Many sessions share one Whisper, one Piper voice, one local LLM (node contract:
``inference_key()``). Each model takes its work through a :class:`Scheduler` with ``slots`` calls
at once; a call waits for a slot in the order of its kind, then its deadline:

- ``first``: on a confirmed turn's critical path (its STT, the LLM's reply, the TTS's first clause);
- ``later``: a reply's later sentences, ``deadline`` = when the listener will run out of audio;
- ``speculative``: work on a turn not confirmed yet (``vad.speculate_ms``), promoted to its
  confirmed kind the moment the turn is confirmed (:meth:`Session.confirm`), queued or not;
- ``partial``: live partial transcripts.

Under load (a ``speculative`` or ``partial`` call that waited ``shed_after_s`` for a slot) the call
is shed: it leaves the queue, is counted per kind and logged, and its caller gets :class:`Shed`,
never silence (an STT skips the partial, a TTS waits for the turn's confirmation). A free slot is
taken under one lock, without a thread hop, so a session alone runs as fast as without::

    with node.inference_slot("first", turn=msg.turn):   # the node contract's way in
        text = model.transcribe(audio)

:func:`snapshot` reports every model's queue for /metrics and admission.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = ["KINDS", "Cancelled", "CriticalPath", "Scheduler", "Session", "Shed", "critical", "scheduler", "snapshot",
           "SHED_AFTER_S"]

#: the kinds of work, in the order they are served
KINDS = ("first", "later", "speculative", "partial")
_RANK = {kind: rank for rank, kind in enumerate(KINDS)}
_SHEDDABLE = frozenset({"speculative", "partial"})
#: a speculative or partial call that waited this long for a slot is shed (the model is loaded)
SHED_AFTER_S = 0.25
_RECENT = 32  # queue waits averaged per kind in snapshot(): the last ones ...
_RECENT_S = 10.0  # ... of the last seconds (an idle model reports no wait, not its last busy moment)
_CANCEL_CHECK_S = 0.05  # how often a waiter that may be cancelled looks

log = logging.getLogger("s2s_flow.inference")


class Shed(RuntimeError):
    """A speculative or partial call was shed: the model is busy with confirmed work."""

    def __init__(self, model: str, kind: str, waited_s: float) -> None:
        super().__init__(f"{model}: {kind} work shed after {waited_s:.2f} s in the queue")
        self.model, self.kind, self.waited_s = model, kind, waited_s


class Cancelled(RuntimeError):
    """The caller's ``cancelled()`` became true while it waited for a slot (a barge-in)."""


class Session:
    """One conversation's side of the schedulers: its turns still speculative. The VAD marks a
    turn speculative when it sends its early ``Speech`` and confirms it with the confirmation;
    every node of the session reads it through ``ctx.work``."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._unconfirmed: set[int] = set()
        self._settled = threading.Condition()

    def speculate(self, turn: int) -> None:
        with self._settled:
            self._unconfirmed = {t for t in self._unconfirmed if t > turn - 16} | {turn}  # withdrawn ones age out

    def confirm(self, turn: int) -> None:
        """The turn is over: its work is confirmed from now on, and what waits in a queue is promoted."""
        with self._settled:
            if turn not in self._unconfirmed:
                return
            self._unconfirmed.discard(turn)
            self._settled.notify_all()
        for sched in _schedulers():
            sched.promote(self, turn)

    def kind(self, kind: str, turn: int | None) -> str:
        """``kind``, or ``speculative`` for confirmed-kind work of a turn not confirmed yet."""
        if kind in _SHEDDABLE or turn is None:
            return kind
        with self._settled:
            return "speculative" if turn in self._unconfirmed else kind

    def wait_confirmed(self, turn: int, cancelled: Callable[[], bool]) -> bool:
        """Block until ``turn`` is confirmed (True) or ``cancelled()`` (False: withdrawn, stopping)."""
        with self._settled:
            while turn in self._unconfirmed:
                if cancelled():
                    return False
                self._settled.wait(0.1)  # an interrupt withdraws the turn without telling us
        return not cancelled()


class CriticalPath:
    """Work on a turn's way to its first audio in flight on this machine, of any model and any
    session: a listener waits for each. Held by a scheduler's ``first`` calls (queued or running)
    and by an LLM's first sentence on its server, of a confirmed turn and of a speculative one alike
    (a reply begun at a pause: on a slow CPU its STT, LLM and first clause take longer than the
    confirmation, so they are the critical path); work with slack (a reply's later sentences,
    written and spoken ahead of the listener) yields to it while it has slack, so the cores go to
    the first words. The queues' order is unchanged: a speculative call still waits behind
    confirmed ones for a slot, this is only what work with slack waits for before it starts::

        critical.yield_to(lambda: ahead_of_listener() > 0.5, cancelled)   # later work, before it starts
    """

    def __init__(self) -> None:
        self._held = 0
        self._idle = threading.Condition()
        self.yielded_s = 0.0  # how long later work waited for it, in all (for /metrics)

    @contextmanager
    def holding(self) -> Iterator[None]:
        with self._idle:
            self._held += 1
        try:
            yield
        finally:
            with self._idle:
                self._held -= 1
                self._idle.notify_all()

    def busy(self) -> bool:
        return self._held > 0

    def yield_to(self, slack: Callable[[], bool], cancelled: Callable[[], bool]) -> float:
        """Wait while first work is in flight and ``slack()`` says this work can still wait (its
        listener has audio enough), or until ``cancelled()``; the seconds waited."""
        start = time.monotonic()
        with self._idle:
            while self._held and not cancelled() and slack():
                self._idle.wait(_CANCEL_CHECK_S)
            waited = time.monotonic() - start
            self.yielded_s += waited
        return waited


#: the machine's critical path: every scheduler's first work and the LLMs' first sentences
critical = CriticalPath()


class _Waiter:
    __slots__ = ("kind", "asked", "deadline", "session", "turn", "since", "granted", "wake")

    def __init__(self, kind: str, asked: str, deadline: float, session: Session | None, turn: int | None,
                 since: float, lock: threading.Lock) -> None:
        self.kind, self.asked = kind, asked  # what it runs as now; what the caller asked for
        self.deadline, self.session, self.turn, self.since = deadline, session, turn, since
        self.granted = False
        self.wake = threading.Condition(lock)

    def order(self) -> tuple[int, float, float]:
        return _RANK[self.kind], self.deadline, self.since


class Scheduler:
    """The slots of one shared model and the queue before them (thread-safe)."""

    def __init__(self, name: str, slots: int = 1, *, shed_after_s: float = SHED_AFTER_S) -> None:
        self.name = name
        self.slots = max(1, int(slots))
        self.shed_after_s = shed_after_s
        self._lock = threading.Lock()
        self._running = 0
        self._queue: list[_Waiter] = []
        self._waits = {kind: deque(maxlen=_RECENT) for kind in KINDS}
        self._shed = dict.fromkeys(KINDS, 0)

    @contextmanager
    def slot(self, kind: str = "first", *, deadline: float | None = None, session: Session | None = None,
             turn: int | None = None, cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """Hold one of the model's slots for the block (yields the kind it ran as); raises
        :class:`Shed` for speculative or partial work that waited too long, :class:`Cancelled` when
        ``cancelled()`` turned true while it waited."""
        # a turn's way to its first audio, queued or running, confirmed or not (``speculative`` as
        # asked: an utterance sent early, promoted to ``first`` at the confirmation): a listener
        # waits for it (CriticalPath)
        with critical.holding() if kind in ("first", "speculative") else nullcontext():
            kind = self.acquire(kind, deadline=deadline, session=session, turn=turn, cancelled=cancelled)
            try:
                yield kind
            finally:
                self.release()

    def acquire(self, kind: str = "first", *, deadline: float | None = None, session: Session | None = None,
                turn: int | None = None, cancelled: Callable[[], bool] | None = None) -> str:
        if kind not in _RANK:
            raise ValueError(f"unknown kind of inference work {kind!r}: one of {', '.join(KINDS)}")
        asked = kind
        with self._lock:  # the kind is read under it: a confirmation's promote() comes after, or it is seen
            if session is not None:
                kind = session.kind(kind, turn)
            if self._running < self.slots and not self._queue:  # the plain case: no wait, no hop
                self._running += 1
                self._waits[kind].append((time.monotonic(), 0.0))
                return kind
            now = time.monotonic()
            me = _Waiter(kind, asked, now if deadline is None else deadline, session, turn, now, self._lock)
            self._queue.append(me)
            self._grant()
            while not me.granted:
                if cancelled is not None and cancelled():
                    self._queue.remove(me)
                    raise Cancelled(f"{self.name}: {me.kind} work of turn {turn} cancelled while it waited")
                timeout = None if cancelled is None else _CANCEL_CHECK_S  # a barge-in does not notify us
                if me.kind in _SHEDDABLE:
                    left = self.shed_after_s - (time.monotonic() - me.since)
                    if left <= 0:
                        self._queue.remove(me)
                        self._shed[me.kind] += 1
                        waited = time.monotonic() - me.since
                        log.debug("%s: %s work of turn %s shed after %.2f s", self.name, me.kind, turn, waited)
                        raise Shed(self.name, me.kind, waited)
                    timeout = left if timeout is None else min(timeout, left)
                me.wake.wait(timeout)
            now = time.monotonic()
            self._waits[me.kind].append((now, now - me.since))
            return me.kind

    def release(self) -> None:
        with self._lock:
            self._running -= 1
            self._grant()

    def promote(self, session: Session, turn: int) -> None:
        """A turn was confirmed: its queued speculative work competes as confirmed work now."""
        with self._lock:
            for w in self._queue:
                if w.session is session and w.turn == turn and w.kind == "speculative":
                    w.kind = "first" if w.asked == "speculative" else w.asked
                    w.wake.notify()  # it waits without a shedding timeout from now on
            self._grant()

    def _grant(self) -> None:
        """Hand free slots to the best waiters (called with the lock held)."""
        while self._queue and self._running < self.slots:
            best = min(self._queue, key=_Waiter.order)
            self._queue.remove(best)
            self._running += 1
            best.granted = True
            best.wake.notify()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            queued = dict.fromkeys(KINDS, 0)
            for w in self._queue:
                queued[w.kind] += 1
            since = time.monotonic() - _RECENT_S
            recent = {k: [wait for t, wait in waits if t >= since] for k, waits in self._waits.items()}
            return {
                "queued": queued,
                "running": self._running,
                "wait_s": {k: (sum(w) / len(w) if w else 0.0) for k, w in recent.items()},
                "shed": dict(self._shed),
            }


_REGISTRY_LOCK = threading.Lock()
_REGISTRY: dict[str, Scheduler] = {}


def scheduler(name: str, slots: int = 1) -> Scheduler:
    """The process's scheduler of the shared model ``name`` (made on first use); ``slots`` as the
    backend declares them now (a model loaded again with other threads may change them)."""
    with _REGISTRY_LOCK:
        sched = _REGISTRY.get(name)
        if sched is None:
            sched = _REGISTRY[name] = Scheduler(name, slots)
        elif sched.slots != slots and slots >= 1:
            with sched._lock:
                sched.slots = int(slots)
                sched._grant()
        return sched


def _schedulers() -> list[Scheduler]:
    with _REGISTRY_LOCK:
        return list(_REGISTRY.values())


def snapshot() -> dict[str, dict[str, Any]]:
    """Every shared model's queue now: ``{model: {"queued": {kind: n}, "running": n,
    "wait_s": {kind: mean queue wait of the last calls of the last 10 s, 0 without any},
    "shed": {kind: n since the process started}}}`` (kinds: :data:`KINDS`)."""
    return {s.name: s.snapshot() for s in _schedulers()}

