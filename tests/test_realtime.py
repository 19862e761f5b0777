"""io=realtime: the OpenAI Realtime server, with real clients against the real offline stack
(Silero, Whisper tiny.en, SmolLM2 on llama-server, Piper).

The official ``openai`` SDK's realtime client talks to it as it would to OpenAI; a raw
WebSocket client sends what the SDK never would (bad JSON, oversized frames, wrong keys).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from s2s_flow.cli import describe, plan
from s2s_flow.compose import compose
from s2s_flow.errors import ConfigError
from tests.support.realtime import SERVER_ARGS
from tests.support.recording_proxy import recording_proxy
from tests.support.servers import running_llama_server
from tests.support.speech import synthesize

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("uvicorn", reason="pip install 's2s-flow[serve]'")
websockets = pytest.importorskip("websockets", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("openai", reason="pip install 's2s-flow[bench]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")

from nodes.io.realtime.server import RealtimeServer  # noqa: E402

RATE = 24000  # the protocol's default PCM rate
STORY = "Tell me a long story about a dragon who learns to cook."


def _compose(base_url: str | None, *extra: str):
    args = [*SERVER_ARGS, "llm.max_tokens=32", *extra]
    if base_url:
        args.append(f"llm.base_url={base_url}")
    return compose(args)


def _server(base_url: str, tmp_path, *extra: str) -> RealtimeServer:
    cfg, choices = _compose(base_url, *extra)
    graph = plan(cfg, choices)
    return RealtimeServer(lambda: plan(cfg, choices), graph.nodes["source"].node, tmp_path)


@contextlib.contextmanager
def serving(base_url: str, tmp_path, *extra: str) -> Iterator[tuple[str, RealtimeServer]]:
    """A server of its own for one test: (ws://host:port/v1, the server)."""
    server = _server(base_url, tmp_path, *extra)
    url = server.start()
    try:
        yield url, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llama(smollm2_gguf, llama_server_binary) -> Iterator[str]:
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=("--jinja",)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def served(llama, tmp_path_factory) -> Iterator[tuple[str, RealtimeServer]]:
    server = _server(llama, tmp_path_factory.mktemp("realtime"), "io.max_sessions=6")
    url = server.start()
    yield url, server
    server.stop()


def spoken(text: str, *, lead_s: float = 0.2, tail_s: float = 1.0) -> bytes:
    """PCM16 at 24 kHz: ``text`` spoken, then enough silence for the VAD to end the turn."""
    pcm = np.concatenate([np.zeros(int(lead_s * RATE), np.float32), synthesize(text, rate=RATE),
                          np.zeros(int(tail_s * RATE), np.float32)])
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def appends(pcm: bytes, piece: int = 9600) -> Iterator[str]:
    for i in range(0, len(pcm), piece):
        yield base64.b64encode(pcm[i : i + piece]).decode("ascii")


def sdk(url: str):
    """The official openai SDK's realtime connection to the server at ``url`` (ws://host:port/v1)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(api_key="unused", websocket_base_url=url).realtime.connect(model="s2s-flow")


def until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    """Wait for a condition of another thread (no fixed sleeps): checks it as it changes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.02)


# -- compose time ---------------------------------------------------------------------------


def test_dry_run_prints_the_graph_and_the_endpoint(tmp_path):
    cfg, choices = _compose(None, "io.port=9123")
    text = describe(plan(cfg, choices))
    assert "serves: ws://127.0.0.1:9123/v1/realtime" in text
    assert "source.text -> llm.text" in text and "stt.text -> llm.text" in text, "typed messages join the STT's"


def test_binding_beyond_loopback_without_a_key_is_a_compose_time_error(monkeypatch):
    monkeypatch.delenv("S2S_REALTIME_API_KEY", raising=False)
    cfg, choices = _compose(None, "io.host=0.0.0.0")
    with pytest.raises(ConfigError, match="io.api_key"):
        plan(cfg, choices)
    cfg, choices = _compose(None, "io.host=0.0.0.0", "io.allow_public=true")
    plan(cfg, choices)
    monkeypatch.setenv("S2S_REALTIME_API_KEY", "k")
    cfg, choices = _compose(None, "io.host=0.0.0.0")
    plan(cfg, choices)


