"""io=realtime over WebRTC (``POST /v1/realtime/calls``), with a real aiortc client: its
microphone plays spoken WAVs (Opus, 48 kHz, over loopback ICE), its speaker records the reply,
and Whisper listens to what it heard; the events go on the ``oai-events`` data channel.
The real offline stack answers (Silero, Whisper tiny.en, SmolLM2 on llama-server, Piper).
"""

from __future__ import annotations

import asyncio
import base64
import fractions
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.support.speech import synthesize
from tests.support.tts_checks import transcribe, words_recovered

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("aiortc", reason="pip install 's2s-flow[webrtc]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription  # noqa: E402
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack  # noqa: E402

from nodes.io.realtime.ice import host_addresses  # noqa: E402
from tests.test_realtime import STORY, llama, serving, until  # noqa: E402,F401  (the module's llama-server)

RATE = 48000
FRAME = 960


def _wav(tmp_path, name: str, text: str) -> Any:
    """A spoken WAV at 48 kHz (the tests' Piper speech), as a microphone would record it."""
    path = tmp_path / f"{name}.wav"
    sf.write(path, np.concatenate([synthesize(text, rate=RATE), np.zeros(RATE, np.float32)]), RATE, subtype="PCM_16")
    return path


class Microphone(MediaStreamTrack):
    """A microphone that plays the WAVs it is given, in real time, and silence in between."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue = np.zeros(0, np.int16)
        self.start: float | None = None
        self.pts = 0

    def say(self, wav) -> None:
        pcm, rate = sf.read(wav, dtype="int16")
        assert rate == RATE
        self.queue = np.concatenate([self.queue, pcm])

    @property
    def speaking(self) -> bool:
        return len(self.queue) > 0

    async def recv(self) -> Any:
        import av

        if self.readyState != "live":
            raise MediaStreamError
        if self.start is None:
            self.start = time.monotonic()
        else:
            self.pts += FRAME
            await asyncio.sleep(max(0.0, self.start + self.pts / RATE - time.monotonic()))
        out = np.zeros(FRAME, np.int16)
        take = min(FRAME, len(self.queue))
        out[:take], self.queue = self.queue[:take], self.queue[take:]
        frame = av.AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
        return frame


class Caller:
    """One call: the peer connection, its data channel's events, and the audio its speaker got
    (with, for each event, how many samples had arrived by then)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.log: list[tuple[int, dict[str, Any]]] = []  # (samples heard by then, event)
        self.heard: list[np.ndarray] = []
        self.samples = 0
        self.channel.on("message", self._message)
        self.pc.on("track", lambda track: asyncio.ensure_future(self._listen(track)))
        self.location: str | None = None

    def _message(self, text: str) -> None:
        event = json.loads(text)
        self.log.append((self.samples, event))
        self.events.put_nowait(event)

    async def _listen(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            pcm = frame.to_ndarray().reshape(-1, len(frame.layout.channels)).mean(axis=1)
            assert frame.sample_rate == RATE
            self.heard.append(pcm.astype(np.float32) / 32768)
            self.samples += len(pcm)

    async def dial(self, headers: dict[str, str] | None = None) -> None:
        with host_addresses(["127.0.0.1"]):
            await self.pc.setLocalDescription(await self.pc.createOffer())
        status, answer, location = await asyncio.to_thread(
            post, self.base + "/v1/realtime/calls", self.pc.localDescription.sdp, headers)
        assert status == 201, answer
        assert answer.startswith("v=0") and "opus/48000" in answer.lower()
        self.location = location
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))

    def mark(self) -> int:
        return len(self.log)

    async def until(self, kind: str, since: int = 0, **match: Any) -> dict[str, Any]:
        """The first ``kind`` event (with the fields of ``match``; ``a__b`` for nested ones) from the
        ``since``-th event on, waiting for it if it has not come yet."""
        seen = since
        while True:
            for _, event in self.log[seen:]:
                assert event["type"] != "error", event
                if event["type"] == kind and all(_at(event, k) == v for k, v in match.items()):
                    return event
            seen = len(self.log)
            try:
                await asyncio.wait_for(self.events.get(), 120)
            except TimeoutError:
                raise AssertionError(f"no {kind} {match} in time; the last events: "
                                     f"{[e['type'] for _, e in self.log[-12:]]}") from None

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def audio(self, start: int, end: int | None = None) -> np.ndarray:
        pcm = np.concatenate(self.heard) if self.heard else np.zeros(0, np.float32)
        return pcm[start:end]


