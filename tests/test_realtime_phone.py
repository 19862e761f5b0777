"""Phone audio: G.711 (``audio/pcmu``, ``audio/pcma``) as Realtime formats, and the Twilio Media
Streams endpoint ``/v1/twilio``, against the real offline stack (Silero, Whisper tiny.en,
SmolLM2 on llama-server, Piper).

Twilio cannot be reached from here: a simulated phone sends what Twilio's documentation says a
bidirectional stream sends (``connected``, ``start``, 20 ms ``media`` frames of base64 mu-law in
real time, ``mark`` echoes once the audio before a mark has played, ``stop``) and plays what it
gets back at 8 kHz in real time, dropping its queue on ``clear``. Its speech is real (Piper),
and the reply audio it played is read back by Whisper.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from nodes.io.realtime import g711
from s2s_flow.compose import compose
from tests.support.realtime import READ_BACK, serving
from tests.support.recording_proxy import recording_proxy
from tests.support.speech import synthesize
from tests.support.tts_checks import transcribe, words, words_recovered

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("uvicorn", reason="pip install 's2s-flow[serve]'")
websockets = pytest.importorskip("websockets", reason="pip install 's2s-flow[serve]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")

from nodes.io.realtime.server import RealtimeServer  # noqa: E402

PHONE_RATE = 8000
FRAME = 160  # 20 ms of 8 kHz mu-law: what Twilio sends per media message
SILENCE = b"\xff" * FRAME  # mu-law zero
ASK = "Tell me a long story about a dragon who learns to cook."
TALK_OVER = "Stop. Tell me about the city of Paris instead."  # a reply of many words, for Whisper
INSTRUCTIONS = "You answer the phone for the Acme bakery."


def _to_pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def _from(raw: bytes, fmt: str) -> np.ndarray:
    return np.frombuffer(g711.decode(raw, fmt), "<i2").astype(np.float32) / 32768


def said(text: str, fmt: str, tail_s: float = 1.0) -> bytes:
    """``text`` spoken at 8 kHz in ``fmt``, then silence enough for the VAD to end the turn."""
    pcm = np.concatenate([np.zeros(1600, np.float32), synthesize(text, rate=PHONE_RATE),
                          np.zeros(int(tail_s * PHONE_RATE), np.float32)])
    return g711.from_pcm16(_to_pcm16(pcm), fmt)


# -- the codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_tables_match_the_reference_codec_code_for_code(fmt):
    """Every 16-bit sample encodes, and every code decodes, as CPython's audioop (Sun's g711.c) does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop", reason="the reference codec: Python <= 3.12, or pip install "
                                      "audioop-lts")
    samples = np.arange(-32768, 32768, dtype="<i2").tobytes()
    encode, decode = (audioop.lin2ulaw, audioop.ulaw2lin) if fmt == "audio/pcmu" else (audioop.lin2alaw,
                                                                                        audioop.alaw2lin)
    assert g711.from_pcm16(samples, fmt) == encode(samples, 2)
    assert g711.decode(bytes(range(256)), fmt) == decode(bytes(range(256)), 2)


# -- G.711 as session formats, through a raw Realtime client --------------------------------


@pytest.fixture(scope="module")
def served(smollm2_server, tmp_path_factory) -> Iterator[tuple[str, RealtimeServer]]:
    with serving(smollm2_server, tmp_path_factory.mktemp("phone"), "llm.max_tokens=32") as served:
        yield served


def _next(ws, kind: str) -> dict[str, Any]:
    while True:
        event = json.loads(ws.recv(timeout=120))
        if event["type"] in (kind, "error"):
            return event


