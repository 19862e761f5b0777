"""A recording HTTP proxy in front of a real model server: what a client really sent, for tests.

Every request is forwarded to the upstream server as it came, its answer (streamed SSE too)
goes back unchanged, and the request is kept for assertions::

    with running_llama_server(gguf) as base_url, recording_proxy(base_url) as proxy:
        ... a client at proxy.url ...
        body = proxy.bodies("/chat/completions")[-1]   # the JSON llama-server received

A client that hangs up mid-answer (a barge-in closing its stream) makes the proxy hang up on
the upstream server too, as the client would have.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Forwarded", "RecordingProxy", "recording_proxy"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection", "te",
               "trailer", "upgrade"}


@dataclass(frozen=True)
class Forwarded:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RecordingProxy:
    """``url``: where clients connect; ``requests``: everything forwarded, in order."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[Forwarded] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def bodies(self, path_suffix: str, since: int = 0) -> list[Any]:
        """The JSON bodies of the requests to a path ending in ``path_suffix`` (from index ``since``)."""
        with self._lock:
            requests = self.requests[since:]
        return [r.json() for r in requests if r.path.endswith(path_suffix) and r.body]

    def _record(self, request: Forwarded) -> None:
        with self._lock:
            self.requests.append(request)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy._record(Forwarded(self.command, self.path, body))
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=300)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    answer = upstream.getresponse()
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in _HOP_BY_HOP:
                            self.send_header(key, value)
                    length = answer.getheader("Content-Length")
                    if length is not None:  # a whole answer
                        data = answer.read()
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        return
                    self.send_header("Transfer-Encoding", "chunked")  # a stream: passed on as it comes
                    self.end_headers()
                    while chunk := answer.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client hung up: so does the proxy, upstream
                finally:
                    upstream.close()

            do_GET = do_POST = do_DELETE = do_PUT = _forward

        return Handler

    def start(self) -> None:
        threading.Thread(target=self._server.serve_forever, name="recording-proxy", daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def recording_proxy(upstream: str) -> Iterator[RecordingProxy]:
    """A proxy to ``upstream`` (``http://host:port``) for the duration of the block."""
    proxy = RecordingProxy(upstream)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
