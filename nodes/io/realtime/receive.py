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
        ends (or fails), the client stops reading or the drain is over."""
        recv: asyncio.Task | None = None
        overflow = asyncio.ensure_future(self.overflow.wait())
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            while True:
                if recv is None:
                    closing = await self.rate.wait(self.session.send)
                    if closing is not None:
                        self.shut(closing, 1008, "rate_limited")
                        return
                    recv = asyncio.ensure_future(self.ws.receive())
                wait = min(self.server.options.idle_timeout_s - (time.monotonic() - self.heard_at), self.CHECK_S)
                finished, _ = await asyncio.wait({recv, self.done, overflow, ending}, timeout=max(0.05, wait),
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    if self._quiet():
                        return
                    continue
                if recv not in finished:  # the graph ended (failed), the client stopped reading, the drain is over
                    return
                message, recv = recv.result(), None
                if message["type"] == "websocket.disconnect":
                    return
                self.heard_at = time.monotonic()
                self.handlers.receive(message.get("text"))
        finally:
            overflow.cancel()
            ending.cancel()
            if recv is not None:
                recv.cancel()

    def _quiet(self) -> bool:
        """Nothing came for a while: whether the session ends (it does past ``io.idle_timeout_s``)."""
        idle = self.server.options.idle_timeout_s
        if quiet := time.monotonic() - self.heard_at >= idle:
            self.session.send(events.error("idle_timeout", f"nothing from the client for {idle:g} s "
                                           "(io.idle_timeout_s): the session ends", type="server_error"))
        return quiet
