"""``/v1/twilio``: a phone call through Twilio Media Streams, served as a Realtime session.

Point a number's TwiML at it (a bidirectional stream)::

    <Response><Connect><Stream url="wss://HOST/v1/twilio"/></Connect></Response>

Twilio's WebSocket messages (https://www.twilio.com/docs/voice/media-streams/websocket-messages)
are translated here, both ways, to the Realtime events of one session per call; the session, its
graph and the transport are the Realtime server's own (server.py), so a call behaves as a
Realtime client with ``audio/pcmu`` in and out would:

- ``connected``: nothing to do. ``start``: the session takes G.711 mu-law at 8 kHz both ways and
  ``io.twilio.instructions`` (a ``session.update``), then ``io.twilio.voice`` (another: a voice
  the TTS cannot speak is logged, and the call goes on with the TTS's own).
- ``media`` (base64 mu-law, 20 ms each): ``input_audio_buffer.append`` as it is (no re-encoding).
- the reply's audio deltas: ``media`` to Twilio, each followed by a ``mark`` named
  ``<item id>:<ms of the reply sent so far>``; Twilio echoes a mark once the audio before it
  has played, so the last echoed mark says how much of the reply the caller heard.
- the caller's speech starting while reply audio is queued at Twilio: ``clear`` (Twilio drops
  what it has not played), and the reply's item truncated (``conversation.item.truncate``) to
  what its echoed marks say was played, so the LLM's history keeps what the caller heard: at
  once if its response was done (all sent, still playing at Twilio), else after the
  ``response.done`` of the server's own cut.
- ``stop``: the call ended; the session ends as if the client left.

Auth: Twilio cannot send a bearer key. With ``io.twilio.auth_token`` (or $TWILIO_AUTH_TOKEN) set,
a connection needs a valid ``X-Twilio-Signature`` (HMAC-SHA1 of ``wss://<Host><path>`` with the
token, as Twilio signs a stream's URL); with ``io.api_key`` set, a bearer key works too (tests,
other gateways). With neither, the endpoint is open, as ``/v1/realtime`` is on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
from typing import Any

from nodes.io.realtime.g711 import G711_RATE

__all__ = ["TwilioCall", "TWILIO_TOKEN_ENV", "twilio_signature"]

log = logging.getLogger("s2s_flow.realtime.twilio")
TWILIO_TOKEN_ENV = "TWILIO_AUTH_TOKEN"
_PCMU = {"type": "audio/pcmu"}


def twilio_signature(auth_token: str, url: str) -> str:
    """``X-Twilio-Signature`` of a request without form parameters (a WebSocket upgrade)."""
    digest = hmac.new(auth_token.encode(), url.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


class TwilioCall:
    """The WebSocket of one Twilio call, seen by the Realtime connection as a Realtime client's:
    ``receive()`` gives client events, ``send_text()`` takes server events."""

    def __init__(self, ws: Any, *, voice: str | None = None, instructions: str | None = None) -> None:
        self.ws, self.voice, self.instructions = ws, voice, instructions
        self.scope, self.headers = ws.scope, ws.headers
        self.stream_sid: str | None = None
        self.call_sid: str | None = None
        self._injected: asyncio.Queue[str] = asyncio.Queue()  # client events of our own (truncate)
        self._recv: asyncio.Task | None = None
        self._sent_ms: dict[str, float] = {}  # per reply item: ms of audio sent to Twilio
        self._played_ms: dict[str, int] = {}  # per reply item: ms Twilio says it played (its echoed marks)
        self._queued: set[str] = set()  # marks sent, not echoed yet: audio Twilio still has to play
        self._dropped: set[str] = set()  # marks of audio a clear dropped (Twilio echoes them too)
        self._cleared: set[str] = set()  # reply items a clear cut: none of their audio goes out after it
        self._done: set[str] = set()  # reply items whose response.done came
        self._cut: set[str] = set()  # ... and cleared ones whose response.done has not come yet

    # -- what the Realtime connection calls ---------------------------------------------

    def authorized(self, api_key: str | None, auth_token: str | None) -> tuple[bool, str | None]:
        """(allowed, subprotocol): a valid Twilio signature, or the server's bearer key."""
        if not api_key and not auth_token:
            return True, None
        given = self.headers.get("x-twilio-signature", "")
        if auth_token and given:
            url = f"wss://{self.headers.get('host', '')}{self.scope.get('path', '')}"
            if hmac.compare_digest(given.encode(), twilio_signature(auth_token, url).encode()):
                return True, None
        bearer = self.headers.get("authorization", "")
        ok = bool(api_key) and bearer.lower().startswith("bearer ") and hmac.compare_digest(
            bearer[7:].strip().encode(), str(api_key).encode())
        return ok, None

    async def accept(self, subprotocol: str | None = None) -> None:
        await self.ws.accept()

    async def send_denial_response(self, response: Any) -> None:
        await self.ws.send_denial_response(response)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        if self._recv is not None:
            self._recv.cancel()
        await self.ws.close(code=code, reason=reason)

    async def receive(self) -> dict[str, Any]:
        """The next client event (as a WebSocket message) from what Twilio sends."""
        while True:
            if not self._injected.empty():
                return _frame(self._injected.get_nowait())
            if self._recv is None:
                self._recv = asyncio.ensure_future(self.ws.receive())
            injected = asyncio.ensure_future(self._injected.get())
            try:
                await asyncio.wait({self._recv, injected}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not injected.done():
                    injected.cancel()
            if injected.done() and not injected.cancelled():
                return _frame(injected.result())
            message, self._recv = self._recv.result(), None
            if message["type"] == "websocket.disconnect":
                return message
            event = self._translate(message.get("text"))
            if event is not None:
                return _frame(event)

    async def send_text(self, text: str) -> None:
        """A server event: what of it Twilio is told."""
        event = json.loads(text)
        for message in self._messages(event):
            await self.ws.send_text(json.dumps(message))

    # -- Twilio -> Realtime --------------------------------------------------------------

    def _translate(self, text: str | None) -> str | None:
        try:
            message = json.loads(text or "")
        except ValueError:
            log.warning("twilio: a frame that is not JSON was ignored")
            return None
        kind = message.get("event") if isinstance(message, dict) else None
        if kind == "start":
            return self._start(message)
        if kind == "media" and self.stream_sid is not None:
            media = message.get("media") or {}
            if media.get("track", "inbound") == "inbound" and media.get("payload"):
                return json.dumps({"type": "input_audio_buffer.append", "audio": media["payload"]})
        elif kind == "mark":
            self._echoed(str((message.get("mark") or {}).get("name", "")))
        elif kind == "stop":
            log.info("twilio: call %s ended its stream", self.call_sid)
            self._injected.put_nowait("")  # no event: the end (see _frame)
        return None  # connected, dtmf, and anything else: nothing for the session

    def _start(self, message: dict[str, Any]) -> str | None:
        start = message.get("start") or {}
        self.stream_sid = message.get("streamSid") or start.get("streamSid")
        self.call_sid = start.get("callSid")
        media = start.get("mediaFormat") or {}
        if (media.get("encoding", "audio/x-mulaw"), int(media.get("sampleRate", G711_RATE)),
                int(media.get("channels", 1))) != ("audio/x-mulaw", G711_RATE, 1):
            log.error("twilio: call %s streams %s: only audio/x-mulaw at 8000 Hz, mono is served", self.call_sid,
                      media)
        log.info("twilio: call %s, stream %s", self.call_sid, self.stream_sid)
        session: dict[str, Any] = {"type": "realtime", "audio": {"input": {"format": _PCMU},
                                                                 "output": {"format": _PCMU}}}
        if self.instructions is not None:
            session["instructions"] = self.instructions
        if self.voice:  # an update of its own: a voice the TTS refuses (logged) leaves the call in mu-law
            self._injected.put_nowait(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"output": {"voice": self.voice}}}}))
        return json.dumps({"type": "session.update", "session": session})

    def _echoed(self, name: str) -> None:
        self._queued.discard(name)
        if name in self._dropped:
            self._dropped.discard(name)
            return
        item, _, ms = name.rpartition(":")
        if item and ms.isdigit():
            self._played_ms[item] = max(self._played_ms.get(item, 0), int(ms))

    # -- Realtime -> Twilio --------------------------------------------------------------

    def _messages(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind, sid = event.get("type"), self.stream_sid
        if sid is None:
            return []
        if kind == "response.output_audio.delta":
            item = event["item_id"]
            if item in self._cleared:
                return []
            sent = self._sent_ms[item] = self._sent_ms.get(item, 0.0) + len(base64.b64decode(event["delta"])) / 8
            name = f"{item}:{int(sent)}"
            self._queued.add(name)
            return [{"event": "media", "streamSid": sid, "media": {"payload": event["delta"]}},
                    {"event": "mark", "streamSid": sid, "mark": {"name": name}}]
        if kind == "input_audio_buffer.speech_started" and self._queued:
            cut = {name.rpartition(":")[0] for name in self._queued}
            self._dropped |= self._queued
            self._cleared |= cut
            self._queued = set()
            for item in cut:  # a reply still being made: once the server has ended it (its cut comes first)
                if item in self._done:
                    self._truncate(item)
                else:
                    self._cut.add(item)
            return [{"event": "clear", "streamSid": sid}]
        if kind == "response.done":
            for item in (event["response"].get("output") or ()):
                self._done.add(item.get("id"))
                if item.get("id") in self._cut:
                    self._truncate(item["id"])
        elif kind == "error":
            log.warning("twilio: call %s: %s", self.call_sid, (event.get("error") or {}).get("message"))
        return []

    def _truncate(self, item: str) -> None:
        """A reply the caller talked over: its item truncated to what Twilio played of it."""
        self._cut.discard(item)
        played = min(self._played_ms.get(item, 0), int(self._sent_ms.get(item, 0)))
        self._injected.put_nowait(json.dumps({"type": "conversation.item.truncate", "item_id": item,
                                              "content_index": 0, "audio_end_ms": played}))


def _frame(text: str) -> dict[str, Any]:
    """A client event as the ASGI message the connection reads ("": the call ended)."""
    if not text:
        return {"type": "websocket.disconnect", "code": 1000}
    return {"type": "websocket.receive", "text": text}
