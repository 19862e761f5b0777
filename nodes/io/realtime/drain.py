"""Draining: how the server stops without cutting its calls (SIGTERM from a balancer, Kubernetes).

On the first SIGTERM the server stops accepting: ``/readyz`` answers 503 (a balancer's health check
takes the process out), a new WebSocket gets an error and a close with 1013 ("try again later"), and
the live sessions go on until their clients leave or ``io.drain_timeout_s`` passes; then what is
left is told (an error event) and closed with 1001, and the server exits, cleanly: ``s2s-run``
stops its managed model servers and returns 0. A second SIGTERM, or a SIGINT, ends it at once.
A first SIGINT (Ctrl-C at a terminal) stops at once too, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from nodes.io.realtime import protocol as events

__all__ = ["Drain", "drainable_server"]

log = logging.getLogger("s2s_flow.realtime")
CLOSE_WAIT_S = 10.0  # after the drain time: how long the closed sessions may take to end


class Drain:
    """The server's accepting state and its live connections (anything with ``shut(message)``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.connections: set[Any] = set()
        self._empty: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    def add(self, connection: Any) -> None:
        self.connections.add(connection)

    def remove(self, connection: Any) -> None:
        self.connections.discard(connection)
        if not self.connections and self._empty is not None:
            self._empty.set()

    def readiness(self, admission: Any) -> dict[str, Any]:
        """Whether a new session would be taken now, by admission's own verdict (admission.py: by
        count, and by load with its hysteresis): ``{"status": "ready"|"draining"|"full", "sessions": n}``,
        and for ``full`` the ``reason`` (``count``, ``load``) and ``why`` in words."""
        n = admission.sessions()
        if self.draining:
            return {"status": "draining", "why": "draining", "sessions": n}
        reason = admission.full()
        if reason is None:
            return {"status": "ready", "sessions": n}
        return {"status": "full", "reason": reason, "why": admission.why(reason), "sessions": n}

    def routes(self, admission: Any, metrics: Any = None) -> list[Any]:
        """``/healthz`` (the process answers) and ``/readyz`` (it takes a new session: 503 while
        draining, or whenever admission would refuse one, by count or by load), for a balancer's
        health checks and Kubernetes' probes; ``metrics`` (prometheus.py) gets the same state as
        gauges."""
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        if metrics is not None:
            metrics.readiness(lambda: self.readiness(admission))

        async def healthz(request: Any) -> Any:
            return JSONResponse({"status": "alive", "sessions": admission.sessions()})

        async def readyz(request: Any) -> Any:
            state = self.readiness(admission)
            return JSONResponse(state, status_code=200 if state["status"] == "ready" else 503)

        return [Route("/healthz", healthz), Route("/readyz", readyz)]

    async def turned_away(self, ws: Any) -> bool:
        """While draining, a new (accepted) WebSocket is told and closed with 1013: True."""
        if not self.draining:
            return False
        await ws.send_text(events.encode(events.error(
            "server_draining", "this server is shutting down and takes no new sessions; try again later "
            "(through the balancer, another server)", type="server_error")))
        await ws.close(code=1013, reason="try again later")
        return True

    def begin(self, loop: asyncio.AbstractEventLoop, stop: Any) -> None:
        """Start draining, from any thread (a signal handler, a test): ``stop()`` ends the server after."""
        self.draining = True

        def start() -> None:
            if self.task is None:
                self.task = loop.create_task(self.run(stop))

        loop.call_soon_threadsafe(start)

    async def run(self, stop: Any) -> None:
        """Drain (on the server's loop): wait for the live sessions up to the timeout, close the rest,
        then ``stop()`` the server."""
        self.draining = True
        self._empty = asyncio.Event()
        if not self.connections:
            self._empty.set()
        log.warning("draining: %d live session(s) may finish within io.drain_timeout_s=%g s",
                    len(self.connections), self.timeout_s)
        try:
            await asyncio.wait_for(self._empty.wait(), self.timeout_s)
        except TimeoutError:
            log.warning("drain timeout: closing %d live session(s)", len(self.connections))
            message = (f"the server is shutting down: its drain time (io.drain_timeout_s={self.timeout_s:g} s) "
                       "is over; reconnect to reach another server")
            for connection in list(self.connections):
                connection.shut(message)
            self._empty.clear()
            if self.connections:  # told and closed; one that does not read is cut by the shutdown
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._empty.wait(), CLOSE_WAIT_S)
        stop()


def drainable_server(config: Any, drain: Drain) -> Any:
    """A uvicorn server whose SIGTERM drains (``Drain``) before it exits; a second SIGTERM or any
    SIGINT exits at once. The signals are not raised again after the server ends (uvicorn's own
    habit): a drained server's process exits 0."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and not drain.draining and not self.should_exit:
                drain.begin(asyncio.get_event_loop(), self.stop)
                return
            if self.should_exit or drain.draining:
                self.force_exit = True
            self.should_exit = True

        def stop(self) -> None:
            self.should_exit = True

    return _Server(config)
