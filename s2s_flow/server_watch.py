"""A managed model server that comes back: while the run goes on, its process is watched and its
``ready_url`` asked every ``server.health_interval_s``; one that exits, or misses
``server.health_failures`` probes in a row, is restarted after a backoff (``restart_backoff_s``,
doubled for each next try, at most 30 s), at most ``server.max_restarts`` tries in a row. Each
try is logged and counted (:func:`restarts`: the realtime server's ``/metrics`` shows it as
``s2s_model_server_restarts_total{server=...}``). The sessions meanwhile live on: a turn whose
LLM finds no server says ``llm.fallback_reply`` (live runs), the next turn after the server is
back is answered. After the last try fails the watch gives up (logged) and turns keep failing.

s2s_flow/model_server.py starts the watch for a server it started itself (one that was already
running is not its to restart) and hands it how to probe, start and stop the server. It also notes
here the slots of each server it runs (:func:`slots_of`) and its replicas (:func:`replicas_of`): no
other process sends that server requests, so each session may keep a slot of its own.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any

from s2s_flow.errors import S2SError, Stopped

__all__ = ["Watch", "replicas_of", "restarts", "running", "slots_of", "BACKOFF_CAP_S"]

log = logging.getLogger("s2s_flow.model_server")

BACKOFF_CAP_S = 30.0
_LOCK = threading.Lock()
_RESTARTS: dict[str, int] = {}


def restarts() -> dict[str, int]:
    """Restart tries of this process's managed servers so far, by server (``llama-server:8080``)."""
    with _LOCK:
        return dict(_RESTARTS)


_SLOTS: dict[tuple[str, int], int] = {}  # (host, port) -> server.slots, of the servers this process runs
_REPLICAS: dict[tuple[str, int], tuple[int, ...]] = {}  # (host, first port) -> every replica's port


def running(host: str, ports: Sequence[int], slots: int | None) -> None:
    """The server started here on ``host`` runs on ``ports`` (its replicas, the first one's port
    first), each with ``slots`` (None: it stopped, or names none)."""
    with _LOCK:
        for port in ports:
            if slots:
                _SLOTS[(host, port)] = slots
            else:
                _SLOTS.pop((host, port), None)
        if slots:
            _REPLICAS[(host, ports[0])] = tuple(ports)
        else:
            _REPLICAS.pop((host, ports[0]), None)


def slots_of(host: str, port: int) -> int | None:
    """``server.slots`` of the server on ``host:port`` while this process runs it; None for any other
    (a server used as is may serve other processes too: its slots are not this process' to hand out)."""
    with _LOCK:
        return _SLOTS.get((host, port))


def replicas_of(host: str, port: int) -> tuple[int, ...]:
    """The ports of every replica of the server whose first port is ``port``, while this process runs
    it (server.replicas); ``(port,)`` for a server of one copy, or one not started here."""
    with _LOCK:
        return _REPLICAS.get((host, port), (port,))


def _count(name: str) -> None:
    with _LOCK:
        _RESTARTS[name] = _RESTARTS.get(name, 0) + 1


class Watch:
    """Watches ``proc`` (the server ``name``) on a thread of its own; ``stop()`` ends it and
    returns the process to stop (the last one, maybe not the first: one it started, it has
    stopped itself by then).

    ``probe()``: None while the server answers, else what it answered instead. ``start()``: a
    new process (already logging); ``ready(proc)``: returns once it answers, raises S2SError if
    it died or never did, Stopped once ``stopping`` is set. ``stop_proc(proc)`` ends one.
    """

    def __init__(self, name: str, spec: Any, proc: subprocess.Popen, *, probe: Callable[[], str | None],
                 start: Callable[[], subprocess.Popen], ready: Callable[[subprocess.Popen], None],
                 stop_proc: Callable[[subprocess.Popen], None], stopping: threading.Event) -> None:
        self.name, self.spec, self.proc = name, spec, proc
        self._probe, self._start, self._ready, self._stop_proc = probe, start, ready, stop_proc
        self.stopping = stopping
        self.gave_up = False
        # The thread lives as long as the run and stops a server it started itself before it ends:
        # the end of the thread that started a server KILLs that server (PR_SET_PDEATHSIG).
        self._first = proc
        self._thread = threading.Thread(target=self._run, name=f"watch:{name}", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> subprocess.Popen:
        self.stopping.set()
        self._thread.join()
        return self.proc

    def _run(self) -> None:
        misses = 0
        while not self.stopping.wait(self.spec.health_interval_s):
            code = self.proc.poll()
            if code is None:
                detail = self._probe()
                if detail is None:
                    misses = 0
                    continue
                misses += 1
                if misses < self.spec.health_failures:
                    continue
                why = f"stopped answering {self.spec.ready_url} ({detail}; {misses} probes in a row)"
            else:
                why = f"exited with code {code}"
            misses = 0
            if not self._come_back(why):
                break
        self.stopping.wait()
        if self.proc is not self._first:
            self._stop_proc(self.proc)

    def _come_back(self, why: str) -> bool:
        tries = self.spec.max_restarts
        log.error("the model server %s %s: restarting it (up to %d tries)", self.name, why, tries)
        for attempt in range(1, tries + 1):
            delay = min(self.spec.restart_backoff_s * 2 ** (attempt - 1), BACKOFF_CAP_S)
            if self.stopping.wait(delay):
                return False
            _count(self.name)
            log.warning("restarting the model server %s (try %d of %d, after %.1f s)", self.name, attempt,
                        tries, delay)
            self._stop_proc(self.proc)
            try:
                self.proc = self._start()
                self._ready(self.proc)
            except Stopped:
                return False
            except S2SError as exc:
                log.error("the model server %s did not come back (try %d of %d): %s", self.name, attempt,
                          tries, exc)
                continue
            log.warning("the model server %s is back (pid %d, try %d)", self.name, self.proc.pid, attempt)
            return True
        self.gave_up = True
        log.error("the model server %s did not come back after %d tries: giving up; its turns fail until "
                  "s2s-run is started again (raise server.max_restarts to try longer)", self.name, tries)
        return False