# -- the openai SDK -------------------------------------------------------------------------


COMPLETED = "conversation.item.input_audio_transcription.completed"


async def _collect(conn, *, until_type: str = "response.done", audio: list[bytes] | None = None,
                   also: tuple[str, ...] = ()) -> list[Any]:
    """The events up to the first ``until_type``, and on until each of ``also`` came too (a spoken
    turn's transcript may come before or after its response's events)."""
    events, seen = [], set()
    async for event in conn:
        if event.type == "response.output_audio.delta" and audio is not None:
            audio.append(base64.b64decode(event.delta))
        events.append(event)
        seen.add(event.type)
        if until_type in seen and seen.issuperset(also):
            return events
    raise AssertionError("the connection closed early")


def test_openai_sdk_spoken_question_gets_transcript_and_reply_audio(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.audio.output.format.rate == RATE
            for chunk in appends(spoken("How many kilometers are there in a marathon?")):
                await conn.input_audio_buffer.append(audio=chunk)
            audio: list[bytes] = []
            return await _collect(conn, audio=audio, also=(COMPLETED,)), b"".join(audio)

    events, audio = asyncio.run(talk())
    types = [e.type for e in events]
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
                 "response.created", "response.output_item.added", "response.content_part.added",
                 "response.output_audio.delta", "response.output_audio_transcript.delta",
                 "response.output_audio.done", "response.output_audio_transcript.done", "response.done"):
        assert kind in types, (kind, types)
    assert types.index("input_audio_buffer.speech_started") < types.index("response.created")
    heard = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert "marathon" in heard.transcript.lower()
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "completed"
    said = done.response.output[0].content[0].transcript
    assert len(said.split()) >= 2
    pcm = np.frombuffer(audio, "<i2")
    assert len(pcm) / RATE > 0.5 and np.abs(pcm).max() > 300, "reply audio, 24 kHz PCM16"


