"""WebRTC for ``io=realtime``: the browser SDKs' default transport, through ``aiortc``.

    POST   /v1/realtime/calls            SDP offer (application/sdp) -> 201, the SDP answer, Location
    DELETE /v1/realtime/calls/{call_id}  hangs up

A call is one session, the same as a WebSocket connection's (server.py's ``_Connection``, with
the peer connection as its transport): the client's and the server's events go as text on the
``oai-events`` data channel. The audio goes as Opus at 48 kHz both ways: the microphone's frames
go to the session's source at their own rate (it resamples them to the pipeline's), and the
reply's audio (the session's ``response.output_audio.delta``, which WebRTC clients never get as
events) is resampled to 48 kHz and sent as one 20 ms RTP frame every 20 ms, silence when there is
nothing to say. The server plays the reply, so it says when it starts and stops
(``output_audio_buffer.started`` / ``stopped``); on a barge-in or a cancelled response, and on the
client's ``output_audio_buffer.clear``, what is still unplayed is dropped
(``output_audio_buffer.cleared``) and the reply's item is truncated to what was played, so the LLM's
history holds what the user heard.

ICE: the server's host candidates are on ``io.host``'s address (loopback: 127.0.0.1 only, and only
the client's loopback candidates are tried; 0.0.0.0: every interface), with the STUN/TURN servers
of ``io.webrtc.ice_servers`` for real networks. All candidates are in the answer (no trickle).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import threading
import time
from typing import Any

import numpy as np

from nodes.io.realtime import protocol as events
from nodes.io.realtime.ice import addresses_for, host_addresses, ice_servers, loopback_only
from nodes.io.realtime.protocol import ProtocolError, new_id
from nodes.io.realtime.speaker import OPUS_RATE, Speaker
from s2s_flow.audio import StreamResampler, to_float32
from s2s_flow.errors import MissingDependency
from s2s_flow.node import require

__all__ = ["WebRTCCalls", "host_addresses"]

log = logging.getLogger("s2s_flow.realtime")

CONNECT_TIMEOUT_S = 30.0  # a call whose data channel is not open by then is hung up
CHANNEL_HIGH_BYTES = 1 << 20  # the data channel's send buffer: above it, the sender waits
EVENTS_CHANNEL = "oai-events"
MAX_OFFER_BYTES = 1 << 16  # a browser's offer is a few kB

_WATCHED = ("response.output_audio.delta", "response.output_audio.done", "response.done", "response.created",
            "input_audio_buffer.speech_started")


class _DataChannel:
    """The call's peer connection seen as _Connection's socket: text on ``oai-events`` both ways."""

    def __init__(self, pc: Any) -> None:
        self.pc = pc
        self.channel: Any = None
        self.opened = asyncio.Event()
        self.gone = asyncio.Event()
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def attach(self, channel: Any) -> None:
        if channel.label != EVENTS_CHANNEL or self.channel is not None:
            return
        self.channel = channel
        channel.on("message", lambda text: self.incoming.put_nowait(
            {"type": "websocket.receive", "text": text if isinstance(text, str) else None}))
        channel.on("close", self.hang_up)
        if channel.readyState == "open":
            self.opened.set()
        channel.on("open", self.opened.set)

    def hang_up(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            self.incoming.put_nowait({"type": "websocket.disconnect"})

    async def send_text(self, text: str) -> None:
        if not self.opened.is_set():
            opened, gone = asyncio.ensure_future(self.opened.wait()), asyncio.ensure_future(self.gone.wait())
            await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
            gone.cancel()
        if self.gone.is_set() or self.channel is None or self.channel.readyState != "open":
            raise ConnectionError("the call is over")
        self.channel.send(text)
        while self.channel.bufferedAmount > CHANNEL_HIGH_BYTES and not self.gone.is_set():
            await asyncio.sleep(0.01)

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.hang_up()
        await self.pc.close()


class _Call:
    """One WebRTC call: a session of the server's, its events on the data channel, its audio on
    the peer connection's audio track. A mixin over the server's connection class (the
    WebSocket's: server.py's ``_Connection``, given by the server, which imports this module),
    whose ``serve`` runs the session; this class moves its events and audio."""

    lazy_graph = False  # the microphone is the call's audio track: no client event comes first
    session: Any
    handlers: Any
    server: Any
    done: Any
    overflow: Any
    ending: Any
    rate: Any
    shut: Any

    def __init__(self, server: Any, pc: Any) -> None:
        self.id = new_id("rtc")
        self.pc, self.channel = pc, _DataChannel(pc)
        self.speaker = Speaker(self._tell)
        self.resamplers: dict[str, StreamResampler] = {}
        self.items: dict[str, str] = {}  # response -> its audio's item
        self.open_responses: set[str] = set()
        self.truncated: set[tuple[str, int]] = set()
        self.books = threading.Lock()  # the four above: the graph's threads and the event loop change them
        super().__init__(server, self.channel, None)
        self.begun = self.heard_at  # (heard_at: the last client event or microphone frame)
        self.handlers._handlers["output_audio_buffer.clear"] = self._client_clear
        self.task: asyncio.Task[None] | None = None
        self.held = contextlib.ExitStack()  # its place in the per-address count (clients.py), until it ends
        pc.on("datachannel", self.channel.attach)
        pc.on("track", self._track)
        pc.on("connectionstatechange", self._state)

    # -- the session's events, on their way to the data channel --------------------------

    def _emit(self, text: str) -> None:
        """Session.send (any thread): the reply's audio to the speaker, the rest to the client."""
        head = text[:120]
        if not any(f'"{kind}"' in head for kind in _WATCHED):
            super()._emit(text)
            return
        event = json.loads(text)
        kind = event["type"]
        if kind == "response.output_audio.delta":
            self._play(event)
            return  # WebRTC clients hear the audio; they get no audio events
        super()._emit(text)
        if kind == "response.created":
            with self.books:
                self.open_responses.add(event["response"]["id"])
        elif kind == "response.output_audio.done":
            self._played_all(event["response_id"])
        elif kind == "response.done":
            response = event["response"]
            with self.books:
                self.open_responses.discard(response["id"])
            self._played_all(response["id"])
            if response.get("status") in ("cancelled", "failed"):
                self._cut({response["id"]}, always=False)
        elif kind == "input_audio_buffer.speech_started" and (
                self.session.config.turn_detection or {}).get("interrupt_response", True):
            # the user speaks over a reply that is still playing (its response may be done: the
            # server plays it out in real time): it stops, as a barge-in cuts a reply under way
            self._cut(self._open(), always=False)

    def _open(self) -> set[str]:
        with self.books:
            return set(self.open_responses)

    def _tell(self, event: dict[str, Any]) -> None:
        super()._emit(events.encode(event))

    def _play(self, event: dict[str, Any]) -> None:
        response_id = event["response_id"]
        with self.books:
            self.items[response_id] = event["item_id"]
            resample = self.resamplers.get(response_id)
            if resample is None:
                resample = self.resamplers[response_id] = StreamResampler(self.session.config.output_rate, OPUS_RATE)
        pcm = resample(to_float32(np.frombuffer(events.decode_pcm16(event["delta"]), "<i2")))
        self.speaker.push(response_id, event["item_id"], (np.clip(pcm, -1, 1) * 32767).astype(np.int16))

    def _played_all(self, response_id: str) -> None:
        with self.books:
            resample, item_id = self.resamplers.pop(response_id, None), self.items.pop(response_id, None)
        if resample is not None and item_id is not None:
            tail = resample(np.zeros(0, np.float32), last=True)
            self.speaker.push(response_id, item_id, (np.clip(tail, -1, 1) * 32767).astype(np.int16))
        self.speaker.finish(response_id)

    def _cut(self, responses: set[str], *, always: bool) -> None:
        """Drop the unplayed audio (and the later audio of ``responses``); the items cut keep, in the
        LLM's history, what was played. ``always``: say it was cleared even with nothing to clear."""
        cut = self.speaker.clear(responses)
        if not cut and not always:
            return
        with self.books:
            for response_id in responses | {r for r, _ in cut}:
                self.resamplers.pop(response_id, None)
                self.items.pop(response_id, None)
        ids = sorted({r for r, _ in cut} or responses)
        self._tell({"type": "output_audio_buffer.cleared", "response_id": ids[0] if ids else None})
        for _, item_id in cut:  # (outside self.books: truncate takes the session's lock)
            played = self.speaker.played_ms(item_id)
            resp = self.session.by_item.get(item_id)
            with self.books:
                if resp is None or (item_id, played) in self.truncated:
                    continue
                self.truncated.add((item_id, played))
            with contextlib.suppress(ProtocolError):
                self.session.truncate(item_id, min(played, int(resp.audio_ms)))

    def _client_clear(self, event: dict[str, Any]) -> None:
        """``output_audio_buffer.clear``: the reply stops now (a ``response.cancel`` before it ends
        the response itself)."""
        self._cut(self._open(), always=True)

    # -- the microphone ------------------------------------------------------------------

    def _track(self, track: Any) -> None:
        if track.kind == "audio":
            asyncio.ensure_future(self._listen(track))

    async def _listen(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        session, warned = self.session, False
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self.heard_at = time.monotonic()
            pcm, channels = frame.to_ndarray(), len(frame.layout.channels)
            pcm = pcm.T if frame.format.is_planar else pcm.reshape(-1, channels)  # samples x channels
            if frame.format.name not in ("s16", "s16p"):
                pcm = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
            mono = pcm.mean(axis=1) if channels > 1 else pcm.reshape(-1)
            raw = mono.astype("<i2").tobytes()
            if session.put(("audio", raw, frame.sample_rate, self.heard_at)):
                if session.config.manual:
                    self.handlers.buffered += len(mono) * session.config.input_rate // frame.sample_rate
            elif not warned:
                warned = True
                log.warning("session %s: the server is behind on this call's audio: frames are dropped", session.id)

    def _state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.channel.hang_up()

    # -- the session --------------------------------------------------------------------------

    CHECK_S = CONNECT_TIMEOUT_S

    def _quiet(self) -> bool:
        """A call whose data channel does not open in CONNECT_TIMEOUT_S is hung up; one that stays
        quiet (no event, no audio: heard_at) ends as a WebSocket does (receive.py: the loop that asks)."""
        if not self.channel.opened.is_set() and time.monotonic() - self.begun >= CONNECT_TIMEOUT_S:
            log.warning("session %s: the call's data channel did not open in %g s: hung up",
                        self.session.id, CONNECT_TIMEOUT_S)
            return True
        return super()._quiet()

    async def _drop(self, code: int, reason: str, error: dict[str, Any]) -> None:
        """A client that does not read its events: told if it still can be, and hung up."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.channel.send_text(events.encode(error)), 1.0)
        await self._close()

    async def _close(self, code: int = 1000) -> None:
        with contextlib.suppress(Exception):
            await self.channel.close()


async def _form(request: Any) -> tuple[bytes, Any]:
    """A multipart offer (the openai SDK's ``realtime.calls.create``): its ``sdp`` and ``session``."""
    require("python_multipart", "webrtc", pip_name="python-multipart")
    form = await request.form()
    sdp, session = form.get("sdp"), form.get("session")
    sdp = await sdp.read() if hasattr(sdp, "read") else (sdp or "").encode()
    if session is not None:
        text = await session.read() if hasattr(session, "read") else session
        try:
            session = json.loads(text)
        except ValueError:
            raise ValueError("the form's 'session' is not JSON: send the session settings as session.update "
                             "takes them") from None
    return sdp, session


class WebRTCCalls:
    """The server's ``/v1/realtime/calls`` routes and the calls under way."""

    def __init__(self, server: Any, connection: type) -> None:
        self.server = server
        self.call_type = type("Call", (_Call, connection), {})
        self.calls: dict[str, Any] = {}
        self.ice_servers = list(getattr(server.options, "ice_servers", None) or [])

    def _denied(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        key = self.server.options.api_key
        given = request.headers.get("authorization", "")
        if not key or (given.lower().startswith("bearer ") and hmac.compare_digest(given[7:].strip().encode(),
                                                                                   key.encode())):
            return None
        return JSONResponse(events.error("invalid_api_key", "missing or wrong API key: send Authorization: Bearer "
                                         "<io.api_key>", type="authentication_error"), status_code=401)

    @staticmethod
    def _refused(status: int, code: str, message: str, kind: str = "invalid_request_error") -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(events.error(code, message, type=kind), status_code=status)

    async def create(self, request: Any) -> Any:
        """``POST /v1/realtime/calls``: an SDP offer in, the answer out (201, ``Location``)."""
        denied = self._denied(request)
        if denied is not None:
            return denied
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("application/sdp", "multipart/form-data"):
            return self._refused(415, "unsupported_media_type", f"the offer is sent as Content-Type: application/sdp "
                                 f"(got {kind or 'none'!r}): POST the browser's offer.sdp as the body (or "
                                 "multipart/form-data with the fields sdp and session, as the openai SDK does)")
        server = self.server
        if getattr(server, "drain", None) is not None and server.drain.draining:
            return self._refused(503, "server_draining", "the server is draining (SIGTERM): call another "
                                 "one, or again once it is back", "server_error")
        # per client address (clients.py), as a WebSocket is; held for the call's life
        held = contextlib.ExitStack()
        refusal = held.enter_context(server.clients.hold(request.scope))
        if refusal is not None:
            held.close()
            server.metrics.refused.labels(refusal.code).inc()
            await asyncio.sleep(refusal.delay_s)
            return self._refused(429, refusal.code, refusal.message)
        with held:
            response, call = await self._answer(request, kind)
            if call is not None:
                call.held = held.pop_all()
                call.task = asyncio.ensure_future(self._run(call))
            return response

    async def _answer(self, request: Any, kind: str) -> tuple[Any, Any]:
        """The offer answered (201) and its call, or why not (and no call)."""
        server = self.server
        refused = await server.admission.admit()  # by count and by load, as a WebSocket is
        if refused is not None:
            server.metrics.refused.labels(refused).inc()
            return self._refused(503, "session_limit_reached", server.admission.explain(refused), "server_error"), None
        if int(request.headers.get("content-length") or 0) > MAX_OFFER_BYTES:
            return self._too_large(), None
        body, update = await request.body(), None
        if len(body) > MAX_OFFER_BYTES:
            return self._too_large(), None
        try:
            require("aiortc", "webrtc")
            if kind == "multipart/form-data":
                body, update = await _form(request)
        except MissingDependency as exc:
            return self._refused(501, "webrtc_not_installed", str(exc), "server_error"), None
        except ValueError as exc:
            return self._refused(400, "invalid_offer", str(exc)), None
        offer = body.decode("utf-8", "replace")
        if not offer.startswith("v=0") or "m=audio" not in offer or "m=application" not in offer:
            return self._refused(400, "invalid_offer", "the body is not an SDP offer with an audio section "
                                 "(m=audio) and a data channel (m=application): send the peer connection's "
                                 "localDescription.sdp after addTrack(microphone), createDataChannel('oai-events') "
                                 "and createOffer()"), None
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        addresses = addresses_for(server.options.host)
        if addresses is not None and all(ipaddress.ip_address(a).is_loopback for a in addresses):
            offer = loopback_only(offer)
        pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers(self.ice_servers)))
        call = self.call_type(server, pc)
        server.admit(call)
        try:
            with host_addresses(addresses):
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
                audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
                if not audio:
                    raise ValueError("the offer has no audio section")
                pc.addTrack(call.speaker.track)
                await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:
            server.release(call)
            await pc.close()
            return self._refused(400, "invalid_offer", f"the SDP offer could not be answered: {exc}"), None
        self.calls[call.id] = call
        if update is not None:  # the form's session: the call's first client event
            call.channel.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(
                {"type": "session.update", "session": update})})
        from starlette.responses import Response

        return Response(pc.localDescription.sdp, status_code=201, media_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{call.id}"}), call

    def _too_large(self) -> Any:
        return self._refused(413, "offer_too_large", f"the offer is over {MAX_OFFER_BYTES} bytes: send the peer "
                             "connection's localDescription.sdp, nothing else")

    async def _run(self, call: Any) -> None:
        try:
            await call.serve()
        except Exception as exc:
            log.error("session %s: the call failed: %s", call.session.id, exc)
        finally:
            self.calls.pop(call.id, None)
            self.server.release(call)
            call.held.close()
            with contextlib.suppress(Exception):
                await call.pc.close()

    async def hang_up(self, request: Any) -> Any:
        """``DELETE /v1/realtime/calls/{call_id}``: the call ends (its session closes)."""
        denied = self._denied(request)
        if denied is not None:
            return denied
        call = self.calls.get(request.path_params["call_id"])
        if call is None:
            return self._refused(404, "call_not_found", f"no call {request.path_params['call_id']!r} on this server "
                                 "(it ended, or never was)")
        call.channel.hang_up()
        from starlette.responses import Response

        return Response(status_code=204)
