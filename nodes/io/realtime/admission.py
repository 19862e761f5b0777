"""Admission by capacity: whether the realtime server takes one more session now.

A server is full by count (``io.max_sessions``) or by load: its live sessions are already slower
than ``io.target_ms`` (the median of the recent voice-to-voice figures, first reply audio sent
minus the user's end of speech), or a confirmed turn's work already queues for the shared models
(the wait of ``first`` work in ``s2s_flow.inference.snapshot()``, summed over the models a turn
passes, is over half the target, while replies are being made). One more session would only make
every session later, so a new connection is refused with ``session_limit_reached``
(``io.admission=refuse``) or waits, at most ``io.admission_wait_s``, for a session to end or the
load to fall (``io.admission=wait``).

``io.target_ms=auto`` (the default) takes the target from this machine: ``AUTO_FACTOR`` (1.5) times
the median voice-to-voice of its replies made while one session was open, the best this machine
and its models give one caller. A fixed number is a promise tuned on one CPU: 1000 ms is met with
room on a fast one, while on a 2-core AMD EPYC (family 25 model 1) one caller alone waits 1.3 s, and
such a server would refuse every second caller. Until a few replies to a lone caller are in
(``AUTO_ALONE``), an auto target is not known and the server admits by count.

Load to come: a session admitted in the last ``NEW_S`` seconds that has had no reply yet has not
shown its load, and the figures above cannot see it; a burst of callers joining a server whose
replies are fast would all be admitted on the strength of figures made before any of them spoke.
So, while admission by load is on (a target is known), the server takes in newcomers a few at a
time, like a balancer's slow start: at most ``RAMP_MIN`` (2) at once, or half as many as the
sessions that have shown their load, whichever is more. A burst of 12 at an idle server is taken
in as 2, 2, 2, 3 and the last 3, a step as each step's first replies come in (a few seconds a
step), and every step is judged by the replies of the last (the rules above); callers joining a
few seconds apart meet the ramp only when two have joined and neither has been answered yet.
Measured (benchmarks/bench_realtime.py --conversations 1 12 --stagger-s 0 --load-admission
io.admission=wait, AMD EPYC family 25 model 17, 2 cores, two runs): 12 callers at once got their
replies at p95 3.0-3.1 s instead of 5.7-7.1 s with all of them let in at once, each held 10.5-11.5 s
(p50) before its session began. The ramp paces a burst; it does not size it: all 12 were let in,
since each step's first replies were still within the target when the next step was judged.

Full by load has hysteresis: once over the target, the server stays full until the load is back
under ``RECOVER_SHARE`` of it (the median under 80 % of ``io.target_ms``, the queue wait under 80 %
of its mark), or the figures have aged out, or no session is left. ``/readyz`` answers by the same
verdict (drain.py), so a balancer's health check sees exactly what a new connection would get,
and a load that hovers at the target does not take the process in and out at every check.

The same snapshot feeds ``/metrics``: per model, the work queued and running, its recent queue wait
and the work shed, by kind (``InferenceCollector``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any

from s2s_flow.errors import ConfigError

__all__ = ["Admission", "InferenceCollector", "POLICIES", "check", "inference_snapshot"]

POLICIES = ("refuse", "wait")
AUTO = "auto"        # io.target_ms from this machine's voice-to-voice for one caller
AUTO_FACTOR = 1.5    # ... this many times it
AUTO_ALONE = 3       # ... once this many replies to a lone caller are in
RECENT = 16          # voice-to-voice figures kept (the most recent, of any session)
RECENT_S = 60.0      # ... and none older than this: a load that has passed no longer counts
MIN_FIGURES = 2      # fewer figures than this say nothing about the load
FIRST_WAIT_SHARE = 0.5  # full when confirmed work queues for more than this share of the target
RECOVER_SHARE = 0.8     # once full by load, ready again only under this share of either mark
NEW_S = 20.0         # a session admitted this recently with no reply yet has not shown its load
RAMP_MIN = 2         # newcomers taken in at once, at least ...
RAMP_SHARE = 0.5     # ... or this share of the sessions that have shown their load


def inference_snapshot() -> dict[str, dict[str, Any]]:
    """``s2s_flow.inference.snapshot()``: per shared model ``{"queued": {kind: n}, "running": n,
    "wait_s": {kind: s}, "shed": {kind: n}}``; empty where the engine has no inference scheduler."""
    try:
        from s2s_flow.inference import snapshot
    except ImportError:
        return {}
    return snapshot() or {}


def first_wait_s(snapshot: dict[str, dict[str, Any]]) -> float:
    """How long a confirmed turn's work queues now: ``first`` work's recent wait, over the models."""
    return sum(float((model.get("wait_s") or {}).get("first") or 0.0) for model in snapshot.values())


def check(policy: str, target_ms: float | str | None, wait_s: float) -> None:
    """The admission settings, checked at compose time (the source's) and again by the server."""
    if policy not in POLICIES:
        raise ConfigError(f"io.admission={policy!r} is not an admission policy; choose io.admission=refuse "
                          "(a connection beyond capacity gets session_limit_reached) or io.admission=wait "
                          "(it waits up to io.admission_wait_s for room)")
    if target_ms is not None and target_ms != AUTO and (isinstance(target_ms, bool | str) or target_ms <= 0):
        raise ConfigError(f"io.target_ms={target_ms} must be > 0 (the voice-to-voice a session should get, "
                          f"in ms), {AUTO} ({AUTO_FACTOR:g} x what this machine gives one caller alone), or null "
                          "to admit by io.max_sessions alone")
    if wait_s < 0:
        raise ConfigError(f"io.admission_wait_s={wait_s} must be >= 0 seconds")


class Admission:
    """The server's admission decisions (one per server; used on its event loop only)."""

    def __init__(self, *, sessions: Callable[[], int], max_sessions: int, target_ms: float | str | None = AUTO,
                 policy: str = "refuse", wait_s: float = 10.0,
                 snapshot: Callable[[], dict[str, dict[str, Any]]] = inference_snapshot,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check(policy, target_ms, wait_s)
        self.sessions, self.max_sessions, self.target_ms = sessions, max_sessions, target_ms
        self.policy, self.wait_s, self.snapshot, self.clock = policy, wait_s, snapshot, clock
        self.recent: deque[tuple[float, float]] = deque(maxlen=RECENT)  # (when, voice-to-voice s)
        self.alone: deque[float] = deque(maxlen=RECENT)  # voice-to-voice s of replies to a lone session
        self._changed: asyncio.Event | None = None
        self.newcomers: dict[str, float] = {}  # admitted, no reply yet: session id -> when admitted
        self.load = ""  # what made it full by load, the last time it was
        self.loaded = False  # full by load at the last verdict: the marks are RECOVER_SHARE lower

    # -- what the server tells it --------------------------------------------------------------

    def joined(self, session: str) -> None:
        """A session was admitted: a newcomer until its first reply (or for ``NEW_S``)."""
        self.newcomers[session] = self.clock()

    def voice_to_voice(self, seconds: float, session: str | None = None) -> None:
        """A live session's reply started ``seconds`` after its user stopped speaking (any thread)."""
        self.recent.append((self.clock(), seconds))
        if self.sessions() <= 1:
            self.alone.append(seconds)
        if session is not None:
            self.newcomers.pop(session, None)  # its load shows in the figures from now on

    def target_s(self) -> float | None:
        """The voice-to-voice budget in seconds: ``io.target_ms``, or for ``auto`` :data:`AUTO_FACTOR`
        times the median of the replies to a lone session; None: by count only (null, or auto before
        :data:`AUTO_ALONE` such replies)."""
        if self.target_ms != AUTO:
            return None if self.target_ms is None else self.target_ms / 1000
        alone = list(self.alone)
        return AUTO_FACTOR * median(alone) if len(alone) >= AUTO_ALONE else None

    def _target(self) -> str:
        """The budget as the messages name it."""
        if self.target_ms != AUTO:
            return f"io.target_ms={self.target_ms:g}"
        target = self.target_s()
        if target is None:
            return f"io.target_ms={AUTO} (not known yet: fewer than {AUTO_ALONE} replies to a lone caller)"
        return (f"io.target_ms={AUTO} ({target * 1000:.0f} ms: {AUTO_FACTOR:g} x the "
                f"{target / AUTO_FACTOR * 1000:.0f} ms this machine gives one caller alone)")

    def closed(self, session: str | None = None) -> None:
        """A session ended: room for a waiting connection (on the server's loop)."""
        if session is not None:
            self.newcomers.pop(session, None)
        if self._changed is not None:
            self._changed.set()

    # -- the decision ----------------------------------------------------------------------------

    def recent_v2v_s(self) -> list[float]:
        cutoff = self.clock() - RECENT_S
        return [v for t, v in list(self.recent) if t >= cutoff]

    def full(self) -> str | None:
        """Why one more session cannot be served now ("count" or "load"), None when it can; what the
        load was is kept for explain()."""
        live = self.sessions()
        if live >= self.max_sessions:
            return "count"
        target = self.target_s()
        self.loaded = target is not None and bool(live) and self._over(target)
        return "load" if self.loaded or (target is not None and self._coming(live)) else None

    def _coming(self, live: int) -> bool:
        """Too many newcomers whose load has not shown yet: the ramp (see the module's docstring)."""
        cutoff = self.clock() - NEW_S
        for session, since in list(self.newcomers.items()):
            if since < cutoff:
                self.newcomers.pop(session, None)  # admitted NEW_S ago: as settled as it gets
        new = min(len(self.newcomers), live)
        allowed = max(RAMP_MIN, math.ceil(RAMP_SHARE * (live - new)))
        if new < allowed:
            return False
        self.load = (f"{new} session(s) joined in the last {NEW_S:.0f} s and have had no reply yet, so their "
                     f"load does not show in the figures; newcomers are taken in {allowed} at a time, "
                     f"each step once the last has been answered")
        return True

    def _over(self, target_s: float) -> bool:
        """Over the load marks (lowered to RECOVER_SHARE while it was full by load)."""
        mark_s = target_s * (RECOVER_SHARE if self.loaded else 1.0)
        back = "" if not self.loaded else f", not yet back under {RECOVER_SHARE:.0%} of the target"
        recent = self.recent_v2v_s()
        if len(recent) >= MIN_FIGURES and median(recent) > mark_s:
            self.load = (f"its sessions' replies start {median(recent) * 1000:.0f} ms after the user stops "
                         f"(median){back}")
            return True
        # the scheduler's waits are those of the last work done: current only while replies are
        waited = first_wait_s(self.snapshot()) if recent else 0.0
        if waited > FIRST_WAIT_SHARE * mark_s:
            self.load = f"confirmed turns queue {waited * 1000:.0f} ms for the shared models{back}"
            return True
        return False

    def explain(self, reason: str) -> str:
        """The error message a refused client reads."""
        if reason == "count":
            return f"the server holds {self.max_sessions} sessions (io.max_sessions); try again later"
        return (f"the server is at capacity: {self.load}, against its {self._target()} budget, "
                "so one more session would slow every one; try again later (or another server)")

    def why(self, reason: str) -> str:
        """The short form ``/readyz`` gives: ``full: count (...)`` or ``full: load: ...``."""
        if reason == "count":
            return f"full: count ({self.sessions()} of io.max_sessions={self.max_sessions})"
        return f"full: load: {self.load} ({self._target()})"

    async def admit(self) -> str | None:
        """Take the new connection (None) or say why not. ``wait``: until there is room, at most
        ``wait_s``; the verdict is taken again whenever a session ends, and at least every second
        (the load falls as figures age)."""
        reason = self.full()
        if reason is None or self.policy == "refuse":
            return reason
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = self.clock() + self.wait_s
        while reason is not None and (left := deadline - self.clock()) > 0:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            reason = self.full()
        return reason


class InferenceCollector:
    """Prometheus collector of ``inference_snapshot()``, read at every scrape of ``/metrics``."""

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, Any]]] = inference_snapshot) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # names are known only at scrape time; registering must not take a snapshot

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        queued = GaugeMetricFamily("s2s_inference_queued", "Work waiting for a shared model, by kind",
                                   labels=["model", "kind"])
        running = GaugeMetricFamily("s2s_inference_running", "Work a shared model runs now", labels=["model"])
        wait = GaugeMetricFamily("s2s_inference_wait_seconds", "Recent mean queue wait for a shared model, "
                                 "by kind", labels=["model", "kind"])
        shed = CounterMetricFamily("s2s_inference_shed", "Work shed under load (never run), by kind",
                                   labels=["model", "kind"])
        for model, figures in sorted(self.snapshot().items()):
            for kind, n in sorted((figures.get("queued") or {}).items()):
                queued.add_metric([model, kind], n)
            running.add_metric([model], figures.get("running") or 0)
            for kind, s in sorted((figures.get("wait_s") or {}).items()):
                wait.add_metric([model, kind], s)
            for kind, n in sorted((figures.get("shed") or {}).items()):
                shed.add_metric([model, kind], n)
        yielded = CounterMetricFamily("s2s_inference_yielded_seconds", "Time a reply's later sentences waited "
                                      "for other sessions' first words (the machine's critical path)")
        from s2s_flow.inference import critical

        yielded.add_metric([], critical.yielded_s)
        yield from (queued, running, wait, shed, yielded)
