"""A small OpenAI-compatible speech server on 127.0.0.1 for the remote TTS tests.

It speaks with real espeak-ng, checks each request the way the OpenAI API would, and
streams the audio back in pieces (chunked transfer). Scripted failures (503, 401, ...)
come first; ``hold`` keeps the second half of a response back until the test releases
it, which proves the client plays audio before the response is complete.

    with SpeechServer(api_key="sk-test", fail_first=[503]) as server:
        node = OpenAITTS(base_url=server.base_url, api_key="sk-test", ...)
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from nodes.tts.espeak import espeak_synthesize
from s2s_flow.audio import resample

__all__ = ["SpeechServer", "streaming_wav_header"]


def streaming_wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say 'unknown' (0xFFFFFFFF), as streaming servers send."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt \
        + b"LIST" + struct.pack("<I", 4) + b"INFO" + b"data" + struct.pack("<I", 0xFFFFFFFF)


class SpeechServer:
    """``POST /v1/audio/speech`` served from a thread; records every request it gets."""

    def __init__(self, *, api_key: str = "sk-test", fail_first: Sequence[int] = (), hold: bool = False,
                 pcm_rate: int = 24000) -> None:
        self.api_key, self.pcm_rate, self.hold = api_key, pcm_rate, hold
        self.failures = list(fail_first)
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()  # set by a test to let a held response finish
        self.finished = threading.Event()  # set when a response has been sent completely
        self.disconnected = threading.Event()  # set when the client hung up mid-response
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> SpeechServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _error(self, status: int, message: str) -> None:
                body = json.dumps({"error": {"message": message}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status == 503:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.requests.append({"path": self.path, "json": body,
                                        "authorization": self.headers.get("Authorization")})
                if self.path != "/v1/audio/speech":
                    return self._error(404, f"no route {self.path}")
                if server.failures:
                    return self._error(server.failures.pop(0), "scripted failure")
                given = self.headers.get("Authorization", "")
                if given != f"Bearer {server.api_key}":  # echoes the key, as some servers do
                    return self._error(401, f"Incorrect API key provided: {given.removeprefix('Bearer ')}")
                missing = [k for k in ("model", "input", "voice") if not body.get(k)]
                if missing or body.get("response_format") not in ("wav", "pcm"):
                    return self._error(400, f"bad request: missing {missing} or bad response_format")
                pcm, rate = espeak_synthesize(body["input"])
                if body["response_format"] == "pcm":
                    rate = server.pcm_rate
                    pcm = np.round(resample(pcm, 22050, rate) * 32767).astype("<i2")
                    payload = pcm.astype("<i2").tobytes()
                else:
                    payload = streaming_wav_header(rate) + pcm.astype("<i2").tobytes()
                self.send_response(200)
                self.send_header("Content-Type", f"audio/{body['response_format']}")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                half = len(payload) // 2 | 1  # odd: the client must carry a split sample over
                pieces = [payload[i : i + 4001] for i in range(0, half, 4001)]
                rest = [payload[i : i + 4001] for i in range(half, len(payload), 4001)]
                try:
                    for piece in pieces:
                        self._chunk(piece)
                    if server.hold:
                        server.release.wait(10)
                    for piece in rest:
                        self._chunk(piece)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    server.disconnected.set()
                    return
                server.finished.set()

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        return Handler
