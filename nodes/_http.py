"""One HTTP client for OpenAI-compatible servers (llama-server, vLLM, mlx_lm.server, OpenAI).

What every remote backend (llm=chat|responses, stt=openai, tts=openai) needs and should not
write twice: the API key rule (loopback servers need none; it never reaches a log or a
message), one keep-alive connection pool opened in ``setup()``, bounded retries before the
first byte, JSON, multipart, SSE and raw byte streams, errors that say what to type, and an
abort that closes a live stream from another thread at once. It knows no API: what a
backend's errors mean for its own options is the backend's to add (``RemoteLLM.explain``).

httpx is imported in :meth:`RemoteClient.open`, so composing a config costs nothing.
"""

from __future__ import annotations

import email.utils
import ipaddress
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from s2s_flow.errors import ConfigError, S2SError
from s2s_flow.node import require, shared

__all__ = ["RemoteError", "RemoteRefused", "StreamBroken", "Aborted", "HttpPolicy", "RemoteClient",
           "is_loopback", "is_private", "DEFAULT_BASE_URL"]

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"
API_KEY_ENV = "OPENAI_API_KEY"
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 4.0
RETRY_AFTER_CAP_S = 30.0  # a server asking for longer is answered with an error, not a frozen agent
SHOWN_CHARS = 300  # how much of a server's error body or a bad line an error message quotes
WARMUP_OK = (404, 405, 503)  # a server without /models is fine; 503: still loading its model


class RemoteError(S2SError):
    """A remote server could not serve the request; the text says what to change."""

    def __init__(self, text: str, *, status: int | None = None, detail: str = "") -> None:
        super().__init__(text)
        self.status, self.detail = status, detail


class RemoteRefused(RemoteError, ConfigError):
    """401, 403 or 404: the key, the URL or the model is wrong; asking again cannot help."""


class StreamBroken(RemoteError):
    """The answer stream stopped in the middle: connection lost, silence, or garbage."""


class Aborted(RemoteError):
    """The request was cancelled by :meth:`RemoteClient.abort` (barge-in)."""


class _Secret:
    """Holds the API key; its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "'***'" if self._value else "''"

    __str__ = __repr__


def is_private(host: str) -> bool:
    """Loopback, a private network address, or a bare hostname (``gpu-box``, a compose service):
    a server of one's own (llama.cpp, vLLM), not a public API that rejects fields it lacks."""
    host = host.lower().strip("[]")
    if is_loopback(host) or "." not in host and ":" not in host:
        return True
    if host.endswith((".local", ".lan", ".internal", ".home.arpa")):
        return True
    try:
        return ipaddress.ip_address(host).is_private
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: servers on this machine, which need no API key."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _server_detail(body: str) -> str:
    """The human part of an error body: OpenAI's ``error.message``, vLLM's ``message``..."""
    try:
        data = json.loads(body)
    except ValueError:
        return _shorten(body)
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(err.get(key), str):
                    return _shorten(err[key])
        elif isinstance(err, str):
            return _shorten(err)
    return _shorten(json.dumps(data))


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True, slots=True)
class HttpPolicy:
    """How long to wait for a server and how often to ask again: the options every remote
    backend takes under its group (``llm.read_timeout``, ``stt.max_retries`` ...)."""

    connect_timeout: float = 5.0
    read_timeout: float = 60.0  # the longest wait for the first byte and between chunks
    max_retries: int = 2  # on connect errors, 429 and 5xx, never once bytes came

    def check(self, group: str) -> None:
        for option, value, ok, expected in (
            ("connect_timeout", self.connect_timeout, self.connect_timeout > 0, "seconds > 0"),
            ("read_timeout", self.read_timeout, self.read_timeout > 0, "seconds > 0"),
            ("max_retries", self.max_retries, 0 <= self.max_retries <= 10, "0 to 10"),
        ):
            if not ok:
                raise ConfigError(f"{group}.{option}={value!r} is out of range: expected {expected}")


