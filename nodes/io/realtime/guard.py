"""Who may talk to the server from a browser: the ``Origin`` and ``Host`` checks of every route.

Browsers apply no CORS to WebSockets, and a form or ``fetch`` may POST anywhere: without these
checks, any page a user visits while the server runs could open sessions, spend the models and
drive the server-side tools. So:

- A request that sends ``Origin`` (a browser) is served only from an allowed origin: the server's
  own page (the origin of the ``Host`` it was reached at), loopback origins (``http://localhost:3000``),
  and ``io.allowed_origins``. ``Origin: null`` (a file, a sandboxed frame) is refused unless listed.
  A request without ``Origin`` (the SDKs, a phone gateway) is judged by the key alone.
- On a loopback bind, a ``Host`` that is not a loopback name or address is refused: a page of
  ``evil.example`` whose name is made to resolve to 127.0.0.1 (DNS rebinding) reaches the port with
  its own name in ``Host``. ``io.allowed_hosts`` adds names (a balancer's public name).

``Guard.refusal(scope)`` is the one check; the server applies it to every HTTP and WebSocket
route before routing, so routes added to the app are covered without calling it themselves.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nodes.io.realtime import protocol as events

__all__ = ["Guard", "Refusal"]

log = logging.getLogger("s2s_flow.realtime")
_LOOPBACK_NAMES = ("localhost", "localhost.")


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the HTTP status (403) and a message that names the setting to change."""

    code: str
    message: str
    status: int = 403


def is_loopback(host: str) -> bool:
    """A loopback name or address (``localhost``, ``*.localhost``, 127.0.0.0/8, ``::1``)."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The name of a ``Host`` header (``name:port``, ``[::1]:port``), lower-case, without the port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _netloc(origin: str) -> str:
    return (urlsplit(origin).netloc or "").lower()


class Guard:
    """The Origin and Host checks of one server, from its settings (see the module's docstring)."""

    def __init__(self, bind: str, allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = ()) -> None:
        self.loopback_bind = is_loopback(bind)
        self.origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()}
        self.hosts = {_split_host(h) for h in allowed_hosts if h.strip()}

    def refusal(self, scope: dict) -> Refusal | None:
        """None if the request (an ASGI ``http`` or ``websocket`` scope) may go on, else why not."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        host = headers.get("host", "")
        if host and self.loopback_bind and "*" not in self.hosts:
            name = _split_host(host)
            if not is_loopback(name) and name not in self.hosts:
                return Refusal("host_not_allowed", f"Host {host!r} is not a loopback name, and this server is bound "
                               "to loopback: a page reaching it under another name is refused (DNS rebinding). "
                               f"Connect to 127.0.0.1 or localhost, or add {name!r} to io.allowed_hosts (a "
                               "balancer's public name)")
        origin = headers.get("origin")
        if origin is None or self._origin_allowed(origin.strip(), host):
            return None
        return Refusal("origin_not_allowed", f"Origin {origin!r} may not use this server: browsers are served from "
                       "its own page and loopback origins only. Add the origin to io.allowed_origins (e.g. "
                       "io.allowed_origins=[https://app.example.com]) if its pages should talk to the server")

    async def refused(self, scope: dict, receive: Any, send: Any) -> bool:
        """Answer a refused request (ASGI): 403 with an error event as its body (a WebSocket's too,
        before it is accepted). False when the request may go on (or is not HTTP)."""
        from starlette.responses import JSONResponse
        from starlette.websockets import WebSocket

        refusal = self.refusal(scope) if scope["type"] in ("http", "websocket") else None
        if refusal is None:
            return False
        log.warning("refused %s %s: %s", scope["type"], scope.get("path"), refusal.code)
        body = JSONResponse(events.error(refusal.code, refusal.message, type="invalid_request_error"),
                            status_code=refusal.status)
        if scope["type"] == "http":
            await body(scope, receive, send)
            return True
        ws = WebSocket(scope, receive, send)
        try:
            await ws.send_denial_response(body)
        except RuntimeError:  # a server without the denial-response extension
            await ws.close(code=1008)
        return True

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        if origin == "null":
            return False
        netloc = _netloc(origin)
        if not netloc:
            return False
        if host and netloc == host.strip().lower():  # the server's own page, at the name it was reached by
            return True
        return is_loopback(_split_host(netloc))
