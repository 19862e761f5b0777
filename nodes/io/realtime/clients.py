"""Limits per client address (``io.client_limits``): how many sessions one address holds at once, and
how fast it may open new ones.

``io.max_sessions`` and admission by load protect the server as a whole; one client reconnecting in
a loop (a bug, or on purpose) would still take every slot and build a session graph per connection.
So a WebSocket on ``/v1/realtime`` is counted by its client's address, before any graph is built:

- ``max_sessions``: sessions one address may hold at once; one more is told (error
  ``client_session_limit``) and closed with 1008.
- ``connects_per_s``: new connections an address may open a second on average (twice that, at
  least one, at once);
  a faster one is told (error ``client_rate_limited``) and closed with 1013 (try again later).

Refusals are counted in ``s2s_sessions_refused_total{reason}``. 0 turns a limit off. A refusal is
answered after ``REFUSE_DELAY_S``: a client that reconnects as soon as it is refused (a loop without
backoff) then costs the server one handshake a second and a socket held meanwhile, not a hundred
handshakes a second (measured: benchmarks/bench_abuse.py, frames).

The address is the TCP peer's. Behind a reverse proxy every client arrives from the proxy's
address: list the proxy in ``io.trusted_proxies`` (addresses or networks) and have it set
``X-Forwarded-For`` (HAProxy: ``option forwardfor``, as deploy/haproxy.cfg does); the client is then
the last address of that header not itself a trusted proxy. A peer that is not trusted cannot
pretend to be another client: its ``X-Forwarded-For`` is ignored. Addresses in ``exempt`` (by
default loopback: the local machine, and a balancer on it that does not forward the client's
address) are not limited. Twilio's calls (``/v1/twilio``) all come from Twilio's addresses and are
signed: they are not limited per address. WebRTC calls (``POST /v1/realtime/calls``) are, as WebSockets
are: a refused offer is answered 429 with the same error, and a call holds its place until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from nodes.io.realtime import protocol as events
from s2s_flow.errors import ConfigError

__all__ = ["ClientLimitSettings", "ClientLimits", "Refusal", "settings"]

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_PRUNE_AT = 4096  # addresses remembered for their connection rate before the idle ones are forgotten
REFUSE_DELAY_S = 1.0  # a connection refused per address is answered this late (see the module's docstring)


@dataclass(frozen=True)
class Refusal:
    """A connection refused after its WebSocket was accepted: an error event, then a close."""

    code: str
    message: str
    close_code: int = 1008
    type: str = "invalid_request_error"
    delay_s: float = 0.0

    async def tell(self, ws: Any) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await ws.send_text(events.encode(events.error(self.code, self.message, type=self.type)))
        await ws.close(code=self.close_code, reason=self.code)


@dataclass(frozen=True)
class ClientLimitSettings:
    max_sessions: int = 4
    connects_per_s: float = 5.0
    exempt: tuple[_Network, ...] = ()
    trusted_proxies: tuple[_Network, ...] = ()

    @property
    def proxies(self) -> list[str]:
        """``io.trusted_proxies`` for uvicorn (``forwarded_allow_ips``), which puts the client that a
        trusted proxy's ``X-Forwarded-For`` names in the ASGI scope (and nobody's, with none)."""
        return [str(net) for net in self.trusted_proxies]


def _networks(key: str, values: Any) -> tuple[_Network, ...]:
    if values is None:
        return ()
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise ConfigError(f"{key} must be a list of addresses or networks, e.g. [10.0.0.5, 10.1.0.0/16]; "
                          f"got {values!r}")
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(str(value).strip(), strict=False))
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not an IP address or network (e.g. 10.0.0.5, 10.1.0.0/16, "
                              "::1)") from None
    return tuple(out)


def settings(limits: Mapping[str, Any] | None, trusted_proxies: Any = ()) -> ClientLimitSettings:
    """``io.client_limits`` and ``io.trusted_proxies``, checked (a ConfigError names the key)."""
    limits = dict(limits or {})
    unknown = set(limits) - {"max_sessions", "connects_per_s", "exempt"}
    if unknown:
        raise ConfigError(f"io.client_limits has no {', '.join(sorted(unknown))}: it takes max_sessions, "
                          "connects_per_s and exempt")
    max_sessions = int(limits.get("max_sessions", 4) or 0)
    rate = float(limits.get("connects_per_s", 5.0) or 0)
    if max_sessions < 0 or rate < 0:
        raise ConfigError("io.client_limits.max_sessions and .connects_per_s must be >= 0 (0: no limit)")
    exempt = limits.get("exempt", ("127.0.0.0/8", "::1"))
    return ClientLimitSettings(max_sessions, rate, _networks("io.client_limits.exempt", exempt),
                               _networks("io.trusted_proxies", trusted_proxies))


def _ip(value: str) -> Any:
    try:
        return ipaddress.ip_address(value.strip().strip("[]"))
    except ValueError:
        return None


class ClientLimits:
    """The per-address counts of one server (on its event loop: no lock)."""

    def __init__(self, limits: ClientLimitSettings) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}
        self.buckets: dict[str, tuple[float, float]] = {}  # address: (tokens, when)

    @staticmethod
    def address(scope: Mapping[str, Any]) -> str:
        """The client's address: the TCP peer's, or, from a trusted proxy, the last address its
        ``X-Forwarded-For`` names that is not itself a trusted proxy (uvicorn's ProxyHeadersMiddleware,
        given ``io.trusted_proxies``, has put it in the scope)."""
        return (scope.get("client") or ("",))[0] or ""

    def _exempt(self, address: str) -> bool:
        ip = _ip(address)
        return ip is not None and any(ip in net for net in self.limits.exempt)

    def _refusal(self, address: str) -> Refusal | None:
        limits = self.limits
        if limits.max_sessions and self.open.get(address, 0) >= limits.max_sessions:
            return Refusal("client_session_limit", f"{address} already holds {limits.max_sessions} sessions "
                           f"(io.client_limits.max_sessions={limits.max_sessions}): close one first. Behind a "
                           "proxy, list it in io.trusted_proxies so that each client is counted by its own "
                           "address (X-Forwarded-For)", delay_s=REFUSE_DELAY_S)
        if limits.connects_per_s:
            now, burst = time.monotonic(), max(1.0, 2 * limits.connects_per_s)
            tokens, when = self.buckets.get(address, (burst, now))
            tokens = min(burst, tokens + (now - when) * limits.connects_per_s)
            if tokens < 1:
                self.buckets[address] = (tokens, now)
                return Refusal("client_rate_limited", f"{address} opens sessions faster than "
                               f"io.client_limits.connects_per_s={limits.connects_per_s:g}: try again in a "
                               "moment (reconnect with a backoff)", close_code=1013, delay_s=REFUSE_DELAY_S)
            self.buckets[address] = (tokens - 1, now)
            if len(self.buckets) > _PRUNE_AT:
                self._prune(now)
        return None

    def _prune(self, now: float) -> None:
        rate, burst = self.limits.connects_per_s, max(1.0, 2 * self.limits.connects_per_s)
        for address, (tokens, when) in list(self.buckets.items()):
            if tokens + (now - when) * rate >= burst:
                del self.buckets[address]

    @contextlib.contextmanager
    def hold(self, scope: Mapping[str, Any], *, limited: bool = True) -> Iterator[Refusal | None]:
        """For one connection's life: None if its address may open it (counted until the block ends),
        else why not. ``limited=False``: a route that is not limited per address."""
        address = self.address(scope)
        if not limited or self._exempt(address):
            yield None
            return
        refusal = self._refusal(address)
        if refusal is not None:
            yield refusal
            return
        self.open[address] = self.open.get(address, 0) + 1
        try:
            yield None
        finally:
            self.open[address] -= 1
            if not self.open[address]:
                del self.open[address]
