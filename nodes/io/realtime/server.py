"""The ``io=realtime`` server: Starlette on uvicorn (``websockets``), one graph per connection.

Routes: ``/v1/realtime`` (the OpenAI Realtime WebSocket), ``/v1/realtime/calls`` (the same sessions over
WebRTC: webrtc.py), ``/v1/twilio`` (a phone call through Twilio Media Streams, translated to a Realtime
session's events: twilio.py), ``/metrics`` (Prometheus text: sessions open and refused, turns, voice-to-voice,
the shared models' queues), ``/`` (the browser app: ``web/page.html``, its files under ``/web/``),
``/healthz`` (alive) and ``/readyz`` (accepting: 503 while draining or full, by count or load). Every route passes
the Origin and Host checks first (guard.py); SIGTERM drains (drain.py); a connection is admitted per client address
(clients.py), by count and by load (admission.py). Each connection builds a fresh graph from the composed
config (cheap: ``__init__`` only), gives it its session (the source and sink take it from ``ctx.session``; the
session finds its VAD, TTS and LLM), and runs it with its own Scheduler on its own threads; models come from
the process-wide cache (``Node.shared()``), kept warm here for the server's lifetime.

The transport moves text: frames in to the client-event handlers (client_events.py), the
session's encoded events out. What waits for a client is bounded: its events in
``io.max_queued_bytes`` (a client that stops reading is told, closed with 1008, and its
connection dropped if it still does not read; a backlog of the server's own making, a burst of
audio or its loop held up while the client reads all it is sent, closes nobody up to a few times
that: backpressure.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from nodes.io.realtime import protocol as events
from nodes.io.realtime.admission import Admission
from nodes.io.realtime.backpressure import abort_unless_sent, bound_send_buffer, not_reading, transport_of
from nodes.io.realtime.client_events import ClientEvents
from nodes.io.realtime.clients import ClientLimits, Refusal
from nodes.io.realtime.drain import Drain, drainable_server
from nodes.io.realtime.guard import Guard
from nodes.io.realtime.limits import EventRate, trim_memory_soon
from nodes.io.realtime.prometheus import ServerMetrics
from nodes.io.realtime.protocol import SessionConfig
from nodes.io.realtime.receive import Receiver
from nodes.io.realtime.session import Session
from nodes.io.realtime.twilio import TwilioCall
from s2s_flow.node import Context, keep_shared, require

__all__ = ["RealtimeServer"]

log = logging.getLogger("s2s_flow.realtime")
WEB = Path(__file__).with_name("web")  # the browser app: page.html, app.js, app.css, worklets.js
CLOSE_GRACE_S = 5.0  # a client closed for not reading gets this long to read its error and the close


_SERVERS = [0]  # servers of this process that have settled the garbage collector
_SERVERS_LOCK = threading.Lock()


def _settle_gc() -> None:
    """Once the models are loaded: collect what loading left and freeze what stays out of later
    collections. The server does it, for all its sessions (their Scheduler's ``own_gc=False``): a
    collection stops every thread, the other sessions' turns too. The freeze is the process's,
    held until its last server stops."""
    with _SERVERS_LOCK:
        _SERVERS[0] += 1
        gc.collect()
        gc.freeze()


def _unsettle_gc() -> None:
    with _SERVERS_LOCK:
        _SERVERS[0] -= 1
        if not _SERVERS[0]:
            gc.unfreeze()


class ServerOptions(Protocol):
    """What the server reads of its settings: the source's (nodes.py), checked at compose time."""

    host: str
    port: int
    api_key: str | None
    max_sessions: int
    idle_timeout_s: float
    max_frame_bytes: int
    max_queued_bytes: int
    target_ms: float | str | None
    admission: str
    admission_wait_s: float
    max_events_per_s: float
    drain_timeout_s: float
    allowed_origins: list[str]
    allowed_hosts: list[str]
    client_limits: Any  # clients.ClientLimitSettings
    ice_servers: list[dict[str, Any]]
    twilio_voice: str | None
    twilio_instructions: str | None
    twilio_auth_token: str | None

    @property
    def serves(self) -> str: ...


class RealtimeServer:
    """Serves ``make_graph()`` per connection. ``run()`` blocks (s2s-run); tests use
    ``start()`` / ``stop()``, which run uvicorn on a thread."""

    def __init__(self, make_graph: Callable[[], Any], options: ServerOptions, run_dir: Path | str,
                 *, console: Any = None, sock: socket.socket | None = None) -> None:
        for module in ("starlette", "uvicorn", "websockets"):
            require(module, "serve")
        self.make_graph, self.options, self.run_dir = make_graph, options, Path(run_dir)
        self.console = console
        self.metrics = ServerMetrics()
        self.admission = Admission(sessions=lambda: self.open, max_sessions=options.max_sessions,
                                   target_ms=options.target_ms, policy=options.admission,
                                   wait_s=options.admission_wait_s)
        self.metrics.admission_target(self.admission.target_s)
        self.open = self.sessions_run = 0  # sessions open now, and since the start
        self.sessions: dict[str, Session] = {}  # the sessions open now, by id
        self._sock = sock
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._keep: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._template: Any = None  # a graph of the config, never run: what a new session is told it has
        self.guard = Guard(options.host, options.allowed_origins, options.allowed_hosts)
        self.drain = Drain(options.drain_timeout_s)
        self.clients = ClientLimits(options.client_limits)
        self.app = self._app()

    # -- lifecycle ----------------------------------------------------------------------

    def _uvicorn(self) -> Any:
        import uvicorn

        o = self.options
        config = uvicorn.Config(self.app, host=o.host, port=o.port, ws="websockets-sansio", lifespan="off",
                                log_level="warning", ws_max_size=4 * o.max_frame_bytes, ws_ping_interval=None,
                                forwarded_allow_ips=o.client_limits.proxies)  # X-Forwarded-For: clients.py
        return drainable_server(config, self.drain)

    def template(self) -> Any:
        """A graph of the served config, built once and never run: a new session's settings
        (``session.created``) come from its nodes until the session's own graph is built."""
        if self._template is None:
            self._template = self.make_graph()
        return self._template

    def preload(self) -> None:
        """Load every shared resource once now (and keep it), so the first caller waits for nothing."""
        graph = self.template()
        for spec in graph.nodes.values():
            node = spec.node
            if node.shared_key() is not None:
                node.ctx = Context(spec.name, self.run_dir)
                node.shared()

    def run(self) -> dict[str, Any]:
        """Serve until SIGINT/SIGTERM (uvicorn's handlers end it cleanly)."""
        with keep_shared():
            self.preload()
            _settle_gc()
            self._server = self._uvicorn()
            print(f"serving the graph at {self.options.serves}", flush=True)
            try:
                self._server.run(sockets=[self._sock] if self._sock else None)
            finally:
                _unsettle_gc()
        return {"sessions": self.sessions_run, "run_dir": str(self.run_dir)}

    def start(self) -> str:
        """Serve on a thread (tests): returns the WebSocket URL base (``ws://host:port/v1``)."""
        self._keep = keep_shared()
        self._keep.__enter__()
        self.preload()
        _settle_gc()
        if self._sock is None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((self.options.host, self.options.port))
        self._server = self._uvicorn()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="realtime-server", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the realtime server did not start")
            time.sleep(0.01)
        host, port = self._sock.getsockname()[:2]
        return f"ws://{host}:{port}/v1"

    def begin_drain(self) -> None:
        """What SIGTERM does (drain.py), for a server of ``start()`` (tests)."""
        if self._loop is None:
            raise RuntimeError("the server has served no request yet: nothing to drain on")
        self.drain.begin(self._loop, lambda: setattr(self._server, "should_exit", True))

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self._keep is not None:
            _unsettle_gc()
            self._keep.__exit__(None, None, None)
            self._keep = None

    # -- the ASGI app --------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import FileResponse, Response
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles
        from starlette.websockets import WebSocket

        from nodes.io.realtime.webrtc import WebRTCCalls

        calls = self.calls = WebRTCCalls(self, _Connection)

        async def page(request: Any) -> Any:
            return FileResponse(WEB / "page.html", headers={"Cache-Control": "no-cache"})

        async def metrics(request: Any) -> Any:
            return Response(self.metrics.text(), media_type=self.metrics.prom.CONTENT_TYPE_LATEST)

        site = Starlette(routes=[Route("/", page), Route("/metrics", metrics),
                                 Mount("/web", StaticFiles(directory=WEB)),
                                 Route("/v1/realtime/calls", calls.create, methods=["POST"]),
                                 Route("/v1/realtime/calls/{call_id}", calls.hang_up, methods=["DELETE"]),
                                 *self.drain.routes(self.admission, self.metrics)])

        async def app(scope: Any, receive: Any, send: Any) -> None:
            self._loop = asyncio.get_running_loop()
            if await self.guard.refused(scope, receive, send):
                return
            # The Realtime socket gets the server's own send(), not a middleware's wrapper: a
            # client that stops reading can only be dropped through its transport (_abort).
            path = scope.get("path")
            if scope["type"] == "websocket" and path == "/v1/realtime":
                await self._connection(WebSocket(scope, receive, send), send)
            elif scope["type"] == "websocket" and path == "/v1/twilio":
                o = self.options
                await self._connection(TwilioCall(WebSocket(scope, receive, send), voice=o.twilio_voice,
                                                  instructions=o.twilio_instructions), send)
            else:
                await site(scope, receive, send)

        return app

    def _authorized(self, ws: Any) -> tuple[bool, str | None]:
        """(allowed, subprotocol to accept). Bearer header, or the browser SDKs' subprotocol form."""
        offered = list(ws.scope.get("subprotocols") or [])
        subprotocol = "realtime" if "realtime" in offered else None
        key = self.options.api_key
        if not key:
            return True, subprotocol
        given = ws.headers.get("authorization", "")
        candidates = [given[7:].strip()] if given.lower().startswith("bearer ") else []
        candidates += [p.removeprefix("openai-insecure-api-key.") for p in offered
                       if p.startswith("openai-insecure-api-key.")]
        ok = any(hmac.compare_digest(c.encode(), key.encode()) for c in candidates)
        return ok, subprotocol

    async def _connection(self, ws: Any, send: Any) -> None:
        if isinstance(ws, TwilioCall):
            ok, subprotocol = ws.authorized(self.options.api_key, self.options.twilio_auth_token)
        else:
            ok, subprotocol = self._authorized(ws)
        if not ok:
            from starlette.responses import JSONResponse
            body = events.error("invalid_api_key", "missing or wrong API key: send Authorization: Bearer "
                                "<io.api_key>", type="authentication_error")
            try:
                await ws.send_denial_response(JSONResponse(body, status_code=401))
            except RuntimeError:  # a server without the denial-response extension
                await ws.close(code=1008)
            return
        await ws.accept(subprotocol=subprotocol)
        if await self.drain.turned_away(ws):
            return
        # per client address (clients.py), then by count and by load (admission.py): before any graph
        with self.clients.hold(ws.scope, limited=not isinstance(ws, TwilioCall)) as refusal:
            refused = refusal.code if refusal is not None else await self.admission.admit()
            if refused is not None:
                self.metrics.refused.labels(refused).inc()
                await (refusal or Refusal("session_limit_reached", self.admission.explain(refused),
                                          type="server_error")).tell(ws)
                return
            connection = _Connection(self, ws, send)
            self.admit(connection)
            try:
                await connection.serve()
            finally:
                self.release(connection)

    def admit(self, connection: Any) -> None:
        """A session begins (a WebSocket's, or a WebRTC call's): counted, drained on SIGTERM, and open
        until released."""
        self.open += 1
        self.sessions_run += 1
        self.metrics.sessions.inc()
        self.metrics.sessions_total.inc()
        self.sessions[connection.session.id] = connection.session
        self.admission.joined(connection.session.id)
        self.drain.add(connection)

    def release(self, connection: Any) -> None:
        self.drain.remove(connection)
        if self.sessions.pop(connection.session.id, None) is not None:
            self.open -= 1
            self.metrics.sessions.dec()
            self.admission.closed(connection.session.id)
            trim_memory_soon()  # what its buffers left free in the heap, back to the OS (limits.py)

    def observe(self, name: str, value: float, session: str | None = None) -> None:
        """A session's figure (its metrics callback, any thread): to /metrics and to admission."""
        if name == "voice_to_voice_s":
            self.admission.voice_to_voice(value, session)
        elif name == "turn" and self._loop is not None:  # a reply done: its buffers' pages back soon
            with contextlib.suppress(RuntimeError):  # the server's loop is gone: nothing to give back
                self._loop.call_soon_threadsafe(trim_memory_soon)
        self.metrics.observe(name, value)


class _Connection(Receiver):
    """One WebSocket: its session's graph on its threads, the frames in to the client-event handlers
    (receive.py's loop), the session's events out through a bounded queue."""

    #: the session's graph is built at the client's first event of the protocol, not at connect (a
    #: WebRTC call's microphone is its audio track, which sends no event: its graph is built at once)
    lazy_graph: ClassVar[bool] = True

    def __init__(self, server: RealtimeServer, ws: Any, send: Any) -> None:
        self.server, self.ws, self._send = server, ws, send
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.queued = 0  # bytes in self.out
        self.backlogged = False  # past io.max_queued_bytes once by the server's own delay (logged once)
        self.overflow = asyncio.Event()  # the client stopped reading: the session ends
        self.ended: tuple[int, str, str] | None = None  # the server closes the session: (close code, error, why)
        self.ending = asyncio.Event()
        self.rate = EventRate(server.options.max_events_per_s)
        self.session = Session(self._emit, SessionConfig(), observe=self._observe)
        self.handlers = ClientEvents(self.session, server.options.max_frame_bytes, first=self._start_graph)
        self._graph: tuple[Any, threading.Thread] | None = None  # the session's scheduler and its thread, once built
        self.done: asyncio.Future[BaseException | None] = self.loop.create_future()
        self.heard_at = time.monotonic()  # the client's last event

    def shut(self, message: str, code: int = 1001, error: str = "server_shutting_down") -> None:
        """The server closes this session (on its loop): it is told with an error event, then closed."""
        self.ended = (code, error, message)
        self.ending.set()

    def _observe(self, name: str, value: float) -> None:
        """The session's figures, to the server's metrics and admission, named by the session."""
        self.server.observe(name, value, self.session.id)

    def _emit(self, text: str) -> None:
        """Session.send, from any thread: onto the loop, into the bounded queue."""
        try:
            self.loop.call_soon_threadsafe(self._enqueue, text)
        except RuntimeError:  # the server's loop is gone: nobody to tell
            self.session.closed = True

    def _enqueue(self, text: str) -> None:
        if self.overflow.is_set():
            return
        if self.queued + len(text) > self.server.options.max_queued_bytes:
            if not_reading(transport_of(self._send), self.queued, self.server.options.max_queued_bytes):
                log.warning("session %s: the client does not read its events (%d bytes waiting): closing it",
                            self.session.id, self.queued)
                self.session.closed = True
                self.overflow.set()
                return
            if not self.backlogged:
                self.backlogged = True
                log.info("session %s: %d bytes wait for the server's loop, over io.max_queued_bytes, while the "
                         "client reads all it is sent: kept", self.session.id, self.queued)
        self.queued += len(text)
        self.out.put_nowait(text)

    def _start_graph(self) -> None:
        """The session's graph, built and started at its client's first event of the protocol (a
        connection that sends nothing valid, or nothing, costs none)."""
        from s2s_flow.scheduler import Scheduler

        if self._graph is not None:
            return
        server, session = self.server, self.session
        graph = server.make_graph()
        session.nodes.bind(graph)
        run_dir = server.run_dir / "sessions" / session.id
        # the server settles the collector; the session decides for its nodes (ctx.session)
        scheduler = Scheduler(graph, run_dir, own_gc=False, session=session)
        thread = threading.Thread(target=self._run_graph, args=(scheduler, graph, run_dir),
                                  name=f"session:{session.id}", daemon=True)
        self._graph = (scheduler, thread)
        thread.start()

    async def serve(self) -> None:
        session = self.session
        session.nodes.bind(self.server.template())  # what it is told it has, until its own graph is built
        bound_send_buffer(transport_of(self._send))
        session.send(events.session_created(session.config.to_event(session.id)))
        sender = asyncio.create_task(self._sender())
        if not self.lazy_graph:
            self._start_graph()
        try:
            await self._receive()
        finally:
            if self._graph is not None:
                self._graph[0].stop("the client left")
            session.close_input()
            session.tools.release("cancelled: the client left")
            error = None
            if self._graph is not None:
                error = await self.done
                self._graph[1].join()
            if self.overflow.is_set():
                sender.cancel()
                self.out = asyncio.Queue()  # what it did not read is let go now
                self.server.metrics.dropped.labels("send_queue_full").inc()
                await self._drop(1008, "send_queue_full", events.error(
                    "send_queue_full", f"the client did not read its events: over io.max_queued_bytes="
                    f"{self.server.options.max_queued_bytes} were waiting, so the session was closed; read "
                    "events as they come", type="server_error"))
            else:
                if error is not None:
                    session.fail_unfinished(f"the session's graph failed: {error}")
                    session.send(events.error("server_error", f"the session's graph failed: {error}",
                                              type="server_error"))
                elif self.ended is not None:  # counted as s2s_sessions_dropped_total{reason=rate_limited|...}
                    self.server.metrics.dropped.labels(self.ended[1]).inc()
                    session.fail_unfinished(self.ended[2])
                    session.send(events.error(self.ended[1], self.ended[2], type="server_error"))
                session.closed = True
                # the end marker queues behind the events already on their way (Session.send goes
                # through the loop): the failed response and the error reach the client first
                self.loop.call_soon(self.out.put_nowait, None)
                await sender
                await self._close(self.ended[0] if self.ended is not None else 1000)

    def _run_graph(self, scheduler: Any, graph: Any, run_dir: Path) -> None:
        from s2s_flow import metrics
        from s2s_flow.errors import Stopped

        error: BaseException | None = None
        try:
            scheduler.run()
        except Stopped:
            pass
        except BaseException as exc:  # reported to the client, logged, never raised into the server
            error = exc
            log.error("session %s failed: %s", self.session.id, exc)
        try:
            if scheduler.trace.turns():
                run_dir.mkdir(parents=True, exist_ok=True)
                metrics.write(metrics.report(scheduler.trace, scheduler.ring_stats, graph), run_dir)
        except Exception as exc:
            log.warning("session %s: metrics not written: %s", self.session.id, exc)
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._graph_done, error)

    def _graph_done(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(error)

    async def _sender(self) -> None:
        while True:
            text = await self.out.get()
            if text is None:
                return
            try:
                await self.ws.send_text(text)
            except Exception:  # the client is gone; the receive side ends the session
                self.session.closed = True
                return
            self.queued -= len(text)

    async def _close(self, code: int = 1000) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close(code=code)

    async def _drop(self, code: int, reason: str, error: dict[str, Any]) -> None:
        """Close a client that does not read: it gets the error event and the close frame if it reads
        them; if what was written to it is still unsent after CLOSE_GRACE_S, its transport is aborted
        (a close would wait for the client forever, holding the socket)."""
        async def tell() -> None:
            await self.ws.send_text(events.encode(error))
            await self.ws.close(code=code, reason=reason)

        transport = transport_of(self._send)
        if transport is not None:
            self.loop.call_later(CLOSE_GRACE_S, abort_unless_sent, transport)
        else:
            log.warning("session %s: the ASGI server keeps no transport on its send(): a client that does not read "
                        "may hold its socket", self.session.id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(tell(), CLOSE_GRACE_S)
