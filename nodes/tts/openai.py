"""Any OpenAI-compatible speech endpoint: ``POST {base_url}/audio/speech``, read as it streams.

OpenAI itself, or local servers that copy its API (Kokoro-FastAPI, Speaches, LocalAI,
the faster-qwen3-tts example server). Each sentence is one request; audio is yielded as
the bytes arrive, so the first chunk plays before the server has finished.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from nodes.tts._base import SentenceTTS
from s2s_flow.audio import to_float32, to_mono
from s2s_flow.errors import ConfigError, S2SError
from s2s_flow.node import require

__all__ = ["OpenAITTS", "RemoteTTSError"]

_FORMATS = ("pcm", "wav")
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class RemoteTTSError(S2SError):
    """The speech server refused or failed a request (the message says which option to fix)."""


def _is_loopback(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _WavStream:
    """Incremental WAV reader: header first (rate, format), then PCM as it arrives.

    Streaming servers cannot know the data size up front and write 0 or 0xFFFFFFFF
    there, so the declared sizes of the RIFF and data chunks are ignored.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.rate: int | None = None
        self._fmt: tuple[int, int, int] | None = None  # (format tag, channels, bits)
        self._in_data = False

    def feed(self, data: bytes) -> np.ndarray | None:
        self._buf += data
        if not self._in_data and not self._parse_header():
            return None
        assert self._fmt is not None
        tag, channels, bits = self._fmt
        frame = channels * bits // 8
        usable = len(self._buf) - len(self._buf) % frame
        raw, self._buf = self._buf[:usable], self._buf[usable:]
        if not raw:
            return None
        dtype = {(1, 16): "<i2", (1, 32): "<i4", (3, 32): "<f4"}[(tag, bits)]
        pcm = np.frombuffer(raw, dtype=dtype).reshape(-1, channels)
        return to_float32(to_mono(pcm) if channels > 1 else pcm[:, 0])

    def _parse_header(self) -> bool:
        buf = self._buf
        if len(buf) < 12:
            return False
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise RemoteTTSError("the speech server answered response_format=wav with something that is "
                                 f"not a WAV file (starts {buf[:12]!r}); try tts.response_format=pcm.")
        pos = 12
        while len(buf) >= pos + 8:
            cid, size = buf[pos : pos + 4], struct.unpack("<I", buf[pos + 4 : pos + 8])[0]
            if cid == b"data":
                if self._fmt is None:
                    raise RemoteTTSError("the server's WAV stream has audio data before its format chunk.")
                self._buf, self._in_data = buf[pos + 8 :], True
                return True
            if len(buf) < pos + 8 + size:
                return False
            if cid == b"fmt ":
                tag, channels, rate = struct.unpack("<HHI", buf[pos + 8 : pos + 16])
                bits = struct.unpack("<H", buf[pos + 22 : pos + 24])[0]
                if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the real tag opens the subformat GUID
                    tag = struct.unpack("<H", buf[pos + 32 : pos + 34])[0]
                if (tag, bits) not in {(1, 16), (1, 32), (3, 32)}:
                    raise RemoteTTSError(f"the server's WAV is format {tag} with {bits}-bit samples; "
                                         "expected 16-bit PCM or 32-bit float (or tts.response_format=pcm).")
                self._fmt, self.rate = (tag, channels, bits), rate
            pos += 8 + size + (size & 1)
        return False