def test_openai_sdk_text_item_and_response_create(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await conn.session.update(session={"type": "realtime", "instructions": "You are terse."})
            item = {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "What is the capital of France?"}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create(response={"output_modalities": ["text"]})
            text_events = await _collect(conn)
            await conn.conversation.item.create(item={**item, "content": [{"type": "input_text",
                                                                          "text": "Say hello."}]})
            await conn.response.create()
            audio: list[bytes] = []
            audio_events = await _collect(conn, audio=audio)
            return text_events, audio_events, b"".join(audio)

    text_events, audio_events, audio = asyncio.run(talk())
    assert any(e.type == "session.updated" and e.session.instructions == "You are terse." for e in text_events)
    assert "response.output_text.delta" in [e.type for e in text_events]
    assert "response.output_audio.delta" not in [e.type for e in text_events], "text only, as asked"
    done = text_events[-1]
    assert done.response.status == "completed" and done.response.output[0].content[0].text.strip()
    assert audio_events[-1].response.status == "completed" and len(audio) > RATE  # > 0.5 s of PCM16


def test_sessions_leave_the_garbage_collector_as_the_server_settled_it(served, monkeypatch):
    """The server collects and freezes once, after loading its models. A session does neither
    (a full collection stops every thread: the other sessions' turns), nor unfreezes at its end.
    Counted as calls: the frozen count itself drops whenever a frozen object is freed."""
    url, server = served
    assert gc.get_freeze_count() > 0, "the server froze what it loaded"
    calls: list[str] = []
    for name in ("collect", "freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])

    async def talk():
        async with sdk(url) as conn:
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Say hello."}]})
            await conn.response.create(response={"output_modalities": ["text"]})
            return await _collect(conn)

    assert asyncio.run(talk())[-1].response.status == "completed"
    until(lambda: server.open == 0, what="the session to end")
    assert calls == []


def _spoken_sentences(server: RealtimeServer, session_id: str, response_id: str) -> int:
    """How many sentences of a reply the server has sent audio of (0 before its response exists)."""
    session = server.sessions.get(session_id)
    resp = next((r for r in session.by_item.values() if r.id == response_id), None) if session else None
    return len(resp.sentences) if resp is not None else 0


def test_barge_in_cancels_the_reply_and_truncate_cuts_what_the_llm_sees(llama, tmp_path):
    """The user speaks over a reply once its second sentence is playing: the reply is cancelled, its
    open parts are closed, and a truncate to 100 ms leaves only the first spoken piece (a sentence,
    or its first clause) in the history the next request carries, as llama-server received it.
    The next turn waits for response.create (create_response=false): that request comes after
    the truncate."""
    async def talk(url, server):
        async with sdk(url) as conn:
            created = await conn.recv()
            for chunk in appends(spoken(STORY)):
                await conn.input_audio_buffer.append(audio=chunk)
            events = await _collect(conn, until_type="response.created")
            first = events[-1].response.id
            while _spoken_sentences(server, created.session.id, first) < 2:
                events.append(await conn.recv())
                assert events[-1].type != "response.done", "the reply ended before its second sentence was spoken"
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "create_response": False}}}})
            for chunk in appends(spoken("Stop, what is the capital of France?")):
                await conn.input_audio_buffer.append(audio=chunk)
            events += await _collect(conn)  # the cut reply's response.done
            cut = events[-1]
            item_id = cut.response.output[0].id
            reply = server.sessions[created.session.id].by_item[item_id]
            sent_ms = sum(len(base64.b64decode(e.delta)) for e in events
                          if e.type == "response.output_audio.delta") * 1000 // (2 * RATE)
            for event_id, target, end_ms in (("evt_nope", "item_nope", 0), ("evt_past", item_id, sent_ms + 1000),
                                             ("evt_neg", item_id, -1), ("evt_cut", item_id, 100)):
                await conn.conversation.item.truncate(item_id=target, content_index=0, audio_end_ms=end_ms,
                                                      event_id=event_id)
                async for event in conn:  # the answer: an error, or the item truncated
                    events.append(event)
                    if event.type in ("error", "conversation.item.truncated"):
                        break
            while [e.type for e in events].count("conversation.item.input_audio_transcription.completed") < 2:
                events.append(await conn.recv())
            await conn.response.create()
            rest = await _collect(conn)  # the answer to the second question
            return events, rest, reply.heard(100), reply.heard()

    # Speculation off: with vad.speculate_ms the LLM keeps a reply's exchange once it reads the
    # turn's confirmation, which a barge-in during the reply's stream drops as stale (the whole
    # exchange is then forgotten at the next turn): a matter of the speculation, not the truncate.
    with recording_proxy(llama) as proxy, \
            serving(proxy.url, tmp_path, "llm.max_tokens=200", "vad.speculate_ms=0") as (url, server):
        events, rest, first_piece, all_sent = asyncio.run(asyncio.wait_for(talk(url, server), 300))
    cut = next(e for e in events if e.type == "response.done")
    assert cut.response.status == "cancelled" and cut.response.status_details.reason == "turn_detected"
    mine = [e.type for e in events if getattr(e, "response_id", None) == cut.response.id]
    assert mine[-4:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                         "response.content_part.done", "response.output_item.done"], "its open parts, closed"
    after = events[events.index(cut) + 1:] + rest
    assert not [e for e in after if getattr(e, "response_id", None) == cut.response.id]
    assert [e.type for e in events].count("input_audio_buffer.speech_started") == 2

    errors = {e.error.event_id: e.error for e in events if e.type == "error"}
    assert set(errors) == {"evt_nope", "evt_past", "evt_neg"}, "refused, and only those"
    assert errors["evt_nope"].code == "item_not_found" and errors["evt_nope"].param == "item_id"
    assert (errors["evt_past"].code, errors["evt_past"].param) == ("invalid_value", "audio_end_ms")
    assert "past the" in errors["evt_past"].message
    assert (errors["evt_neg"].code, errors["evt_neg"].param) == ("invalid_value", "audio_end_ms")
    truncated = next(e for e in events if e.type == "conversation.item.truncated")
    assert (truncated.item_id, truncated.audio_end_ms) == (cut.response.output[0].id, 100)

    assert rest[-1].response.status == "completed"
    transcripts = [e.transcript for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert "france" in transcripts[-1].lower()
    request = next(body for body in reversed(proxy.bodies("/chat/completions"))
                   if "france" in json.dumps(body["messages"][-1]).lower())
    said = [m["content"] for m in request["messages"] if m["role"] == "assistant"]
    assert said == [first_piece], "the history keeps what the client played: the reply's first spoken piece"
    assert first_piece and len(first_piece) < len(all_sent), "more than that was sent before the cut"


def test_response_cancel_ends_the_response_as_cancelled_by_the_client(served):
    url, _ = served

    async def talk():
        async with sdk(url) as conn:
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me about the history of Rome."}]})
            await conn.response.create()
            await conn.response.cancel()  # reaches the session right behind its response.create
            events = await _collect(conn)
            await conn.response.cancel(event_id="evt_late")
            after = await _collect(conn, until_type="error")  # everything sent after response.done
            return events, after

    events, after = asyncio.run(talk())
    done, late = events[-1], after[-1]
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
    assert not [e for e in after if e.type.endswith(".delta") and getattr(e, "response_id", None) == done.response.id]
    assert late.error.code == "response_cancel_not_active" and late.error.event_id == "evt_late"


# -- a raw WebSocket client: what the SDK never sends --------------------------------------


def _raw(url: str, **kwargs: Any):
    from websockets.sync.client import connect

    return connect(f"{url}/realtime", open_timeout=10, **kwargs)


def _next(ws, kind: str | None = None) -> dict[str, Any]:
    while True:
        event = json.loads(ws.recv(timeout=60))
        if kind is None or event["type"] == kind:
            return event


def test_bad_events_get_an_error_and_the_session_goes_on(served):
    url, _ = served
    with _raw(url) as ws:
        assert _next(ws)["type"] == "session.created"
        ws.send("{not json")
        assert _next(ws, "error")["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "no.such.event", "event_id": "evt_7"}))
        error = _next(ws, "error")["error"]
        assert error["code"] == "unknown_event" and error["event_id"] == "evt_7"
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "x" * ((1 << 20) + 1)}))
        assert _next(ws, "error")["error"]["code"] == "frame_too_large"
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "e2"}))
        error = _next(ws, "error")["error"]
        assert error["code"] == "invalid_audio" and error["event_id"] == "e2"
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {
            "type": "audio/pcm", "rate": 16000}}}}}))
        assert _next(ws)["session"]["audio"]["output"]["format"]["rate"] == 16000, "still served"


