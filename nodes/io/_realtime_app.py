"""The ``io=realtime`` server: Starlette on uvicorn (``websockets``), one graph per connection.

Routes: ``/v1/realtime`` (the OpenAI Realtime WebSocket), ``/metrics`` (Prometheus text:
sessions open, turns, voice-to-voice), ``/`` (a browser client). Each connection builds a
fresh graph from the composed config (cheap: ``__init__`` only), binds the session to its
source, sink, VAD and LLM, and runs it with its own Scheduler on its own threads; models come
from the process-wide cache (``Node.shared()``), kept warm here for the server's lifetime.

What waits for a client is bounded: its events in ``io.max_queued_bytes`` (a client that stops
reading is told, closed with 1008, and its connection dropped if it still does not read).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodes.io._realtime_events import (
    CLIENT_EVENTS,
    ProtocolError,
    SessionConfig,
    decode_pcm16,
    error_event,
    message_item,
    new_id,
    response_instructions,
    response_modalities,
)
from nodes.io._realtime_session import Pending, Response, Session
from nodes.io.realtime import RealtimeSink, RealtimeSource, fit_vad_settings, vad_turn_settings
from nodes.tts._base import SentenceTTS
from s2s_flow.messages import Speech, SpeechStarted
from s2s_flow.node import Context, keep_shared, require

__all__ = ["RealtimeServer"]

log = logging.getLogger("s2s_flow.realtime")
PAGE = Path(__file__).with_name("realtime_page.html")
CLOSE_GRACE_S = 5.0  # a client closed for not reading gets this long to read its error and the close
MIN_COMMIT_MS = 100  # input_audio_buffer.commit needs this much audio (as OpenAI's does)
MAX_BUFFER_S = 300  # manual turns: the input audio buffer holds at most this much before a commit


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


class _Metrics:
    """Prometheus figures of one server (its own registry: several servers in one process)."""

    def __init__(self) -> None:
        prom = require("prometheus_client", "serve", pip_name="prometheus-client")
        self.prom = prom
        self.registry = prom.CollectorRegistry()
        self.sessions = prom.Gauge("s2s_sessions_open", "Realtime sessions open now", registry=self.registry)
        self.sessions_total = prom.Counter("s2s_sessions", "Realtime sessions accepted", registry=self.registry)
        self.turns = prom.Counter("s2s_turns", "Replies completed", registry=self.registry)
        self.dropped = prom.Counter("s2s_sessions_dropped", "Sessions the server closed", ["reason"],
                                    registry=self.registry)
        self.v2v = prom.Histogram("s2s_voice_to_voice_seconds", "User's end of speech to the first reply audio "
                                  "sent", registry=self.registry,
                                  buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0))

    def observe(self, name: str, value: float) -> None:
        if name == "turn":
            self.turns.inc()
        elif name == "voice_to_voice_s":
            self.v2v.observe(value)

    def text(self) -> bytes:
        return self.prom.generate_latest(self.registry)


class RealtimeServer:
    """Serves ``make_graph()`` per connection. ``run()`` blocks (s2s-run); tests use
    ``start()`` / ``stop()``, which run uvicorn on a thread."""

    def __init__(self, make_graph: Callable[[], Any], options: RealtimeSource, run_dir: Path | str,
                 *, console: Any = None, sock: socket.socket | None = None) -> None:
        require("starlette", "serve")
        require("uvicorn", "serve")
        require("websockets", "serve")
        self.make_graph, self.options, self.run_dir = make_graph, options, Path(run_dir)
        self.console = console
        self.metrics = _Metrics()
        self.open = 0
        self.sessions_run = 0
        self.sessions: dict[str, Session] = {}  # the sessions open now, by id
        self._sock = sock
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._keep: Any = None
        self.app = self._app()

    # -- lifecycle ----------------------------------------------------------------------

    def _uvicorn(self) -> Any:
        import uvicorn

        o = self.options
        config = uvicorn.Config(self.app, host=o.host, port=o.port, ws="websockets-sansio", lifespan="off",
                                log_level="warning", ws_max_size=4 * o.max_frame_bytes, ws_ping_interval=None)
        return uvicorn.Server(config)

    def preload(self) -> None:
        """Load every shared resource once now (and keep it), so the first caller waits for nothing."""
        graph = self.make_graph()
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
        from starlette.responses import HTMLResponse, Response
        from starlette.routing import Route

        async def page(request: Any) -> Any:
            return HTMLResponse(PAGE.read_text(encoding="utf-8") if PAGE.is_file() else "<p>s2s-flow</p>")

        async def metrics(request: Any) -> Any:
            return Response(self.metrics.text(), media_type=self.metrics.prom.CONTENT_TYPE_LATEST)

        from starlette.websockets import WebSocket

        site = Starlette(routes=[Route("/", page), Route("/metrics", metrics)])

        async def app(scope: Any, receive: Any, send: Any) -> None:
            # The Realtime socket gets the server's own send(), not a middleware's wrapper: a
            # client that stops reading can only be dropped through its transport (_abort).
            if scope["type"] == "websocket" and scope.get("path") == "/v1/realtime":
                await self._connection(WebSocket(scope, receive, send), send)
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
        ok, subprotocol = self._authorized(ws)
        if not ok:
            from starlette.responses import JSONResponse

            body = error_event("invalid_api_key", "missing or wrong API key: send Authorization: Bearer <io.api_key>",
                               type="authentication_error")
            try:
                await ws.send_denial_response(JSONResponse(body, status_code=401))
            except RuntimeError:  # a server without the denial-response extension
                await ws.close(code=1008)
            return
        await ws.accept(subprotocol=subprotocol)
        if self.open >= self.options.max_sessions:
            await ws.send_text(json.dumps({"event_id": new_id("event"), **error_event(
                "session_limit_reached", f"the server holds {self.options.max_sessions} sessions "
                "(io.max_sessions); try again later", type="server_error")}))
            await ws.close(code=1008, reason="session_limit_reached")
            return
        self.open += 1
        self.sessions_run += 1
        self.metrics.sessions.inc()
        self.metrics.sessions_total.inc()
        connection = _Connection(self, ws, send)
        self.sessions[connection.session.id] = connection.session
        try:
            await connection.serve()
        finally:
            del self.sessions[connection.session.id]
            self.open -= 1
            self.metrics.sessions.dec()


class _Connection:
    """One WebSocket: its session, its graph on its threads, and the client's events."""

    def __init__(self, server: RealtimeServer, ws: Any, send: Any) -> None:
        self.server, self.ws, self._send = server, ws, send
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.queued = 0  # bytes in self.out
        self.overflow = asyncio.Event()  # the client stopped reading: the session ends
        self.session = Session(self._emit, SessionConfig(), observe=server.metrics.observe)
        self.buffered = 0  # manual turns: samples appended since the last commit or clear
        self.done: asyncio.Future[BaseException | None] = self.loop.create_future()

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
            log.warning("session %s: the client does not read its events (%d bytes waiting): closing it",
                        self.session.id, self.queued)
            self.session.closed = True
            self.overflow.set()
            return
        self.queued += len(text)
        self.out.put_nowait(text)

    async def serve(self) -> None:
        from s2s_flow.scheduler import Scheduler

        server, session = self.server, self.session
        graph = server.make_graph()
        self._bind(graph)
        run_dir = server.run_dir / "sessions" / session.id
        # the server settles the collector; the session decides for its nodes (ctx.session)
        scheduler = Scheduler(graph, run_dir, own_gc=False, session=session)
        thread = threading.Thread(target=self._run_graph, args=(scheduler, graph, run_dir),
                                  name=f"session:{session.id}", daemon=True)
        session.send({"type": "session.created", "session": session.config.to_event(session.id)})
        sender = asyncio.create_task(self._sender())
        thread.start()
        try:
            await self._receive()
        finally:
            scheduler.stop("the client left")
            session.close_input()
            session.release_calls("cancelled: the client left")
            error = await self.done
            thread.join()
            if self.overflow.is_set():
                sender.cancel()
                self.out = asyncio.Queue()  # what it did not read is let go now
                self.server.metrics.dropped.labels("send_queue_full").inc()
                await self._drop(1008, "send_queue_full", error_event(
                    "send_queue_full", f"the client did not read its events: over io.max_queued_bytes="
                    f"{self.server.options.max_queued_bytes} were waiting, so the session was closed; read "
                    "events as they come", type="server_error"))
            else:
                if error is not None:
                    session.fail_unfinished(f"the session's graph failed: {error}")
                    session.send(error_event("server_error", f"the session's graph failed: {error}",
                                             type="server_error"))
                session.closed = True
                # the end marker queues behind the events already on their way (Session.send goes
                # through the loop): the failed response and the error reach the client first
                self.loop.call_soon(self.out.put_nowait, None)
                await sender
                await self._close()

    def _bind(self, graph: Any) -> None:
        """Bind the session to the nodes of its graph that talk to it."""
        session = self.session
        llm_name = None
        for name, spec in graph.nodes.items():
            node = spec.node
            if isinstance(node, (RealtimeSource, RealtimeSink)):
                node.session = session
            elif SpeechStarted in spec.cls.outputs.values() and session.vad is None:
                session.vad = node
            elif hasattr(node, "conversation") and session.llm is None:
                session.llm = node
                llm_name = name
            elif isinstance(node, SentenceTTS) and session.tts is None:
                session.tts = node
                session.config.voice = node.voice_name
        session.hears_audio = any(e.dst == llm_name and issubclass(e.type, Speech) for e in graph.edges)
        if session.llm is not None:
            session.config.instructions = session.llm.conversation.system_prompt
        settings = vad_turn_settings(session.vad)
        if settings is not None and session.config.turn_detection is not None:
            session.config.turn_detection.update(settings)  # what the server's VAD really does
            session.config.server_vad = dict(session.config.turn_detection)

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

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def _drop(self, code: int, reason: str, error: dict[str, Any]) -> None:
        """Close a client that does not read: it gets the error event and the close frame if it reads
        them; if what was written to it is still unsent after CLOSE_GRACE_S, its transport is aborted
        (a close would wait for the client forever, holding the socket)."""
        async def tell() -> None:
            await self.ws.send_text(json.dumps({"event_id": new_id("event"), **error}))
            await self.ws.close(code=code, reason=reason)

        transport = _transport(self._send)
        if transport is not None:
            self.loop.call_later(CLOSE_GRACE_S, _abort_unless_sent, transport)
        else:
            log.warning("session %s: the ASGI server keeps no transport on its send(): a client that does not read "
                        "may hold its socket", self.session.id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(tell(), CLOSE_GRACE_S)

    async def _receive(self) -> None:
        """Client events until the client leaves, stays idle too long, or the graph ends."""
        idle = self.server.options.idle_timeout_s
        recv: asyncio.Task | None = None
        overflow = asyncio.ensure_future(self.overflow.wait())
        try:
            while True:
                if recv is None:
                    recv = asyncio.ensure_future(self.ws.receive())
                finished, _ = await asyncio.wait({recv, self.done, overflow}, timeout=idle,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    self.session.send(error_event("idle_timeout", f"no client event for {idle:g} s "
                                                  "(io.idle_timeout_s): the session ends", type="server_error"))
                    return
                if recv not in finished:  # the graph ended (failed), or the client stopped reading
                    return
                message, recv = recv.result(), None
                if message["type"] == "websocket.disconnect":
                    return
                self._frame(message)
        finally:
            overflow.cancel()
            if recv is not None:
                recv.cancel()

    def _frame(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            self.session.send(error_event("invalid_frame", "binary frames are not part of the protocol: send "
                                          "JSON events as text frames"))
            return
        limit = self.server.options.max_frame_bytes
        if len(text) > limit:
            self.session.send(error_event("frame_too_large", f"a {len(text)}-byte event is over io.max_frame_bytes"
                                          f"={limit}: send audio in smaller appends (e.g. 20-100 ms each)"))
            return
        try:
            event = json.loads(text)
        except ValueError as exc:
            self.session.send(error_event("invalid_json", f"the event is not JSON: {exc}"))
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.session.send(error_event("invalid_event", "an event is a JSON object with a 'type'"))
            return
        client_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        try:
            self._event(event)
        except ProtocolError as exc:
            self.session.send(error_event(exc.code, exc.message, client_event_id=client_id, param=exc.param,
                                          type=exc.type))

    # -- client events -------------------------------------------------------------------

    def _event(self, event: dict[str, Any]) -> None:
        kind, session = event["type"], self.session
        if kind not in CLIENT_EVENTS:
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}; this server knows "
                                f"{', '.join(sorted(CLIENT_EVENTS))}", param="type")
        if kind == "input_audio_buffer.append":
            self._append(decode_pcm16(event.get("audio")))
        elif kind == "session.update":
            self._update(event.get("session"))
        elif kind == "input_audio_buffer.commit":
            self._commit()
        elif kind == "input_audio_buffer.clear":
            self.buffered = 0
            session.put(("clear",))
            session.send({"type": "input_audio_buffer.cleared"})
        elif kind == "conversation.item.create":
            self._item(event.get("item"), event.get("previous_item_id"))
        elif kind == "conversation.item.delete":
            item_id = event.get("item_id")
            if not isinstance(item_id, str):
                raise ProtocolError("invalid_value", "conversation.item.delete needs an 'item_id'", param="item_id")
            session.delete(item_id)
        elif kind == "response.create":
            self._respond(event.get("response") or {})
        elif kind == "response.cancel":
            self._cancel()
        elif kind == "conversation.item.truncate":
            self._truncate(event)
        elif kind == "output_audio_buffer.clear":
            pass  # WebRTC only; over WebSocket the client owns its playback buffer
        else:
            raise ProtocolError("unsupported_event", f"{kind} is not supported by this server yet")

    def _append(self, raw: bytes) -> None:
        session = self.session
        if session.config.manual:
            limit = MAX_BUFFER_S * session.config.input_rate
            if self.buffered + len(raw) // 2 > limit:
                raise ProtocolError("input_audio_buffer_full", f"the input audio buffer holds {MAX_BUFFER_S} s: "
                                    "commit it (input_audio_buffer.commit) or clear it first")
        if not session.put(("audio", raw, session.config.input_rate, time.monotonic())):
            raise ProtocolError("input_overflow", "the server is behind on this session's audio: this append "
                                "was dropped", type="server_error")
        if session.config.manual:
            self.buffered += len(raw) // 2

    def _update(self, update: Any) -> None:
        session, config = self.session, self.session.config
        if isinstance(update, dict) and ("tools" in update or "tool_choice" in update):
            session.set_tools(update.get("tools", config.tools), update.get("tool_choice"))
        before = config.turn_detection
        config.update(update, fit=lambda new: fit_vad_settings(session.vad, before, new), voice=session.use_voice)
        if config.turn_detection != before:
            self.buffered = 0
            if not session.put(("turns", config.turn_detection and dict(config.turn_detection))):
                raise ProtocolError("input_overflow", "the server is behind on this session: send the "
                                    "session.update again", type="server_error")
        if "instructions" in update:
            session.set_instructions(config.instructions)
        session.send({"type": "session.updated", "session": config.to_event(session.id)})

    def _commit(self) -> None:
        """input_audio_buffer.commit: with manual turns, what was appended is the user's turn."""
        session = self.session
        if not session.config.manual:
            raise ProtocolError("unsupported_value", "with turn_detection server_vad the VAD commits the user's "
                                "turns itself; set session.audio.input.turn_detection to null to commit them by hand")
        rate = session.config.input_rate
        if self.buffered < MIN_COMMIT_MS * rate // 1000:
            raise ProtocolError("input_audio_buffer_commit_empty", f"buffer too small: expected at least "
                                f"{MIN_COMMIT_MS} ms of audio, got {1000 * self.buffered // rate} ms")
        if not session.put(("commit",)):
            raise ProtocolError("input_overflow", "the server is behind on this session: commit again",
                                type="server_error")
        self.buffered = 0

    def _cancel(self) -> None:
        session = self.session
        if not session.active():
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
        with session.lock:  # asked for, still waiting for its transcripts: it never starts
            waiting = [r for r in session.asked if not r.dispatched]
            for resp in waiting:
                session.asked.remove(resp)
                resp.done = True
        for resp in waiting:
            session.send({"type": "response.created", "response": resp.as_response("in_progress", output=False)})
            session.send({"type": "response.done", "response": resp.as_response(
                "cancelled", {"type": "cancelled", "reason": "client_cancelled"}, output=False)})
        session.put(("cancel",))

    def _item(self, item: Any, previous: Any) -> None:
        if not isinstance(item, dict):
            raise ProtocolError("invalid_value", "conversation.item.create needs an 'item' object", param="item")
        if item.get("type") == "function_call_output":
            self._tool_output(item)
            return
        if item.get("type", "message") != "message" or item.get("role") != "user":
            raise ProtocolError("unsupported_value", "conversation.item.create: only user messages (input_text) are "
                                "supported by this server yet", param="item.type")
        content = item.get("content")
        texts = [c.get("text") for c in content or () if isinstance(c, dict) and c.get("type") == "input_text"]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("invalid_value", "a user message needs content [{'type': 'input_text', 'text': "
                                "...}]", param="item.content")
        text = " ".join(texts).strip()
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("item")
        session = self.session
        prev = session.add_item(item_id)
        with session.lock:
            session.pending.append(Pending(item_id, text=text, ready=True))
        full = message_item(item_id, "user", [{"type": "input_text", "text": text}])
        session.send({"type": "conversation.item.added", "previous_item_id": prev, "item": full})
        session.send({"type": "conversation.item.done", "previous_item_id": prev, "item": full})

    def _respond(self, response: Any) -> None:
        if not isinstance(response, dict):
            raise ProtocolError("invalid_value", "response.create's 'response' must be an object", param="response")
        session = self.session
        if session.active():
            raise ProtocolError("conversation_already_has_active_response", "a response is in progress: cancel it "
                                "(response.cancel) or wait for response.done")
        resp = Response(new_id("resp"), modalities=response_modalities(response, session.config),
                        instructions=response_instructions(response))
        waiting = session.waiting_calls()
        if waiting:  # a client tool's answer: the same turn goes on, in a new response
            session.begin(waiting[0].turn, resp)
            session.release_calls()
            return
        with session.lock:
            nothing = not session.pending
        if nothing:
            raise ProtocolError("unsupported_value", "response.create answers new user messages: add one "
                                "(conversation.item.create with input_text), or speak (with turn_detection."
                                "create_response=false or null, a spoken turn waits for response.create)")
        session.ask(resp)

    def _tool_output(self, item: dict[str, Any]) -> None:
        call = self.session.calls.get(item.get("call_id"))  # type: ignore[arg-type]
        if call is None or call.answered.is_set():
            raise ProtocolError("item_not_found", f"no function call {item.get('call_id')!r} is waiting for output",
                                param="item.call_id")
        output = item.get("output")
        call.output = output if isinstance(output, str) else json.dumps(output)
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("item")
        call.output_item = item_id
        full = {"id": item_id, "object": "realtime.item", "type": "function_call_output", "call_id": call.call_id,
                "output": call.output, "status": "completed"}
        prev = self.session.add_item(item_id)
        self.session.send({"type": "conversation.item.added", "previous_item_id": prev, "item": full})
        self.session.send({"type": "conversation.item.done", "previous_item_id": prev, "item": full})

    def _truncate(self, event: dict[str, Any]) -> None:
        item_id, end_ms = event.get("item_id"), event.get("audio_end_ms")
        resp = self.session.by_item.get(item_id) if isinstance(item_id, str) else None
        if resp is None:
            raise ProtocolError("item_not_found", f"no assistant item {item_id!r} in this conversation",
                                param="item_id")
        if not isinstance(end_ms, int) or end_ms < 0:
            raise ProtocolError("invalid_value", "audio_end_ms must be a whole number of milliseconds >= 0",
                                param="audio_end_ms")
        if end_ms > resp.audio_ms + 1:
            raise ProtocolError("invalid_value", f"audio_end_ms={end_ms} is past the {resp.audio_ms:.0f} ms of "
                                "audio sent for this item", param="audio_end_ms")
        heard = resp.heard(end_ms)
        if self.session.playback is not None:
            self.session.playback.set_heard(resp.turn, heard, played_s=end_ms / 1000, t=time.monotonic())
        self.session.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                           "audio_end_ms": end_ms})


def _transport(send: Any) -> Any:
    """The connection's transport, through the ASGI server's ``send``: uvicorn's protocols are what
    ``send`` is bound to and keep it as ``transport`` (the only handle on a client's socket)."""
    return getattr(getattr(send, "__self__", None), "transport", None)


def _abort_unless_sent(transport: Any) -> None:
    """Data still waits in user space for a client that does not read: drop the connection."""
    if not transport.is_closing() or transport.get_write_buffer_size():
        transport.abort()