def test_a_pcma_session_hears_g711_and_answers_in_g711_that_whisper_reads_back(served):
    from websockets.sync.client import connect

    url, _ = served
    with connect(f"{url}/realtime", open_timeout=10, max_size=None) as ws:
        _next(ws, "session.created")
        for event_id, fmt, code in (("e1", {"type": "audio/opus"}, "unsupported_format"),
                                    ("e2", {"type": "audio/pcmu", "rate": 16000}, "invalid_value")):
            ws.send(json.dumps({"type": "session.update", "event_id": event_id,
                                "session": {"type": "realtime", "audio": {"input": {"format": fmt}}}}))
            error = _next(ws, "session.updated")
            assert error["type"] == "error", error
            assert (error["error"]["code"], error["error"]["event_id"]) == (code, event_id)
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcma"}}, "output": {"format": {"type": "audio/pcma"}}}}}))
        updated = _next(ws, "session.updated")["session"]["audio"]
        assert updated["input"]["format"] == updated["output"]["format"] == {"type": "audio/pcma"}
        speech = said("How many kilometers are there in a marathon?", "audio/pcma")
        for i in range(0, len(speech), 1600):  # 200 ms appends, one byte a sample
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(speech[i : i + 1600]).decode()}))
        heard = _next(ws, "conversation.item.input_audio_transcription.completed")
        audio = b""
        while (event := json.loads(ws.recv(timeout=120)))["type"] != "response.done":
            if event["type"] == "response.output_audio.delta":
                audio += base64.b64decode(event["delta"])
    assert "marathon" in heard["transcript"].lower(), heard
    assert event["response"]["status"] == "completed"
    transcript = event["response"]["output"][0]["content"][0]["transcript"]
    assert len(audio) / PHONE_RATE > 0.5, "one byte per 8 kHz sample"
    read_back = transcribe(_from(audio, "audio/pcma"), PHONE_RATE)
    assert words_recovered(transcript, read_back) >= READ_BACK, (transcript, read_back)


# -- Twilio Media Streams ---------------------------------------------------------------------