def test_a_client_that_leaves_mid_reply_frees_its_threads_and_connections(served, llama):
    import psutil

    url, server = served
    port = int(llama.rsplit(":", 1)[1].split("/")[0])
    me = psutil.Process()

    def to_llama() -> int:
        return sum(1 for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port
                   and c.status == psutil.CONN_ESTABLISHED)

    until(lambda: server.open == 0, what="earlier sessions to end")
    before = {t.ident for t in threading.enumerate()}
    baseline_threads, baseline_conns = threading.active_count(), to_llama()
    with _raw(url) as ws:
        _next(ws, "session.created")
        for chunk in appends(spoken(STORY)):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        _next(ws, "response.output_audio.delta")
        assert threading.active_count() > baseline_threads
    # gone mid-reply: the session's threads end and its stream to llama-server is closed
    def new_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in before]

    until(lambda: not new_threads(), what=lambda: f"the session's threads to end: {new_threads()}")
    until(lambda: to_llama() <= baseline_conns, what="the connection to llama-server to close")


def test_the_session_limit_answers_with_an_error_and_1008(llama, tmp_path):
    with serving(llama, tmp_path, "io.max_sessions=1") as (url, _), _raw(url) as first:
        _next(first, "session.created")
        with _raw(url) as second:
            error = _next(second)
            assert error["type"] == "error" and error["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                second.recv(timeout=10)
            assert closed.value.rcvd.code == 1008


def test_an_idle_session_is_told_and_closed(llama, tmp_path):
    with serving(llama, tmp_path, "io.idle_timeout_s=0.5") as (url, server):
        with _raw(url) as ws:
            _next(ws, "session.created")
            assert _next(ws, "error")["error"]["code"] == "idle_timeout"
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                ws.recv(timeout=30)
        until(lambda: server.open == 0, what="the idle session to end")


def test_an_api_key_is_required_as_bearer_or_subprotocol(llama, tmp_path, monkeypatch):
    monkeypatch.delenv("S2S_REALTIME_API_KEY", raising=False)
    with serving(llama, tmp_path, "io.api_key=sesame") as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                _raw(url, additional_headers=headers)
            assert refused.value.response.status_code == 401
            assert b"sesame" not in refused.value.response.body
        with _raw(url, additional_headers={"Authorization": "Bearer sesame"}) as ws:
            assert _next(ws)["type"] == "session.created"
        with _raw(url, subprotocols=["realtime", "openai-insecure-api-key.sesame"]) as ws:
            assert ws.subprotocol == "realtime" and _next(ws)["type"] == "session.created"


# -- many sessions --------------------------------------------------------------------------


QUESTIONS = {  # each with a word Whisper tiny.en never misses
    "weather": "What is the weather going to be like in Paris tomorrow?",
    "sister": "Can you remind me to call my sister at seven tonight?",
    "marathon": "How many kilometers are there in a marathon?",
    "music": "Please play some relaxing music in the living room.",
}


def _metrics(url: str) -> dict[str, float]:
    """The server's /metrics, as Prometheus text read back: sample name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url.replace("ws://", "http://").removesuffix("/v1") + "/metrics").read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def test_four_concurrent_sessions_get_their_own_answers_on_one_copy_of_each_model(served):
    from faster_whisper import WhisperModel
    from piper import PiperVoice

    url, server = served

    async def one(text: str):
        async with sdk(url) as conn:
            for chunk in appends(spoken(text)):
                await conn.input_audio_buffer.append(audio=chunk)
            audio: list[bytes] = []
            return await _collect(conn, audio=audio, also=(COMPLETED,)), b"".join(audio)

    async def all_at_once():
        return await asyncio.gather(*(one(text) for text in QUESTIONS.values()))

    until(lambda: server.open == 0, what="earlier sessions to end")
    before = _metrics(url)  # the served server's figures so far (other tests' sessions)
    results = asyncio.run(all_at_once())
    for word, (events, audio) in zip(QUESTIONS, results, strict=True):
        heard = [e.transcript.lower() for e in events
                 if e.type == "conversation.item.input_audio_transcription.completed"]
        assert len(heard) == 1 and word in heard[0], (word, heard)
        assert not [w for w in QUESTIONS if w != word and w in heard[0]], "no cross-talk"
        done = next(e for e in events if e.type == "response.done")
        assert done.response.status == "completed" and len(audio) > RATE
    # One copy of each model in the server, however many sessions. The test's own helpers hold
    # models too (the voice that makes test speech on a cold cache, the Whisper that checks TTS
    # output): not the server's, so not counted.
    from tests.support import speech, tts_checks

    held = [speech._voice, tts_checks._whisper() if tts_checks._whisper.cache_info().currsize else None]
    gc.collect()
    gc.unfreeze()  # the server froze its models out of the collector's sight (gc.get_objects too)
    try:
        for cls in (WhisperModel, PiperVoice):
            with warnings.catch_warnings():  # isinstance() on every object touches torch's deprecated aliases
                warnings.simplefilter("ignore", FutureWarning)
                copies = [o for o in gc.get_objects() if isinstance(o, cls) and not any(o is h for h in held)]
            assert len(copies) == 1, (cls.__name__, len(copies))
    finally:
        gc.freeze()
    until(lambda: server.open == 0, what="the four sessions to end")
    after = _metrics(url)
    assert after["s2s_sessions_open"] == 0
    assert after["s2s_sessions_total"] - before["s2s_sessions_total"] == 4
    assert after["s2s_turns_total"] - before["s2s_turns_total"] == 4, "four replies completed"
    v2v = after["s2s_voice_to_voice_seconds_count"] - before["s2s_voice_to_voice_seconds_count"]
    assert v2v == 4, "one voice-to-voice sample per spoken turn"
    assert after["s2s_voice_to_voice_seconds_sum"] > before["s2s_voice_to_voice_seconds_sum"]


# -- client tools ---------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                         "description": "The city's name."}},
                               "required": ["city"]}}


@pytest.fixture(scope="module")
def tool_llama(smollm2_gguf, llama_server_binary) -> Iterator[str]:
    """SmolLM2 with Qwen2.5's tool-capable template (tests/test_llm_tools_llama_server.py says why)."""
    from tests.support import tools

    args = ("--jinja", "--chat-template-file", str(tools.TOOL_TEMPLATE_PATH))
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=args) as base_url:
        yield base_url


