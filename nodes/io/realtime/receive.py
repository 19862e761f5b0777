"""A session's client events in: one loop for every transport (the WebSocket's, a WebRTC call's
data channel, a Twilio call's messages), through the connection's ``ws.receive()`` (ASGI messages:
``websocket.receive`` with its ``text``, ``websocket.disconnect``). Each event is rate-limited
(``io.max_events_per_s``) and handed to the client-event handlers, which parse, bound and dispatch
it. A transport says what silence means through ``_quiet`` (webrtc.py: a data channel that never
opens) and how often it is asked (``CHECK_S``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nodes.io.realtime import protocol as events

__all__ = ["Receiver"]


class Receiver:
    """The receive side of server.py's ``_Connection`` (a mixin: the connection has the rest)."""

    CHECK_S = float("inf")  # a quiet client is looked at (_quiet) at least this often
    server: Any
    session: Any
    handlers: Any
    ws: Any
    rate: Any
    done: Any
    overflow: Any
    ending: Any
    shut: Any
    heard_at: float  # the client's last event (a WebRTC call's microphone counts too)

    async def _receive(self) -> None:
        """Client events until the client leaves, stays quiet too long (``_quiet``), or the graph
        ends (or fails), the client stops reading or the drain is over. The events are read by one
        task of their own (``_read``); this one wakes only for what ends the session and for the
        quiet checks, not per event."""
        reader = asyncio.ensure_future(self._read())
        overflow = asyncio.ensure_future(self.overflow.wait())
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            while True:
                wait = min(self.server.options.idle_timeout_s - (time.monotonic() - self.heard_at), self.CHECK_S)
                finished, _ = await asyncio.wait({reader, self.done, overflow, ending}, timeout=max(0.05, wait),
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    if self._quiet():
                        return
                    continue
                if reader in finished:
                    reader.result()  # the client left, or was closed for its rate; or what failed, raised here
                return  # else the graph ended (failed), the client stopped reading, the drain is over
        finally:
            overflow.cancel()
            ending.cancel()
            reader.cancel()

    async def _read(self) -> None:
        """Read and hand over the client's events, at most ``io.max_events_per_s``, until it leaves."""
        while True:
            closing = await self.rate.wait(self.session.send)
            if closing is not None:
                self.shut(closing, 1008, "rate_limited")
                return
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.heard_at = time.monotonic()
            self.handlers.receive(message.get("text"))

    def _quiet(self) -> bool:
        """Nothing came for a while: whether the session ends (it does past ``io.idle_timeout_s``)."""
        idle = self.server.options.idle_timeout_s
        if quiet := time.monotonic() - self.heard_at >= idle:
            self.session.send(events.error("idle_timeout", f"nothing from the client for {idle:g} s "
                                           "(io.idle_timeout_s): the session ends", type="server_error"))
        return quiet