def _at(event: dict[str, Any], path: str) -> Any:
    for key in path.split("__"):
        event = event.get(key) if isinstance(event, dict) else None
    return event


def post(url: str, body: str, headers: dict[str, str] | None = None,
         source: str | None = None) -> tuple[int, str, str | None]:
    """POST an offer (from the loopback address ``source``: Linux answers all of 127.0.0.0/8)."""
    transport = httpx.HTTPTransport(local_address=source) if source else None
    with httpx.Client(transport=transport, timeout=60) as client:
        resp = client.post(url, content=body.encode(), headers={"Content-Type": "application/sdp", **(headers or {})})
    return resp.status_code, resp.text, resp.headers.get("location")


def delete(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="DELETE", headers=headers or {}),
                                    timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _base(url: str) -> str:
    return url.replace("ws://", "http://").removesuffix("/v1")


def test_a_webrtc_call_hears_the_user_speaks_the_reply_and_a_barge_in_clears_it(llama, tmp_path):  # noqa: F811
    question = _wav(tmp_path, "question", "How many kilometers are there in a marathon?")
    story = _wav(tmp_path, "story", STORY)
    stop = _wav(tmp_path, "stop", "Stop, what is the capital of France?")

    async def call(base: str, server) -> dict[str, Any]:
        caller = Caller(base)
        await caller.dial()
        created = await caller.until("session.created")
        assert created["session"]["id"] in server.sessions
        caller.mic.say(question)
        heard = await caller.until("conversation.item.input_audio_transcription.completed")
        first = await caller.until("response.created")
        rid = first["response"]["id"]
        started = await caller.until("output_audio_buffer.started", response_id=rid)
        done = await caller.until("response.done", response__id=rid)
        await caller.until("output_audio_buffer.stopped", response_id=rid)
        reply_audio = caller.audio(next(n for n, e in caller.log if e is started))

        mark = caller.mark()
        caller.mic.say(story)
        second = await caller.until("response.created", mark)
        rid2 = second["response"]["id"]
        await caller.until("output_audio_buffer.started", mark, response_id=rid2)
        mark = caller.mark()
        caller.mic.say(stop)  # over the reply, while it plays (its response may be done): a barge-in
        cleared = await caller.until("output_audio_buffer.cleared", mark)
        truncated = await caller.until("conversation.item.truncated", mark)
        cut = await caller.until("response.done", response__id=rid2)
        session = server.sessions[created["session"]["id"]]
        generated_ms = session.by_item[truncated["item_id"]].audio_ms
        third = await caller.until("response.created", mark)
        await caller.until("output_audio_buffer.started", mark, response_id=third["response"]["id"])
        at_clear = next(n for n, e in caller.log if e is cleared)
        at_next = next(n for n, e in caller.log if e.get("type") == "output_audio_buffer.started"
                       and e.get("response_id") == third["response"]["id"])
        after_clear = caller.audio(at_clear, at_next)

        # the client stops a playing reply itself (the Agents SDK's interrupt() sends a response.cancel
        # first, which cuts it on its own: here the clear alone stops what plays and what would follow)
        await caller.until("output_audio_buffer.stopped", mark, response_id=third["response"]["id"])
        mark = caller.mark()
        caller.mic.say(story)
        fourth = await caller.until("response.created", mark)
        await caller.until("output_audio_buffer.started", mark, response_id=fourth["response"]["id"])
        caller.send({"type": "output_audio_buffer.clear"})
        stopped = await caller.until("output_audio_buffer.cleared", mark)
        client_cut = await caller.until("conversation.item.truncated", mark)
        status = await asyncio.to_thread(delete, base + caller.location)
        await caller.pc.close()
        return {"heard": heard, "done": done, "reply_audio": reply_audio, "cut": cut, "cleared": cleared,
                "truncated": truncated, "generated_ms": generated_ms, "after_clear": after_clear,
                "rid2": rid2, "delete": status, "events": [e for _, e in caller.log], "stopped": stopped,
                "client_cut": client_cut, "fourth": fourth["response"]["id"]}

    with serving(llama, tmp_path / "run", "llm.max_tokens=120", "vad.speculate_ms=0") as (url, server):
        got = asyncio.run(asyncio.wait_for(call(_base(url), server), 400))
        until(lambda: not server.sessions, 30, "the hang-up to close the session")
    assert "marathon" in got["heard"]["transcript"].lower()
    assert got["done"]["response"]["status"] == "completed"
    said = got["done"]["response"]["output"][0]["content"][0]["transcript"]
    assert not [e for e in got["events"] if e["type"] == "response.output_audio.delta"], "audio goes as RTP only"
    reply = got["reply_audio"]
    assert len(reply) / RATE > 0.5 and np.abs(reply).max() > 0.01
    hypothesis = transcribe(reply, RATE)
    assert words_recovered(said, hypothesis) >= 0.5, (said, hypothesis)

    if got["cut"]["response"]["status"] != "completed":  # the reply was still being made: cancelled too
        assert got["cut"]["response"]["status"] == "cancelled"
        assert got["cut"]["response"]["status_details"]["reason"] == "turn_detected"
    assert got["truncated"]["item_id"] == got["cut"]["response"]["output"][0]["id"]
    assert got["cleared"]["response_id"] == got["rid2"]
    assert got["truncated"]["audio_end_ms"] < got["generated_ms"], "the history keeps what was played, not all"
    quiet = got["after_clear"]
    # what was in flight when the clear was sent may still arrive (RTP is not held back): a few
    # frames; the rest of the cut reply never comes
    frames = quiet[: len(quiet) // FRAME * FRAME].reshape(-1, FRAME)
    loud = int(np.sum(np.abs(frames).max(axis=1) > 0.01))
    assert loud <= 25, f"{loud} frames of the cut reply came after output_audio_buffer.cleared"
    assert got["stopped"]["response_id"] == got["fourth"]
    fourth_item = next(e["item"]["id"] for e in got["events"] if e["type"] == "response.output_item.added"
                       and e["response_id"] == got["fourth"])
    assert got["client_cut"]["item_id"] == fourth_item
    assert got["delete"] == 204


async def _offer() -> tuple[RTCPeerConnection, str]:
    """A caller's peer connection (a microphone and the events channel) and its offer."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTrack(Microphone())
    pc.createDataChannel("oai-events")
    with host_addresses(["127.0.0.1"]):
        await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


def test_calls_refuse_a_wrong_content_type_a_bad_offer_a_wrong_key_and_a_full_server(llama, tmp_path,  # noqa: F811
                                                                                     monkeypatch):
    monkeypatch.setenv("S2S_REALTIME_API_KEY", "sk-test-key")

    async def calls(base: str, server) -> dict[str, Any]:
        out: dict[str, Any] = {}
        pc, sdp = await _offer()
        key = {"Authorization": "Bearer sk-test-key"}
        out["json"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp,
                                              {**key, "Content-Type": "application/json"})
        out["nokey"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp)
        out["foreign"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp,
                                                 {**key, "Origin": "https://elsewhere.example"})
        out["garbage"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", "hello", key)
        audio_only = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        audio_only.addTrack(Microphone())
        with host_addresses(["127.0.0.1"]):
            await audio_only.setLocalDescription(await audio_only.createOffer())
        out["no_channel"] = await asyncio.to_thread(post, base + "/v1/realtime/calls",
                                                    audio_only.localDescription.sdp, key)
        await audio_only.close()
        out["ok"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp, key)
        pc2, sdp2 = await _offer()
        out["full"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp2, key)
        out["open"] = server.open
        server.drain.draining = True  # SIGTERM (test_realtime_drain.py sends a real one to a server process)
        out["draining"] = await asyncio.to_thread(post, base + "/v1/realtime/calls", sdp2, key)
        server.drain.draining = False
        out["unknown"] = await asyncio.to_thread(delete, base + "/v1/realtime/calls/rtc_nope", key)
        out["unknown_nokey"] = await asyncio.to_thread(delete, base + "/v1/realtime/calls/rtc_nope")
        await pc.close()
        await pc2.close()
        return out

    with serving(llama, tmp_path / "run", "io.max_sessions=1") as (url, server):
        got = asyncio.run(asyncio.wait_for(calls(_base(url), server), 120))
    status, body, _ = got["json"]
    assert status == 415 and "application/sdp" in json.loads(body)["error"]["message"]
    assert got["nokey"][0] == 401
    assert got["foreign"][0] == 403, "the server's Origin guard covers the calls route"
    assert got["garbage"][0] == 400 and "m=audio" in json.loads(got["garbage"][1])["error"]["message"]
    assert got["no_channel"][0] == 400 and "oai-events" in json.loads(got["no_channel"][1])["error"]["message"]
    assert got["ok"][0] == 201 and got["ok"][2].startswith("/v1/realtime/calls/rtc_")
    status, body, _ = got["full"]
    assert status == 503 and json.loads(body)["error"]["code"] == "session_limit_reached"
    assert got["open"] == 1
    assert got["draining"][0] == 503 and json.loads(got["draining"][1])["error"]["code"] == "server_draining"
    assert (got["unknown"], got["unknown_nokey"]) == (404, 401)


def test_calls_are_limited_per_client_address_for_as_long_as_they_last(llama, tmp_path):  # noqa: F811
    """io.client_limits covers WebRTC as it covers WebSockets: one address holds at most its calls (a
    second is answered 429, before any peer connection is built), another address is not held back,
    and a call that ends gives its place back."""
    async def calls(base: str, server) -> dict[str, Any]:
        out: dict[str, Any] = {}
        peers = [await _offer() for _ in range(4)]
        calls_url = base + "/v1/realtime/calls"
        out["first"] = await asyncio.to_thread(post, calls_url, peers[0][1], None, "127.0.0.2")
        out["second"] = await asyncio.to_thread(post, calls_url, peers[1][1], None, "127.0.0.2")
        out["other"] = await asyncio.to_thread(post, calls_url, peers[2][1], None, "127.0.0.3")
        out["open"] = server.open
        out["hung_up"] = await asyncio.to_thread(delete, base + out["first"][2])
        while "127.0.0.2" in server.clients.open:  # the call's task ends, then its place is given back
            await asyncio.sleep(0.05)
        out["again"] = await asyncio.to_thread(post, calls_url, peers[3][1], None, "127.0.0.2")
        for pc, _ in peers:
            await pc.close()
        return out

    with serving(llama, tmp_path / "run", "io.client_limits.max_sessions=1", "io.client_limits.connects_per_s=0",
                 "io.client_limits.exempt=[]") as (url, server):
        got = asyncio.run(asyncio.wait_for(calls(_base(url), server), 120))
        refused = server.metrics.registry.get_sample_value("s2s_sessions_refused_total",
                                                           {"reason": "client_session_limit"})
    assert got["first"][0] == 201 and got["other"][0] == 201 and got["again"][0] == 201
    status, body, _ = got["second"]
    error = json.loads(body)["error"]
    assert status == 429 and error["code"] == "client_session_limit"
    assert "127.0.0.2" in error["message"] and "io.client_limits.max_sessions=1" in error["message"]
    assert got["open"] == 2 and got["hung_up"] == 204 and refused == 1


# -- the Agents SDK's WebRTC transport in Chromium ----------------------------------------------

NODE_TESTS = Path(__file__).with_name("node")


def _browser_tools() -> tuple[str, str]:
    node, chromium = shutil.which("node"), shutil.which("chromium")
    if node is None or chromium is None:
        pytest.skip("no Node.js or Chromium: apt-get install nodejs npm chromium (scripts/bootstrap.sh does it)")
    for package in ("@openai/agents", "playwright-core"):
        if not (NODE_TESTS / "node_modules" / package).is_dir():
            pytest.skip(f"{package} is not installed: npm ci --prefix tests/node (scripts/bootstrap.sh does it)")
    return node, chromium


def _window(pcm: np.ndarray, start: int, end: int | None = None) -> np.ndarray:
    return pcm[max(0, start): end]


def test_the_agents_sdk_over_webrtc_in_chromium_hears_the_user_and_a_barge_in_stops_the_reply(
        llama, tmp_path, monkeypatch):  # noqa: F811
    """OpenAIRealtimeWebRTC (the browser SDK's default transport) in headless Chromium, Chromium's
    fake microphone playing a WAV: the user asks for a long story, then, once a second of it has
    played, asks something else (the page mixes that WAV into the microphone). The SDK gets both
    transcripts; the story's audio stops (cleared) and is truncated to what was played; the
    second answer plays, and Whisper hears its words."""
    node, chromium = _browser_tools()
    monkeypatch.setenv("S2S_REALTIME_API_KEY", "ek_test_key")
    wav, over = tmp_path / "mic.wav", tmp_path / "over.wav"
    sf.write(wav, np.concatenate([np.zeros(RATE // 2, np.float32), synthesize(STORY, rate=RATE),
                                  np.zeros(3 * RATE, np.float32)]), RATE, subtype="PCM_16")
    sf.write(over, np.concatenate([synthesize("Stop, what is the capital of France?", rate=RATE),
                                   np.zeros(RATE, np.float32)]), RATE, subtype="PCM_16")
    out = tmp_path / "result.json"
    with serving(llama, tmp_path / "run", "llm.max_tokens=200", "vad.speculate_ms=0") as (url, server):
        env = {**os.environ, "S2S_BASE_URL": _base(url), "S2S_API_KEY": "ek_test_key", "S2S_WAV": str(wav),
               "S2S_OVER_WAV": str(over), "S2S_CHROMIUM": chromium, "S2S_OUT": str(out)}
        run = subprocess.run([node, "webrtc_browser.mjs"], cwd=NODE_TESTS, env=env, capture_output=True, text=True,
                             timeout=420)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        until(lambda: not server.sessions, 30, "the browser's hang-up to close the session")
    got = json.loads(out.read_text())
    assert got["failed"] is None, got["failed"]
    assert not got["errors"], got["errors"]
    events = got["events"]
    types = [e["type"] for e in events]
    assert "response.output_audio.delta" not in types, "the audio came as RTP"
    heard = [e["transcript"] for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(heard) >= 2 and "dragon" in heard[0].lower() and "france" in heard[-1].lower(), heard
    pcm = np.frombuffer(base64.b64decode(got["pcm16"]), "<i2").astype(np.float32) / 32768
    assert got["rate"] == RATE

    cleared = next((e for e in events if e["type"] == "output_audio_buffer.cleared"), None)
    assert cleared is not None, f"the barge-in cleared nothing: {types}"
    story = next(e for e in events if e["type"] == "output_audio_buffer.started")
    assert cleared["response_id"] == story["response_id"], "the story was what the barge-in stopped"
    truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] > 0
    assert np.abs(_window(pcm, story["at"], cleared["at"])).max() > 0.01, "the story played until the barge-in"
    after = events[events.index(cleared):]
    answer = next(e for e in after if e["type"] == "output_audio_buffer.started")
    stopped = next(e for e in after if e["type"] == "output_audio_buffer.stopped"
                   and e["response_id"] == answer["response_id"])
    quiet = _window(pcm, cleared["at"], answer["at"])
    frames = quiet[: len(quiet) // FRAME * FRAME].reshape(-1, FRAME)
    loud = int(np.sum(np.abs(frames).max(axis=1) > 0.01))
    # what Chromium holds when the clear arrives still plays (its jitter buffer, Web Audio's
    # 4096-sample blocks: some hundreds of ms); the rest of the story never comes
    assert loud <= 75, f"{loud} frames of the cut story came after output_audio_buffer.cleared"

    done = next(e for e in after if e["type"] == "response.done" and e["response"]["id"] == answer["response_id"])
    assert done["response"]["status"] == "completed"
    said = done["response"]["output"][0]["content"][0]["transcript"]
    hypothesis = transcribe(_window(pcm, answer["at"] - 4096, stopped["at"] + 4096), RATE)
    assert words_recovered(said, hypothesis) >= 0.5, (said, hypothesis)


def test_ice_servers_are_checked_at_compose_time_and_their_credentials_masked():
    from s2s_flow import redact
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from s2s_flow.errors import ConfigError

    base = ["recipe=local_cpu", "server=null", "io=realtime", "io.port=0"]
    good = 'io.webrtc.ice_servers=[{urls: "stun:stun.example.org:3478"}, {urls: ["turn:turn.example.org:3478"], ' \
           'username: s2s, credential: turn-secret-42}]'
    cfg, choices = compose([*base, good])
    source = plan(cfg, choices).nodes["source"].node
    assert [s["urls"] for s in source.ice_servers] == ["stun:stun.example.org:3478", "turn:turn.example.org:3478"]
    assert "turn-secret-42" not in json.dumps(redact.masked(cfg))
    for bad, says in (('io.webrtc.ice_servers=[{urls: "http://example.org"}]', "stun:HOST:PORT"),
                      ('io.webrtc.ice_servers=[{urls: "turn:turn.example.org:3478"}]', "username and credential")):
        cfg, choices = compose([*base, bad])
        with pytest.raises(ConfigError, match=says):
            plan(cfg, choices)


def test_the_openai_sdks_calls_create_offer_with_its_session_settings(llama, tmp_path, monkeypatch):  # noqa: F811
    """``AsyncOpenAI.realtime.calls.create`` (openai 3.57) posts the offer as multipart/form-data with
    the session's settings: the answer comes back, and the call's session takes the settings as its
    first update (session.updated on the data channel)."""
    openai = pytest.importorskip("openai", reason="pip install 's2s-flow[bench]'")
    monkeypatch.setenv("S2S_REALTIME_API_KEY", "sk-test-key")

    async def call(base: str) -> list[dict[str, Any]]:
        caller = Caller(base)
        with host_addresses(["127.0.0.1"]):
            await caller.pc.setLocalDescription(await caller.pc.createOffer())
        sdk = openai.AsyncOpenAI(api_key="sk-test-key", base_url=base + "/v1")
        answer = await sdk.realtime.calls.create(sdp=caller.pc.localDescription.sdp, session={
            "type": "realtime", "instructions": "Answer in one word.", "output_modalities": ["text"]})
        await caller.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        await caller.until("session.created")
        updated = await caller.until("session.updated")
        await caller.pc.close()
        return [updated]

    with serving(llama, tmp_path / "run") as (url, server):
        updated, = asyncio.run(asyncio.wait_for(call(_base(url)), 120))
        until(lambda: not server.sessions, 60, "the closed call to end its session")
    assert updated["session"]["instructions"] == "Answer in one word."
    assert updated["session"]["output_modalities"] == ["text"]
