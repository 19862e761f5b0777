"""The ``io=realtime`` server: Starlette on uvicorn (``websockets``), one graph per connection.

Routes: ``/v1/realtime`` (the OpenAI Realtime WebSocket), ``/metrics`` (Prometheus text:
sessions open, turns, voice-to-voice), ``/`` (a browser client). Each connection builds a
fresh graph from the composed config (cheap: ``__init__`` only), binds the session to its
source and sink, and runs it with its own Scheduler on its own threads; models come from
the process-wide cache (``Node.shared()``), kept warm here for the server's lifetime.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    response_modalities,
)
from nodes.io.realtime import RealtimeSink, RealtimeSource, Response, Session
from s2s_flow.node import Context, keep_shared, require

__all__ = ["RealtimeServer"]

log = logging.getLogger("s2s_flow.realtime")
PAGE = Path(__file__).with_name("realtime_page.html")


class _Metrics:
    """Prometheus figures of one server (its own registry: several servers in one process)."""

    def __init__(self) -> None:
        prom = require("prometheus_client", "serve", pip_name="prometheus-client")
        self.prom = prom
        self.registry = prom.CollectorRegistry()
        self.sessions = prom.Gauge("s2s_sessions_open", "Realtime sessions open now", registry=self.registry)
        self.sessions_total = prom.Counter("s2s_sessions", "Realtime sessions accepted", registry=self.registry)
        self.turns = prom.Counter("s2s_turns", "Replies completed", registry=self.registry)
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
            self._server = self._uvicorn()
            print(f"serving the graph at {self.options.serves}", flush=True)
            self._server.run(sockets=[self._sock] if self._sock else None)
        return {"sessions": self.sessions_run, "run_dir": str(self.run_dir)}

    def start(self) -> str:
        """Serve on a thread (tests): returns the WebSocket URL base (``ws://host:port/v1``)."""
        self._keep = keep_shared()
        self._keep.__enter__()
        self.preload()
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
            self._keep.__exit__(None, None, None)
            self._keep = None

    # -- the ASGI app --------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import HTMLResponse, Response
        from starlette.routing import Route, WebSocketRoute

        async def page(request: Any) -> Any:
            return HTMLResponse(PAGE.read_text(encoding="utf-8") if PAGE.is_file() else "<p>s2s-flow</p>")

        async def metrics(request: Any) -> Any:
            return Response(self.metrics.text(), media_type=self.metrics.prom.CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/", page), Route("/metrics", metrics),
                                 WebSocketRoute("/v1/realtime", self._connection)])

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

    async def _connection(self, ws: Any) -> None:
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
        try:
            await _Connection(self, ws).serve()
        finally:
            self.open -= 1
            self.metrics.sessions.dec()