class RemoteClient:
    """Keep-alive HTTP client for one server; one request at a time (one node thread).

    ``__init__`` only checks the configuration; :meth:`open` creates the pool and warms
    it up, so a down server or a bad key is reported at setup, not at the first turn.
    """

    def __init__(
        self,
        *,
        group: str,
        base_url: str,
        api_key: str | None,
        policy: HttpPolicy,
        start_hint: str = "",
        log: Any = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{group}.base_url={base_url!r} is not an http(s) URL; give the server's API root, "
                f"e.g. {group}.base_url=https://api.openai.com/v1 or {DEFAULT_BASE_URL}"
            )
        if parts.username or parts.password:
            raise ConfigError(
                f"{group}.base_url must not carry credentials; put the key in {group}.api_key "
                f"or {API_KEY_ENV}"
            )
        policy.check(group)
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        if not key and not is_loopback(parts.hostname):
            raise ConfigError(
                f"{group}.base_url points at {parts.hostname}, a remote server, and no API key is "
                f"set: set {group}.api_key=... or the {API_KEY_ENV} environment variable (only "
                f"servers on this machine, such as llama-server on 127.0.0.1, need none)"
            )
        self.group = group
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.loopback = is_loopback(parts.hostname)
        self.private = is_private(parts.hostname)
        self._key = _Secret(key)
        self.policy = policy
        self.start_hint = start_hint  # how to start a typical server, for the "no server" error
        self.log = log
        self._http: Any = None
        self._httpx: Any = None
        self._sock: socket.socket | None = None  # the pool's one connection, for abort()
        self._connected = False  # the request being sent opened a new connection
        self._cancel = threading.Event()

    def __repr__(self) -> str:
        return f"RemoteClient({self.base_url!r}, api_key={self._key!r})"

    def move_to(self, base_url: str) -> None:
        """Send every request to ``base_url``: another port of the same host (a replica of the
        server, s2s_flow.model_server_spec); before the connection is opened."""
        if urlsplit(base_url).hostname != self.host or self._http is not None:
            raise ValueError(f"move_to({base_url!r}): only to the same host ({self.host}), before open()")
        self.base_url = base_url.rstrip("/")

    # -- lifecycle --------------------------------------------------------------------

    def open(self, *, warm_up: bool = True) -> list[str]:
        """Create the connection pool and warm it up; returns the model ids the server lists.

        A server still loading its model (llama-server answers 503) is waited for, up to
        ``read_timeout``, so the first turn does not meet it half-ready. Without ``warm_up``
        only the pool is made: speech servers often have no ``GET /models`` to ask.
        """
        httpx = self._httpx = require("httpx", "remote")
        headers = {"Authorization": f"Bearer {self._key.reveal()}"} if self._key else {}
        trust_env = not self.loopback  # an http_proxy from the environment must not catch 127.0.0.1
        # The TLS context (the CA bundle, ~15 ms of CPU to load) is the process's, not each
        # session's; the connection is the session's own.
        tls = shared((__name__, "tls", trust_env), lambda: httpx.create_ssl_context(trust_env=trust_env))
        # One connection: requests are sequential, and abort() then knows which socket to cut.
        self._http = httpx.Client(
            headers=headers,
            verify=tls,
            trust_env=trust_env,
            timeout=httpx.Timeout(self.policy.read_timeout, connect=self.policy.connect_timeout),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=300),
        )
        if not warm_up:
            return []
        deadline = time.monotonic() + self.policy.read_timeout
        while True:
            resp = self._send("GET", "/models", stream=False, api="model list", tolerate=WARMUP_OK)
            if resp.status_code != 503 or time.monotonic() > deadline:
                break
            if self.log is not None:
                self.log.info("%s is still loading its model (HTTP 503); waiting", self.base_url)
            time.sleep(0.5)
        if resp.status_code == 503:
            raise self._status_error(resp, self.base_url + "/models", "model list", "", attempts=1)
        if resp.status_code != 200:
            return []
        try:
            return [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError, TypeError):
            return []

    def close(self) -> None:
        self.abort()
        if self._http is not None:
            self._http.close()

    def begin(self) -> None:
        """A new request is about to be made: forget the last abort. Call it *before* publishing
        what an interrupt would check (the turn in flight), so an abort is never lost between."""
        self._cancel.clear()

    def abort(self) -> None:
        """Cancel the request in flight, from any thread: a read blocked on the server (even
        before the response headers, during a long prefill) returns at once."""
        self._cancel.set()
        sock = self._sock
        if sock is not None:
            with suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore trace hook: remember the socket of each new connection."""
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            self._sock = stream.get_extra_info("socket") if stream is not None else None
            self._connected = True

    # -- requests ---------------------------------------------------------------------

    def post_json(
        self, path: str, body: dict[str, Any], *, api: str, hint_404: str = "",
        files: Mapping[str, Any] | None = None,
    ) -> Any:
        """One non-streamed request; the answer's JSON. With ``files`` the body goes as
        multipart form fields next to them (``/audio/transcriptions``)."""
        content = {"data": body, "files": files} if files else {"json": body}
        resp = self._send("POST", path, stream=False, api=api, hint_404=hint_404, **content)
        try:
            return resp.json()
        except ValueError:
            raise RemoteError(
                f"the server at {self.base_url}{path} answered with something that is not JSON: "
                f"{self._quote(resp.text)!r}"
            ) from None

    @contextmanager
    def post_stream(
        self, path: str, body: dict[str, Any], *, api: str, hint_404: str = ""
    ) -> Iterator[Iterator[tuple[str, Any]]]:
        """A streamed request, as ``(event, data)`` pairs; leaving the block closes the connection."""
        with self._streamed(path, body, api, hint_404, accept="text/event-stream") as resp:
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                resp.read()
                raise RemoteError(
                    f"the server at {self.base_url}{path} answered {ctype or 'an untyped body'} instead "
                    f"of an event stream: {self._quote(resp.text)!r}; check {self.group}.base_url"
                )
            yield self._events(resp, path)

    @contextmanager
    def post_bytes(
        self, path: str, body: dict[str, Any], *, api: str, hint_404: str = ""
    ) -> Iterator[Iterator[bytes]]:
        """A request whose answer is read as it arrives (audio); leaving the block closes it."""
        with self._streamed(path, body, api, hint_404) as resp:
            yield self._bytes(resp, path)

    @contextmanager
    def _streamed(
        self, path: str, body: dict[str, Any], api: str, hint_404: str, *, accept: str | None = None
    ) -> Iterator[Any]:
        resp = self._send("POST", path, stream=True, api=api, hint_404=hint_404, json=body, accept=accept)
        try:
            if self._cancel.is_set():
                raise Aborted("aborted")
            yield resp
        finally:
            resp.close()

    def _send(
        self,
        method: str,
        path: str,
        *,
        stream: bool,
        api: str,
        hint_404: str = "",
        tolerate: tuple[int, ...] = (),
        accept: str | None = None,
        **content: Any,
    ) -> Any:
        """Send with bounded retries on connect errors, 429 and 5xx; never once bytes came.
        ``content``: httpx's ``json=`` or ``data=`` and ``files=``."""
        httpx, url = self._httpx, self.base_url + path
        headers = {"Accept-Encoding": "identity"} if stream else {}  # chunks as the server sends them
        if accept:
            headers["Accept"] = accept
        attempt, resent = 0, False
        while True:
            retry = attempt < self.policy.max_retries
            self._connected = False  # set by _trace when this request opens a new connection
            try:
                request = self._http.build_request(
                    method, url, headers=headers, extensions={"trace": self._trace}, **content
                )
                resp = self._http.send(request, stream=stream)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout) and retry and not self._cancel.is_set():
                    self._pause(attempt, None)
                    attempt += 1
                    continue
                raise self._transport_error(exc, url) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                if self._cancel.is_set():
                    raise self._transport_error(exc, url) from None
                if not self._connected and not resent and not isinstance(exc, httpx.ConnectError):
                    # a kept-alive connection the server closed while it sat in the pool (llama-
                    # server closes idle ones after 5 s; a restarted server never knew it): the
                    # request never reached a live server, so it goes once more on a fresh
                    # connection, at once and not counted as a retry (as urllib3 does)
                    resent = True
                    continue
                if retry:  # refused, or cut before any answer: nothing was served, so ask again
                    self._pause(attempt, None)
                    attempt += 1
                    continue
                raise self._transport_error(exc, url) from None
            status = resp.status_code
            if 200 <= status < 300 or status in tolerate:
                return resp
            resp.read()
            resp.close()
            if (status == 429 or status >= 500) and retry:
                wait = _retry_after(resp.headers.get("retry-after"))
                if wait is None or wait <= RETRY_AFTER_CAP_S:
                    self._pause(attempt, wait)
                    attempt += 1
                    continue
            raise self._status_error(resp, url, api, hint_404, attempts=attempt + 1)

    def _pause(self, attempt: int, retry_after: float | None) -> None:
        """Jittered exponential backoff (or the server's Retry-After); abort() cuts it short."""
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, retry_after)
        if self.log is not None:
            self.log.info("retrying %s in %.2f s (attempt %d)", self.base_url, delay, attempt + 2)
        if self._cancel.wait(delay):
            raise Aborted("aborted")

    def _events(self, resp: Any, path: str) -> Iterator[tuple[str, Any]]:
        """Parse Server-Sent Events: ``(event name or "message", JSON data or "[DONE]")``."""
        event, data, pending = "", [], b""
        for chunk in self._bytes(resp, path):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.rstrip(b"\r")
                if not line:
                    if data:
                        yield event or "message", self._decode(b"\n".join(data), path)
                    event, data = "", []
                    continue
                field, colon, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if field == b"data" and colon:
                    data.append(value)
                elif field == b"event" and colon:
                    event = value.decode("utf-8", "replace")
                elif field not in (b"", b"id", b"retry"):
                    raise self._malformed(path, line)
        if pending.strip() or data:  # a last event without its blank line
            if pending.strip():
                field, _, value = pending.rstrip(b"\r").partition(b":")
                if field != b"data":
                    raise self._malformed(path, pending)
                data.append(value[1:] if value.startswith(b" ") else value)
            yield event or "message", self._decode(b"\n".join(data), path)

    def _bytes(self, resp: Any, path: str) -> Iterator[bytes]:
        """The body as it arrives; silence, a cut connection or abort() end it with an error."""
        httpx = self._httpx
        try:
            yield from resp.iter_bytes()
        except httpx.TimeoutException:
            raise StreamBroken(
                f"the server at {self.base_url}{path} sent nothing for {self.policy.read_timeout:g} s "
                f"({self.group}.read_timeout); raise it for slow servers or long prompts"
            ) from None
        except httpx.TransportError as exc:
            if self._cancel.is_set():
                raise Aborted("aborted") from None
            raise StreamBroken(
                f"the stream from {self.base_url}{path} broke off: {type(exc).__name__}: {exc}"
            ) from None

    def _decode(self, data: bytes, path: str) -> Any:
        if data == b"[DONE]":
            return "[DONE]"
        try:
            return json.loads(data)
        except ValueError:
            raise self._malformed(path, b"data: " + data) from None

    def _malformed(self, path: str, line: bytes) -> StreamBroken:
        text = self._quote(line.decode("utf-8", "replace"), 200)
        return StreamBroken(
            f"the server at {self.base_url}{path} sent a malformed event-stream line: {text!r}; "
            f"it is not an OpenAI-compatible server, or {self.group}.base_url is wrong"
        )

    def _redact(self, text: str) -> str:
        """Server text for an error message never shows our key (some servers echo it)."""
        key = self._key.reveal()
        return text.replace(key, "***") if key else text

    def _quote(self, text: str, limit: int = SHOWN_CHARS) -> str:
        return _shorten(self._redact(text), limit)

    def _transport_error(self, exc: Exception, url: str) -> RemoteError:
        httpx = self._httpx
        if self._cancel.is_set():
            return Aborted("aborted")
        if isinstance(exc, httpx.ConnectTimeout):
            return RemoteError(
                f"no answer from {self.base_url} within {self.policy.connect_timeout:g} s "
                f"({self.group}.connect_timeout): is the host up and the port open? "
                f"Or fix {self.group}.base_url"
            )
        if isinstance(exc, httpx.TimeoutException):
            return RemoteError(
                f"the server at {url} did not start answering within {self.policy.read_timeout:g} s "
                f"({self.group}.read_timeout); raise it for slow servers or long prompts"
            )
        if isinstance(exc, httpx.ConnectError):
            example = f" (e.g. {self.start_hint})" if self.start_hint else ""
            return RemoteError(
                f"no server at {self.base_url} ({exc}): is the server running? Start it{example} "
                f"or fix {self.group}.base_url"
            )
        return RemoteError(f"the connection to {url} failed: {type(exc).__name__}: {exc}")

    def _status_error(self, resp: Any, url: str, api: str, hint_404: str, *, attempts: int) -> RemoteError:
        status, detail = resp.status_code, _server_detail(self._redact(resp.text))
        said = f"HTTP {status}: {detail}" if detail else f"HTTP {status}"
        g = self.group
        if status in (401, 403):
            text = (
                f"the server at {url} refused the API key ({said}): set {g}.api_key or {API_KEY_ENV} "
                f"to a key this server accepts"
            )
        elif status == 404 and "model" in detail.lower():
            text = (
                f"the server at {self.base_url} does not serve the requested model ({said}): set "
                f"{g}.model to one it lists at {self.base_url}/models"
            )
        elif status == 404:
            text = f"this server has no {api} at {url} ({said}); {hint_404 or f'check {g}.base_url'}"
        elif status == 429:
            text = (
                f"the server at {url} is rate-limiting requests ({said}) after {attempts} attempts; "
                f"wait, lower the request rate, or raise {g}.max_retries"
            )
        elif status >= 500:
            text = f"the server at {url} failed ({said}) on {attempts} attempts; see the server's log"
        else:
            text = f"the server at {url} rejected the request ({said})"
        refused = status in (401, 403, 404)
        return (RemoteRefused if refused else RemoteError)(text, status=status, detail=detail)
