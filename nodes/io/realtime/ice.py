"""ICE for the WebRTC calls (webrtc.py): which addresses the host candidates are on, the STUN/TURN
servers, and a loopback server's view of an offer.

aioice, under aiortc, gathers host candidates on every interface but loopback, with no option to
choose: ``host_addresses()`` chooses for the peer connections set up inside it (the server's, from
``io.host``; a test client's, on loopback).
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
from collections.abc import Iterator
from typing import Any

__all__ = ["addresses_for", "host_addresses", "ice_servers", "loopback_only"]

_LOOPBACK_HOSTS = {"127.0.0.1": ["127.0.0.1"], "localhost": ["127.0.0.1"], "::1": ["::1"]}
_ALL = ("0.0.0.0", "::", "")

_addresses: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("s2s_ice_addresses", default=None)


def _hook_host_addresses() -> None:
    """aioice gathers host candidates on every interface but loopback, with no option to choose:
    its one function that lists them answers from ``host_addresses()`` where one is in force."""
    import aioice.ice as ice

    if getattr(ice.get_host_addresses, "s2s_hook", False):
        return
    original = ice.get_host_addresses

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        chosen = _addresses.get()
        return list(chosen) if chosen is not None else original(use_ipv4, use_ipv6)

    get_host_addresses.s2s_hook = True  # type: ignore[attr-defined]
    ice.get_host_addresses = get_host_addresses


@contextlib.contextmanager
def host_addresses(addresses: list[str] | None) -> Iterator[None]:
    """Gather ICE host candidates on ``addresses`` (None: aioice's own choice) for the peer
    connections whose ``setLocalDescription`` runs inside (a client's too: the tests' loopback)."""
    _hook_host_addresses()
    token = _addresses.set(addresses)
    try:
        yield
    finally:
        _addresses.reset(token)


def addresses_for(host: str) -> list[str] | None:
    """The host candidates' addresses for a server bound to ``host`` (None: every interface's)."""
    if host in _LOOPBACK_HOSTS:
        return _LOOPBACK_HOSTS[host]
    try:
        return [str(ipaddress.ip_address(host))] if host not in _ALL else None
    except ValueError:  # a host name: every interface
        return None


def loopback_only(sdp: str) -> str:
    """The offer without its candidates off loopback (and its mDNS names): a loopback server tries
    no other address."""
    def keep(line: str) -> bool:
        if not line.startswith("a=candidate:"):
            return True
        fields = line.split()
        try:
            return len(fields) > 4 and ipaddress.ip_address(fields[4]).is_loopback
        except ValueError:
            return False
    return "\r\n".join(line for line in sdp.splitlines() if keep(line)) + "\r\n"


def ice_servers(servers: list[dict[str, Any]]) -> list[Any]:
    from aiortc import RTCIceServer

    return [RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
            for s in servers]
