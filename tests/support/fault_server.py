"""A scripted HTTP server on 127.0.0.1 for the faults a real LLM server won't produce on demand.

Real sockets, one thread per connection, HTTP/1.1 keep-alive. Each request takes its path's
route, else the next scripted :class:`Reply` (the last one repeats); each one is recorded::

    with FaultServer() as srv:
        srv.script(Reply.status(500), Reply.sse(chat_chunks("Hello.")))
        ... client at srv.base_url ...
        assert len(srv.requests) == 2

Replies: a JSON status answer (with headers such as Retry-After), an SSE stream (optionally
slow, dropped mid-way, or with raw garbage lines), and a first byte that comes late.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FaultServer", "Reply", "Recorded", "chat_chunks", "responses_events"]


@dataclass
class Reply:
    status_code: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    events: Sequence[bytes] | None = None  # SSE: raw lines/blocks, each sent as one chunk
    delay_s: float = 0.0  # before the status line (first byte)
    gap_s: float = 0.0  # between events
    drop_after: int | None = None  # close the socket after this many events, mid-body
    hangup: bool = False  # close the connection without any answer (a stale keep-alive one)

    @classmethod
    def status(cls, code: int, body: Any = None, **headers: str) -> Reply:
        payload = {"error": {"message": f"scripted {code}", "code": code}} if body is None else body
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return cls(code, raw, {"Content-Type": "application/json", **_header_names(headers)})

    @classmethod
    def json(cls, payload: Any, **kw: Any) -> Reply:
        return cls(200, json.dumps(payload).encode(), {"Content-Type": "application/json"}, **kw)

    @classmethod
    def sse(cls, events: Iterable[bytes | str | dict], **kw: Any) -> Reply:
        return cls(200, b"", {"Content-Type": "text/event-stream"}, events=[_sse(e) for e in events], **kw)


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    client: tuple[str, int]  # the client's (host, port): one per connection
    t: float


class FaultServer:
    """Threaded loopback server; ``base_url`` ends in ``/v1`` like a real one's API root."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self._replies: list[Reply] = [Reply.status(404)]
        #: fixed answers by path suffix, before the script: ``/models`` serves the clients' warm-up
        self.routes: dict[str, Reply] = {
            "/models": Reply.json({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        }
        self._lock = threading.Lock()
        self.disconnected = threading.Event()  # the client went away during a streamed body
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self)

            def do_POST(self) -> None:
                server._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.02,), name="fault-server", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    @property
    def posts(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST"]

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._replies = list(replies)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _next(self) -> Reply:
        with self._lock:
            return self._replies.pop(0) if len(self._replies) > 1 else self._replies[0]

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        with self._lock:
            self.requests.append(
                Recorded(h.command, h.path, dict(h.headers.items()), body, h.client_address, time.monotonic())
            )
        route = next((r for suffix, r in self.routes.items() if h.path.endswith(suffix)), None)
        reply = route or self._next()
        if reply.delay_s and self.stop.wait(reply.delay_s):
            return
        if reply.hangup:
            h.close_connection = True
            h.connection.shutdown(2)
            return
        try:
            h.send_response(reply.status_code)
            for k, v in reply.headers.items():
                h.send_header(k, v)
            if reply.events is None:
                h.send_header("Content-Length", str(len(reply.body)))
                h.end_headers()
                h.wfile.write(reply.body)
                return
            h.send_header("Transfer-Encoding", "chunked")
            h.send_header("Cache-Control", "no-cache")
            h.end_headers()
            h.wfile.flush()
            for i, event in enumerate(reply.events):
                if reply.drop_after is not None and i >= reply.drop_after:
                    h.close_connection = True
                    h.wfile.flush()
                    h.connection.shutdown(2)  # mid-body: no terminating chunk
                    return
                if i and reply.gap_s and self.stop.wait(reply.gap_s):
                    return
                h.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.disconnected.set()
            h.close_connection = True


def _header_names(headers: dict[str, str]) -> dict[str, str]:
    return {k.replace("_", "-"): v for k, v in headers.items()}


def _sse(event: bytes | str | dict) -> bytes:
    """A dict is a data event; a str or bytes goes out as is (for garbage lines)."""
    if isinstance(event, dict):
        return b"data: " + json.dumps(event).encode() + b"\n\n"
    return event.encode() if isinstance(event, str) else event


def chat_chunks(*pieces: str, usage: bool = True, done: bool = True) -> list[dict | str]:
    """A Chat Completions stream for ``pieces``, as llama-server and OpenAI send it."""
    events: list[dict | str] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
    ]
    events += [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": len(pieces)}})
    if done:
        events.append("data: [DONE]\n\n")
    return events


def responses_events(*pieces: str) -> list[str]:
    """A Responses API stream for ``pieces`` (named events, as llama-server and OpenAI send it)."""

    def ev(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    out = [ev("response.created", response={"id": "resp_1", "status": "in_progress"})]
    out += [ev("response.output_text.delta", item_id="msg_1", output_index=0, delta=p) for p in pieces]
    out.append(ev("response.output_text.done", text="".join(pieces)))
    usage = {"input_tokens": 10, "output_tokens": len(pieces)}
    out.append(ev("response.completed", response={"id": "resp_1", "status": "completed", "usage": usage}))
    return out