@dataclass
class Phone:
    """Twilio's side of a bidirectional stream: the caller's audio out every 20 ms, the reply
    played at 8 kHz in real time, marks echoed once played, the queue dropped on ``clear``."""

    ws: Any
    stream_sid: str = "MZ0123456789abcdef0123456789abcdef"
    call_sid: str = "CA0123456789abcdef0123456789abcdef"
    voice: bytearray = field(default_factory=bytearray)  # the caller's speech still to send
    queue: list[tuple[str, Any]] = field(default_factory=list)  # ("audio", bytes) / ("mark", name) to play
    played: list[bytes] = field(default_factory=list)  # per reply (a clear starts the next): audio played
    received: list[int] = field(default_factory=list)  # ... and bytes of audio received
    echoed: list[str] = field(default_factory=list)  # every mark echoed
    reached: list[str] = field(default_factory=list)  # ... of those, the marks playback reached (not dropped)
    events: list[tuple[str, int]] = field(default_factory=list)  # (event, frames sent so far)
    frames: int = 0
    sequence: int = 0
    playing: bool = True

    async def send(self, message: dict[str, Any]) -> None:
        self.sequence += 1
        await self.ws.send(json.dumps({**message, "sequenceNumber": str(self.sequence)}))

    async def open(self) -> None:
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await self.send({"event": "start", "streamSid": self.stream_sid, "start": {
            "streamSid": self.stream_sid, "accountSid": "AC0123456789abcdef0123456789abcdef",
            "callSid": self.call_sid, "tracks": ["inbound"], "customParameters": {},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        self.played.append(b"")
        self.received.append(0)

    async def tick(self) -> None:
        """20 ms: one media frame out, 20 ms of the queue played (marks behind it echoed)."""
        frame, self.voice[:FRAME] = bytes(self.voice[:FRAME]) or SILENCE, b""
        frame = frame.ljust(FRAME, b"\xff")
        self.frames += 1
        await self.send({"event": "media", "streamSid": self.stream_sid, "media": {
            "track": "inbound", "chunk": str(self.frames), "timestamp": str(20 * self.frames),
            "payload": base64.b64encode(frame).decode()}})
        budget = FRAME if self.playing else 0
        while self.queue and (self.queue[0][0] == "mark" or budget):
            kind, value = self.queue.pop(0)
            if kind == "mark":
                self.reached.append(value)
                await self._echo(value)
                continue
            piece, rest = value[:budget], value[budget:]
            self.played[-1] += piece
            budget -= len(piece)
            if rest:
                self.queue.insert(0, ("audio", rest))

    async def play_out(self) -> None:
        """Play what is queued at once (the test need not listen to a whole second reply)."""
        while self.queue:
            kind, value = self.queue.pop(0)
            if kind == "mark":
                await self._echo(value)
            else:
                self.played[-1] += value

    async def _echo(self, name: str) -> None:
        self.echoed.append(name)
        await self.send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def listen(self) -> None:
        async for text in self.ws:
            message = json.loads(text)
            assert message.get("streamSid") == self.stream_sid, message
            kind = message["event"]
            self.events.append((kind, self.frames))
            if kind == "media":
                self.queue.append(("audio", base64.b64decode(message["media"]["payload"])))
                self.received[-1] += len(self.queue[-1][1])
            elif kind == "mark":
                self.queue.append(("mark", message["mark"]["name"]))
            elif kind == "clear":  # what was not played is dropped; its marks come back
                dropped = [value for k, value in self.queue if k == "mark"]
                self.queue, self.playing = [], True
                self.played.append(b"")
                self.received.append(0)
                for name in dropped:
                    await self._echo(name)
            else:
                raise AssertionError(f"Twilio has no {kind!r} message")

    def played_ms(self, reply: int) -> float:
        return 1000 * len(self.played[reply]) / PHONE_RATE if len(self.played) > reply else 0.0


def test_a_twilio_call_is_answered_heard_and_cut_by_the_caller(smollm2_server, tmp_path):
    """The caller asks for a story over a Media Stream, listens a moment, and talks over it: the
    server cleared Twilio's queue (``clear``), truncated the reply to what the echoed marks say
    was played, and answered the new question. Played at 8 kHz mu-law, the first reply opens with
    the words its transcript does, and the second is what Whisper hears of it."""
    async def call(url: str, server: RealtimeServer) -> tuple[Phone, Any, int]:
        async with websockets.connect(f"{url}/twilio", open_timeout=10, max_size=None) as ws:
            phone = Phone(ws)
            await phone.open()
            listener = asyncio.create_task(phone.listen())
            phone.voice += said(ASK, "audio/pcmu")
            while phone.played_ms(0) < 1500:  # the reply plays for a second and a half
                await phone.tick()
                await asyncio.sleep(0.02)
            session = next(iter(server.sessions.values()))
            first = next(iter(session.responses.values()))
            phone.playing = False  # a stall (the network's): the caller hears no more until the clear
            while not any(start >= phone.played_ms(0) for start, _ in first.sentences):
                await phone.tick()  # until a piece was sent that the caller has not heard begin
                await asyncio.sleep(0.02)
            talk_over = phone.frames
            phone.voice += said(TALK_OVER, "audio/pcmu")
            while len(session.responses) < 2 or not all(r.done for r in session.responses.values()):
                await phone.tick()
                await asyncio.sleep(0.02)
                assert not listener.done(), listener.exception()
            second = max(session.responses.values(), key=lambda r: r.turn)
            while phone.received[-1] < second.audio_ms * 8:  # the last audio on its way: 8 bytes a ms
                await phone.tick()
                await asyncio.sleep(0.02)
            await phone.play_out()
            await phone.send({"event": "stop", "streamSid": phone.stream_sid, "stop": {
                "accountSid": "AC0123456789abcdef0123456789abcdef", "callSid": phone.call_sid}})
            await asyncio.wait_for(listener, 30)  # the server ends the session and closes the socket
            return phone, session, talk_over

    with recording_proxy(smollm2_server) as proxy, serving(
            proxy.url, tmp_path, "llm.max_tokens=80", "vad.speculate_ms=0",
            f"io.twilio.instructions='{INSTRUCTIONS}'") as (url, server):
        phone, session, talk_over = asyncio.run(asyncio.wait_for(call(url, server), 300))
        assert server.open == 0
    first, second = sorted(session.responses.values(), key=lambda r: r.turn)
    kinds = [k for k, _ in phone.events]
    assert set(kinds) == {"media", "mark", "clear"} and kinds.count("clear") == 1, "one barge-in, one clear"
    clear_at = next(frames for k, frames in phone.events if k == "clear")
    assert clear_at > talk_over, "cleared when the caller talked over the reply, not before"
    assert first.done and first.audio_ms > phone.played_ms(0), "cut: more was sent than the caller heard"
    assert phone.echoed and all(n.startswith((first.item_id, second.item_id)) for n in phone.echoed)
    assert [k for k, _ in phone.events[:2]] == ["media", "mark"], "a mark behind each piece of audio"

    requests = proxy.bodies("/chat/completions")
    assert all(INSTRUCTIONS in r["messages"][0]["content"] for r in requests), "io.twilio.instructions"
    user = [m["content"] for m in requests[-1]["messages"] if m["role"] == "user"]
    assert "dragon" in user[0].lower() and "paris" in user[-1].lower(), user
    kept = [m["content"] for m in requests[-1]["messages"] if m["role"] == "assistant"]
    played = max(int(n.rpartition(":")[2]) for n in phone.reached if n.startswith(first.item_id))
    assert kept[0] == first.heard(played), "the history keeps what the caller heard (not what a clear dropped)"
    assert kept[0] != first.heard(), "not all that was sent"

    heard_first = transcribe(_from(phone.played[0], "audio/pcmu"), PHONE_RATE)
    assert words(heard_first)[:3] == words(first.text)[:3], (first.text, heard_first)  # the 1.5 s it played
    heard_second = transcribe(_from(phone.played[1], "audio/pcmu"), PHONE_RATE)
    assert second.text.strip() and words_recovered(second.text, heard_second) >= READ_BACK, (second.text, heard_second)


def test_with_an_auth_token_a_call_needs_twilios_signature(smollm2_server, tmp_path, monkeypatch):
    """Twilio signs the stream's URL (HMAC-SHA1 with the account's auth token): a call without the
    signature, or with a wrong one, is refused with 401; a signed one is served; so is the bearer key."""
    from websockets.sync.client import connect

    from nodes.io.realtime.twilio import twilio_signature

    monkeypatch.delenv("TWILIO_AUTH_TOKEN", raising=False)
    with serving(smollm2_server, tmp_path, "io.api_key=sesame", "io.twilio.auth_token=tw-token-93") as (url, _):
        host = url.removeprefix("ws://").split("/")[0]
        good = twilio_signature("tw-token-93", f"wss://{host}/v1/twilio")
        for headers in ({}, {"X-Twilio-Signature": twilio_signature("other", f"wss://{host}/v1/twilio")},
                        {"Authorization": "Bearer wrong"}):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                connect(f"{url}/twilio", open_timeout=10, additional_headers=headers)
            assert refused.value.response.status_code == 401
        for headers in ({"X-Twilio-Signature": good}, {"Authorization": "Bearer sesame"}):
            with connect(f"{url}/twilio", open_timeout=10, additional_headers=headers) as ws:
                ws.send(json.dumps({"event": "stop", "streamSid": "MZ1", "stop": {}}))
                with pytest.raises(websockets.exceptions.ConnectionClosedOK):
                    ws.recv(timeout=30)  # served, then ended by the stop


def test_the_twilio_auth_token_is_a_secret_in_every_config_the_run_writes():
    from s2s_flow import redact

    cfg, _ = compose(["recipe=local_cpu", "server=null", "io=realtime", "io.twilio.auth_token=tw-secret-77"])
    assert "tw-secret-77" not in json.dumps(redact.masked(cfg))


def test_a_voice_the_tts_cannot_speak_is_logged_and_the_call_stays_in_mu_law(smollm2_server, tmp_path, caplog):
    from websockets.sync.client import connect

    with serving(smollm2_server, tmp_path, "io.twilio.voice=no-such-voice") as (url, server), \
            connect(f"{url}/twilio", open_timeout=10) as ws:
        phone = {"streamSid": "MZ1"}
        ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        ws.send(json.dumps({**phone, "event": "start", "start": {"streamSid": "MZ1", "callSid": "CA1", "mediaFormat": {
            "encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
        for _ in range(50):  # a second of silence: the session takes it in mu-law
            ws.send(json.dumps({**phone, "event": "media", "media": {"payload": base64.b64encode(SILENCE).decode()}}))
        deadline = time.monotonic() + 30
        while not any("no-such-voice" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the refused voice was not logged"
            time.sleep(0.05)
        config = next(iter(server.sessions.values())).config
        assert (config.input_format, config.output_format, config.input_rate) == ("audio/pcmu", "audio/pcmu", 8000)
        ws.send(json.dumps({**phone, "event": "stop", "stop": {}}))
        with pytest.raises(websockets.exceptions.ConnectionClosedOK):
            ws.recv(timeout=30)
    assert not [r for r in caplog.records if "invalid_audio" in r.getMessage() or "not valid" in r.getMessage()]