class OpenAITTS(SentenceTTS):
    """Speech from an OpenAI-compatible ``/audio/speech`` endpoint, streamed per sentence."""

    secret_params = frozenset({"api_key"})

    def __init__(
        self,
        *,
        base_url: str = "https://api.openai.com/v1",
        model: str = "gpt-4o-mini-tts",
        voice: str = "alloy",
        api_key: str | None = None,
        response_format: str = "pcm",
        server_rate: int = 24000,
        instructions: str | None = None,
        speed: float | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_retries: int = 3,
        sample_rate: int | None = None,
    ) -> None:
        super().__init__(sample_rate=sample_rate)
        if urlsplit(base_url).scheme not in ("http", "https") or not urlsplit(base_url).hostname:
            raise ConfigError(f"tts.base_url={base_url!r} is not an http(s) URL; e.g. "
                              "tts.base_url=https://api.openai.com/v1 or http://127.0.0.1:8880/v1.")
        if response_format not in _FORMATS:
            raise ConfigError(f"tts.response_format={response_format!r}: choose pcm (raw 16-bit, lowest "
                              "latency) or wav (the server's own rate is read from the header).")
        if not 8000 <= server_rate <= 192_000:
            raise ConfigError(f"tts.server_rate={server_rate}: the rate in Hz the server speaks at "
                              "(OpenAI: 24000); a wav header's rate overrides it.")
        if speed is not None and not 0.25 <= speed <= 4.0:
            raise ConfigError(f"tts.speed={speed}: OpenAI accepts 0.25 to 4.0 (null = server default).")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ConfigError("tts.connect_timeout and tts.read_timeout must be positive seconds.")
        if max_retries < 0:
            raise ConfigError(f"tts.max_retries={max_retries} must be 0 or more.")
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY", "")
        if not self._api_key and not _is_loopback(base_url):
            raise ConfigError(
                f"tts=openai sends text to {urlsplit(base_url).hostname}, which is not a loopback "
                "server, and no API key is set: export OPENAI_API_KEY=... or pass tts.api_key=... "
                "(a local server such as tts.base_url=http://127.0.0.1:8880/v1 needs none)."
            )
        self.base_url, self.model, self.voice = base_url.rstrip("/"), model, voice
        self.response_format, self.server_rate = response_format, server_rate
        self.instructions, self.speed = instructions, speed
        self.connect_timeout, self.read_timeout, self.max_retries = connect_timeout, read_timeout, max_retries
        self._rate = server_rate
        self._client: Any = None
        self._live: Any = None  # the response being read, closed on barge-in
        self._wake = threading.Event()

    @property
    def native_rate(self) -> int:
        return self._rate

    def setup(self) -> None:
        httpx = require("httpx", "remote")
        timeout = httpx.Timeout(self.read_timeout, connect=self.connect_timeout)
        # Loopback servers must not be reached through a proxy from the environment.
        self._client = httpx.Client(timeout=timeout, trust_env=not _is_loopback(self.base_url))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def cancel_synthesis(self) -> None:
        self._wake.set()
        live = self._live
        if live is None:
            return
        # Closing a response from another thread does not wake a read blocked on its socket;
        # shutting the socket down does (the reader then sees the stream end and stops).
        stream = live.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        httpx = require("httpx", "remote")
        turn = self.speaking_turn
        self._wake.clear()
        response = self._open(sentence)
        if response is None:  # interrupted while waiting to retry
            return
        wav = _WavStream() if self.response_format == "wav" else None
        odd = b""
        try:
            for data in response.iter_bytes():
                if wav is not None:
                    pcm = wav.feed(data)
                    if wav.rate:
                        self._rate = wav.rate
                else:
                    data, odd = odd + data, b""
                    if len(data) % 2:
                        data, odd = data[:-1], data[-1:]
                    pcm = np.frombuffer(data, dtype="<i2") if data else None
                if pcm is not None and len(pcm):
                    yield pcm
        except (httpx.HTTPError, RuntimeError) as exc:  # a barge-in closes the stream under us
            if not self.interrupted(turn):
                raise RemoteTTSError(f"the speech stream from {self._url} broke off: {exc}") from exc
        finally:
            self._live = None
            response.close()

    @property
    def _url(self) -> str:
        return f"{self.base_url}/audio/speech"

    def _open(self, sentence: str) -> Any:
        """POST the sentence; return the streaming 200 response, retrying transient failures."""
        httpx = require("httpx", "remote")
        payload: dict[str, Any] = {"model": self.model, "input": sentence, "voice": self.voice,
                                   "response_format": self.response_format}
        if self.instructions:
            payload["instructions"] = self.instructions
        if self.speed is not None:
            payload["speed"] = self.speed
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        turn = self.speaking_turn
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                request = self._client.build_request("POST", self._url, json=payload, headers=headers)
                response = self._client.send(request, stream=True)
            except httpx.TransportError as exc:  # speech requests are idempotent: retry them all
                if last:
                    what = "cannot reach" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) \
                        else "got no answer from"
                    raise RemoteTTSError(
                        f"{what} the speech server at {self._url} ({type(exc).__name__}: {exc}) after "
                        f"{attempt + 1} attempt(s); is it running? check tts.base_url and tts.read_timeout."
                    ) from exc
                retry_after = None
            else:
                if response.is_success:
                    self._live = response
                    return response
                body = self._error_text(response.read())
                response.close()
                if response.status_code not in _RETRY_STATUS or last:
                    raise self._refused(response.status_code, body, attempt + 1)
                retry_after = response.headers.get("retry-after")
            if self._backoff(attempt, retry_after) or self.interrupted(turn):
                return None
        return None  # unreachable: the last attempt returns or raises

    def _backoff(self, attempt: int, retry_after: str | None) -> bool:
        """Sleep before the next try (jittered exponential, or the server's Retry-After); True if woken."""
        delay = min(8.0, 0.25 * 2**attempt) * random.uniform(0.5, 1.5)
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP date instead of seconds: keep ours
                delay = min(10.0, max(0.0, float(retry_after)))
        woken = self._wake.wait(delay)
        return woken or (hasattr(self, "ctx") and self.ctx.stopping.is_set())

    def _error_text(self, body: bytes) -> str:
        """The server's own error message (OpenAI style JSON or plain text), short, key redacted."""
        text = body[:2000].decode("utf-8", "replace").strip()
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            error = json.loads(text).get("error", text)
            text = str(error.get("message", error) if isinstance(error, dict) else error)
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return text[:300]

    def _refused(self, status: int, body: str, attempts: int) -> RemoteTTSError:
        where = f"{self._url} answered HTTP {status}"
        detail = f": {body}" if body else ""
        if status in (401, 403):
            return RemoteTTSError(
                f"{where} (the API key was refused{detail}). Set a valid key with OPENAI_API_KEY or "
                "tts.api_key=..., one that this server accepts."
            )
        if status == 404:
            return RemoteTTSError(
                f"{where} (not found{detail}). Check tts.base_url (OpenAI-style servers serve "
                f"/v1/audio/speech, so it usually ends in /v1) and that the server has "
                f"tts.model={self.model!r}."
            )
        if status in _RETRY_STATUS:
            return RemoteTTSError(f"{where}{detail}, still failing after {attempts} attempts; "
                                  "the server is overloaded or down (raise tts.max_retries to wait longer).")
        return RemoteTTSError(f"{where}{detail}. Check tts.model={self.model!r}, tts.voice={self.voice!r} "
                              f"and tts.response_format={self.response_format!r}.")