def test_a_client_tool_round_trip(tool_llama, tmp_path):
    cfg, choices = _compose(tool_llama, "llm.max_tokens=60",
                            "llm.system_prompt=You are a helpful voice assistant. Answer briefly in plain spoken "
                            "sentences.")

    def make_graph():
        graph = plan(cfg, choices)
        graph.nodes["llm"].node.tool_call_prefill = "<tool_call>\n"  # the model can only write the call
        return graph

    server = RealtimeServer(make_graph, plan(cfg, choices).nodes["source"].node, tmp_path)
    url = server.start()

    async def talk():
        async with sdk(url) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER_TOOL], "tool_choice": "required"})
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is the weather in Paris?"}]})
            await conn.response.create(response={"output_modalities": ["text"]})
            rounds = []
            for _ in range(4):  # llm.max_tool_rounds=3: the model answers in words by the 4th response
                done = (await _collect(conn))[-1]
                calls = [item for item in done.response.output if item.type == "function_call"]
                if not calls:
                    return rounds, done
                rounds.append(done)
                for call in calls:  # every call of the round, then one response.create
                    await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                              "output": "sunny, 24 degrees"})
                await conn.response.create(response={"output_modalities": ["text"]})
            raise AssertionError("the model never answered in words")

    try:
        rounds, final = asyncio.run(talk())
    finally:
        server.stop()
    assert rounds, "the model called the client's tool"
    first = [item for item in rounds[0].response.output if item.type == "function_call"]
    assert {item.name for item in first} == {"get_weather"}
    assert all("paris" in json.loads(item.arguments)["city"].lower() for item in first)
    assert all(r.response.status == "completed" for r in rounds) and final.response.status == "completed"
    assert final.response.id not in {r.response.id for r in rounds}
    assert "24" in final.response.output[0].content[0].text  # only the client's output says 24 degrees


def test_the_servers_key_is_a_secret_in_every_config_the_run_writes():
    from s2s_flow import redact

    cfg, _ = _compose(None, "io.api_key=open-sesame-42")
    shown = json.dumps(redact.masked(cfg))
    assert "open-sesame-42" not in shown and redact.masked(cfg)["io"]["api_key"] == "***"
    hidden = redact.hide_overrides(["io=realtime", "io.api_key=open-sesame-42"], cfg)
    assert hidden[1].startswith("io.api_key=${oc.env:")


def test_live_transcription_deltas_arrive_while_the_user_speaks(llama, tmp_path):
    async def talk(url):
        async with sdk(url) as conn:
            pcm = spoken("Please explain how many kilometers there are in a marathon race.")
            start, step = time.monotonic(), 2 * RATE // 50  # 20 ms appends at a microphone's pace
            for i, chunk in enumerate(appends(pcm, step)):
                await asyncio.sleep(max(0.0, start + i * 0.02 - time.monotonic()))
                await conn.input_audio_buffer.append(audio=chunk)
            return await _collect(conn, until_type="conversation.item.input_audio_transcription.completed")

    with serving(llama, tmp_path, "io.partials.interval_ms=300") as (url, _):
        events = asyncio.run(talk(url))
    types = [e.type for e in events]
    deltas = [i for i, t in enumerate(types) if t == "conversation.item.input_audio_transcription.delta"]
    assert deltas and deltas[0] < types.index("input_audio_buffer.speech_stopped"), types
    assert "kilometers" in events[-1].transcript.lower()