class _Connection:
    """One WebSocket: its session, its graph on its threads, and the client's events."""

    def __init__(self, server: RealtimeServer, ws: Any) -> None:
        self.server, self.ws = server, ws
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.session = Session(self.loop, self.out, SessionConfig(), observe=server.metrics.observe)
        self.pending_text: list[str] = []
        self.done: asyncio.Future[BaseException | None] = self.loop.create_future()

    async def serve(self) -> None:
        from s2s_flow.scheduler import Scheduler

        server, session = self.server, self.session
        graph = server.make_graph()
        for spec in graph.nodes.values():
            if isinstance(spec.node, (RealtimeSource, RealtimeSink)):
                spec.node.session = session
            elif hasattr(spec.node, "conversation") and session.llm is None:
                session.llm = spec.node
        if session.llm is not None:
            session.config.instructions = session.llm.conversation.system_prompt
        run_dir = server.run_dir / "sessions" / session.id
        scheduler = Scheduler(graph, run_dir)
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
            if error is not None:
                session.send(error_event("server_error", f"the session's graph failed: {error}", type="server_error"))
            session.closed = True
            self.out.put_nowait(None)
            await sender
            await self._close()

    def _run_graph(self, scheduler: Any, graph: Any, run_dir: Path) -> None:
        from s2s_flow import metrics
        from s2s_flow.scheduler import Stopped

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

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def _receive(self) -> None:
        """Client events until the client leaves, stays idle too long, or the graph ends."""
        idle = self.server.options.idle_timeout_s
        recv: asyncio.Task | None = None
        try:
            while True:
                if recv is None:
                    recv = asyncio.ensure_future(self.ws.receive())
                finished, _ = await asyncio.wait({recv, self.done}, timeout=idle,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    self.session.send(error_event("idle_timeout", f"no client event for {idle:g} s "
                                                  "(io.idle_timeout_s): the session ends", type="server_error"))
                    return
                if recv not in finished:  # the graph ended (failed): the finally block reports it
                    return
                message, recv = recv.result(), None
                if message["type"] == "websocket.disconnect":
                    return
                self._frame(message)
        finally:
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
            raw = decode_pcm16(event.get("audio"))
            if not session.put(("audio", raw, session.config.input_rate, time.monotonic())):
                raise ProtocolError("input_overflow", "the server is behind on this session's audio: this append "
                                    "was dropped", type="server_error")
        elif kind == "session.update":
            update = event.get("session")
            if isinstance(update, dict) and ("tools" in update or "tool_choice" in update):
                session.set_tools(update.get("tools", session.config.tools), update.get("tool_choice"))
            session.config.update(update)
            if "instructions" in (event.get("session") or {}):
                session.set_instructions(session.config.instructions)
            session.send({"type": "session.updated", "session": session.config.to_event(session.id)})
        elif kind == "input_audio_buffer.clear":
            session.put(("clear",))
            session.send({"type": "input_audio_buffer.cleared"})
        elif kind == "conversation.item.create":
            self._item(event.get("item"), event.get("previous_item_id"))
        elif kind == "response.create":
            self._respond(event.get("response") or {})
        elif kind == "response.cancel":
            if not session.active():
                raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
            session.put(("cancel",))
        elif kind == "conversation.item.truncate":
            self._truncate(event)
        elif kind == "output_audio_buffer.clear":
            pass  # WebRTC only; over WebSocket the client owns its playback buffer
        else:
            raise ProtocolError("unsupported_event", f"{kind} is not supported by this server yet")

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
        self.pending_text.append(text)
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("item")
        prev = self.session.add_item(item_id)
        full = message_item(item_id, "user", [{"type": "input_text", "text": text}])
        self.session.send({"type": "conversation.item.added", "previous_item_id": prev, "item": full})
        self.session.send({"type": "conversation.item.done", "previous_item_id": prev, "item": full})

    def _respond(self, response: Any) -> None:
        if not isinstance(response, dict):
            raise ProtocolError("invalid_value", "response.create's 'response' must be an object", param="response")
        session = self.session
        if session.active():
            raise ProtocolError("conversation_already_has_active_response", "a response is in progress: cancel it "
                                "(response.cancel) or wait for response.done")
        waiting = session.waiting_calls()
        if waiting:  # a client tool's answer: the same turn goes on, in a new response
            resp = Response(new_id("resp"), modalities=response_modalities(response, session.config))
            session.begin(waiting[0].turn, resp)
            session.release_calls()
            return
        if not self.pending_text:
            raise ProtocolError("unsupported_value", "response.create needs a new user message here "
                                "(conversation.item.create with input_text); spoken turns are answered by "
                                "themselves")
        modalities = response_modalities(response, session.config)
        text, self.pending_text = "\n".join(self.pending_text), []
        resp = Response(new_id("resp"), modalities=modalities)
        with session.lock:
            session.asked.append(resp)
        if not session.put(("respond", text, resp)):
            with session.lock:
                session.asked.remove(resp)
            raise ProtocolError("input_overflow", "the server is behind on this session", type="server_error")

    def _tool_output(self, item: dict[str, Any]) -> None:
        call = self.session.calls.get(item.get("call_id"))  # type: ignore[arg-type]
        if call is None or call.answered.is_set():
            raise ProtocolError("item_not_found", f"no function call {item.get('call_id')!r} is waiting for output",
                                param="item.call_id")
        output = item.get("output")
        call.output = output if isinstance(output, str) else json.dumps(output)
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("item")
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
