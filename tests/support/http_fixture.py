"""A tiny threaded HTTP server on 127.0.0.1 for testing clients of remote APIs.

The test scripts the answers; every request is recorded for assertions::

    with http_server(lambda req: Reply(200, {"text": "hi"})) as server:
        httpx.post(f"{server.url}/v1/audio/transcriptions", ...)
        assert server.requests[0].path == "/v1/audio/transcriptions"
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Request", "Reply", "Server", "http_server", "parse_multipart", "free_port"]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Reply:
    status: int = 200
    body: Any = b""  # bytes, str, or anything JSON-serialisable
    headers: dict[str, str] = field(default_factory=dict)

    def encoded(self) -> tuple[bytes, str]:
        if isinstance(self.body, bytes):
            return self.body, "application/octet-stream"
        if isinstance(self.body, str):
            return self.body.encode(), "text/plain; charset=utf-8"
        return json.dumps(self.body).encode(), "application/json"


@dataclass
class Server:
    url: str
    requests: list[Request]


@contextmanager
def http_server(handle: Callable[[Request], Reply]) -> Iterator[Server]:
    """Serve ``handle`` on a free loopback port until the block ends."""
    requests: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            request = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                              self.rfile.read(length))
            requests.append(request)
            try:
                reply = handle(request)
            except Exception as exc:  # a bug in the test's handler: answer, don't hang up
                reply = Reply(500, f"test handler failed: {type(exc).__name__}: {exc}")
            body, content_type = reply.encoded()
            self.send_response(reply.status)
            headers = {"content-type": content_type, **{k.lower(): v for k, v in reply.headers.items()}}
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="http-fixture", daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{httpd.server_address[1]}", requests)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server started as a subprocess)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data -> {field name: (file name or None, raw bytes)}."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise ValueError(f"not a multipart body ({content_type})")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        fields[str(name)] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields
