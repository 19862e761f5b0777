"""io=realtime without a server: a session's sink, its conversation view, its turn settings and
the client audio's resampler, driven with messages built by hand (what the graph would send)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nodes.io._realtime_events import ProtocolError, SessionConfig
from nodes.io.realtime import (
    LowLatencyResampler,
    RealtimeSink,
    Response,
    Session,
    apply_vad_settings,
    fit_vad_settings,
    vad_turn_settings,
)
from nodes.llm._conversation import Conversation
from s2s_flow.messages import Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.node import Context


class _Wire:
    """What a session sends, as the client would read it; and the interrupts its sink asks for."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.interrupts: list[tuple[int, str]] = []

    def emit(self, text: str) -> None:
        self.events.append(json.loads(text))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def _sink(tmp_path, config: SessionConfig | None = None) -> tuple[RealtimeSink, Session, _Wire]:
    wire = _Wire()
    session = Session(wire.emit, config or SessionConfig())
    sink = RealtimeSink()
    sink.session = session
    epoch = [0]

    def interrupt(turn: int, reason: str) -> None:
        wire.interrupts.append((turn, reason))
        epoch[0] = max(epoch[0], turn)
        sink.on_interrupt(turn)

    sink.ctx = Context("sink", tmp_path, epoch=lambda: epoch[0], interrupt=interrupt)
    sink.ctx.inputs_connected = frozenset(RealtimeSink.inputs)
    sink.setup()
    return sink, session, wire


def _speech(turn: int, *, speculative: bool = False) -> Speech:
    return Speech(turn=turn, pcm=np.zeros(1600, np.float32), rate=16000, start=0.5, end=0.6, speech_end_t=0.0,
                  speculative=speculative)


def test_a_turn_that_goes_on_after_a_withdrawn_speculation_stays_one_user_item(tmp_path):
    sink, session, wire = _sink(tmp_path)
    # turn 1: asked and answered (its reply is under way)
    sink.process("started", SpeechStarted(turn=1, start=0.2))
    sink.process("speech", _speech(1))
    sink.process("user", Transcript(turn=1, text="Tell me a story."))
    sink.process("agent", TextDelta(turn=1, text="Once upon a time"))
    # turn 2 barges in; the VAD speculates at a pause, then the user goes on (turn 3 continues 2)
    sink.process("started", SpeechStarted(turn=2, start=3.0))
    assert wire.interrupts == [(2, "barge-in")]
    sink.process("speech", _speech(2, speculative=True))
    sink.process("user", Transcript(turn=2, text="What is", speculative=True))
    sink.process("started", SpeechStarted(turn=3, start=3.0, continues=2))
    sink.process("speech", _speech(3))
    sink.process("user", Transcript(turn=3, text="What is the capital of France?"))

    assert wire.interrupts == [(2, "barge-in")], "the withdrawal interrupted already: no second barge-in"
    started = wire.of("input_audio_buffer.speech_started")
    assert len(started) == 2, "one speech_started per user item, none for the continuation"
    item = started[1]["item_id"]
    assert [e["item_id"] for e in wire.of("input_audio_buffer.committed")][1:] == [item]
    assert len(wire.of("input_audio_buffer.committed")) == 2, "the speculative Speech commits nothing"
    completed = wire.of("conversation.item.input_audio_transcription.completed")
    assert [(e["item_id"], e["transcript"]) for e in completed[1:]] == [(item, "What is the capital of France?")]
    assert [e["response"]["status"] for e in wire.of("response.done")] == ["cancelled"], "turn 1's reply was cut"
    assert session.answering == 3


def test_a_continuation_whose_start_was_flushed_by_the_withdrawal_announces_the_speech(tmp_path):
    """The VAD's SpeechStarted(2) can still be on its way when the withdrawal's interrupt (turn 3)
    flushes it as stale: the continuation is then the first the sink hears of the user speaking."""
    sink, session, wire = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.2))
    sink.process("speech", _speech(1))
    sink.process("user", Transcript(turn=1, text="Tell me a story."))
    sink.process("agent", TextDelta(turn=1, text="Once upon a time"))
    sink.process("started", SpeechStarted(turn=3, start=3.0, continues=2))  # turn 2's start never came
    started = wire.of("input_audio_buffer.speech_started")
    assert len(started) == 2 and started[1]["item_id"] == session.user_item(3)
    assert wire.interrupts == [(3, "barge-in")]  # the reply under way is cut as by any new speech


def test_partial_transcription_deltas_carry_over_to_the_continuing_turn(tmp_path):
    sink, _, wire = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    sink.process("partial", Transcript(turn=1, text="Please explain", final=False))
    sink.process("started", SpeechStarted(turn=2, start=0.0, continues=1))
    sink.process("partial", Transcript(turn=2, text="Please explain how tides work", final=False))
    sink.process("user", Transcript(turn=2, text="Please explain how tides work."))
    deltas = [e["delta"] for e in wire.of("conversation.item.input_audio_transcription.delta")]
    assert "".join(deltas) == "Please explain how tides work.", deltas


def test_a_held_turn_waits_for_response_create_and_its_transcript(tmp_path):
    config = SessionConfig()
    config.update({"audio": {"input": {"turn_detection": {"create_response": False}}}})
    sink, session, wire = _sink(tmp_path, config)
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    sink.process("speech", _speech(1))
    resp = Response("resp_1")
    session.ask(resp)  # response.create before the transcript is in: it waits for it
    assert session.inbox.empty()
    assert session.holds(1), "the LLM is not to answer turn 1 by itself"
    sink.process("user", Transcript(turn=1, text="What time is it?"))
    kind, dispatched = session.inbox.get_nowait()
    assert kind == "respond" and dispatched is resp and [p.text for p in resp.inputs] == ["What time is it?"]
    assert not wire.of("response.created"), "the source begins it, as a turn of its own"


def test_the_conversation_view_leaves_out_deleted_items_and_uses_a_responses_instructions(tmp_path):
    _, session, _ = _sink(tmp_path)
    conversation = Conversation("You are a helpful assistant.", 8)

    for turn, (user, reply) in enumerate([("My name is Ada.", "Hello Ada."), ("I like tea.", "Tea is nice."),
                                          ("What is my name?", "")], start=1):
        item = session.user_item(turn)
        session.add_item(item)
        conversation.add_user(user, turn)
        conversation.exchanges[-1].reply = reply
        resp = session.response(turn)
        session.add_item(resp.item_id)
    session.responses[3].instructions = "Answer in French."
    assert session.history(conversation).messages()[0] == {"role": "system", "content": "Answer in French."}

    session.delete(session.responses[2].item_id)  # "Tea is nice." is gone, the user's words stay
    assert [(m["role"], m["content"]) for m in session.history(conversation).messages()[1:]] == [
        ("user", "My name is Ada."), ("assistant", "Hello Ada."), ("user", "I like tea.\nWhat is my name?")]
    session.delete(session.user_items[1])  # a reply without its question, and nothing before it: gone too
    assert [(m["role"], m["content"]) for m in session.history(conversation).messages()[1:]] == [
        ("user", "I like tea.\nWhat is my name?")]
    assert len(conversation.exchanges) == 3, "the LLM's own history is untouched: the view leaves items out"
    with pytest.raises(ProtocolError) as unknown:
        session.delete("item_nope")
    assert unknown.value.code == "item_not_found"


def test_turn_detection_reaches_the_sessions_vad_and_what_it_cannot_take_is_refused(tmp_path):
    from nodes.vad.silero import SileroVAD

    vad = SileroVAD()
    assert vad_turn_settings(vad) == {"threshold": 0.5, "silence_duration_ms": 500, "prefix_padding_ms": 30}
    config = SessionConfig()
    config.update({"audio": {"input": {"turn_detection": {"threshold": 0.7, "silence_duration_ms": 800,
                                                          "prefix_padding_ms": 300}}}})
    apply_vad_settings(vad, config.turn_detection)
    assert (vad.threshold, vad._min_silence, vad._pad) == (0.7, 16000 * 800 // 1000, 16000 * 300 // 1000)
    assert vad._neg_threshold == pytest.approx(0.55)
    with pytest.raises(ProtocolError, match="threshold"):
        config.update({"audio": {"input": {"turn_detection": {"threshold": 1.5}}}})
    assert config.turn_detection["threshold"] == 0.7, "all or nothing"
    config.update({"audio": {"input": {"turn_detection": None}}})
    assert config.manual and not config.auto_response
    config.update({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    assert config.turn_detection["silence_duration_ms"] == 800, "back to the last server_vad settings"
    speculating = SileroVAD(speculate_ms=200)
    start = vad_turn_settings(speculating) | {"type": "server_vad"}
    with pytest.raises(ProtocolError, match="speculate_ms"):
        fit_vad_settings(speculating, start, {**start, "silence_duration_ms": 150})
    fitted = fit_vad_settings(speculating, start, {**start, "prefix_padding_ms": 300})  # OpenAI's default
    assert fitted["prefix_padding_ms"] == 200, "a stock client's settings are taken, as far as the VAD can"
    with pytest.raises(ProtocolError, match="takes no turn settings"):
        fit_vad_settings(None, {"threshold": 0.5}, {"threshold": 0.6, "silence_duration_ms": 500,
                                                    "prefix_padding_ms": 30})


@pytest.mark.parametrize("rate_in", [24000, 48000, 44100, 8000])
def test_client_audio_reaches_the_pipeline_rate_at_once_and_band_limited(rate_in):
    """soxr's stream mode hands its output back in bursts 20-40 ms late: each turn's end would
    wait for that. The session's resampler returns every 20 ms append's samples at once."""
    step, out = rate_in // 50, 16000 // 50
    resample = LowLatencyResampler(rate_in, 16000)
    impulse = np.zeros(rate_in, np.float32)
    impulse[rate_in // 2] = 1.0
    pieces = [resample(impulse[i : i + step]) for i in range(0, rate_in, step)]
    assert {len(p) for p in pieces} == {out}, "every append comes out whole, none held back"
    delay_ms = (np.argmax(np.abs(np.concatenate(pieces))) / 16000 - 0.5) * 1000
    assert 0 <= delay_ms <= 3.5
    t = np.arange(rate_in) / rate_in
    for freq, lowest, highest in ((1000, 0.97, 1.03), (5000, 0.97, 1.03), (9500, 0.0, 0.001)):
        if freq >= rate_in / 2:
            continue
        tone = np.sin(2 * np.pi * freq * t).astype(np.float32)
        resample = LowLatencyResampler(rate_in, 16000)
        y = np.concatenate([resample(tone[i : i + step]) for i in range(0, rate_in, step)])[4000:]
        level = np.sqrt(2 * np.mean(y**2))
        assert lowest <= level <= highest, (freq, level)  # 9.5 kHz cannot fold back into the speech band


def test_the_live_transcriber_is_in_a_sessions_graph_only_when_it_is_on():
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose

    cfg, choices = compose(["io=realtime"])
    graph = plan(cfg, choices)
    assert "partials" not in graph.nodes, "off by default: no thread woken for every 20 ms of audio"
    cfg, choices = compose(["io=realtime", "io.partials.interval_ms=300"])
    edges = {e.key for e in plan(cfg, choices).edges}
    assert {"source.audio -> partials.audio", "vad.started -> partials.started",
            "partials.text -> sink.partial"} <= edges


def test_a_sessions_voice_goes_to_its_own_tts_node_when_the_backend_can_switch(tmp_path, monkeypatch):
    pytest.importorskip("espeakng_loader", reason="needs the espeak extra: pip install 's2s-flow[espeak]'")
    import nodes.tts.espeak as espeak

    spoken: list[str] = []  # the voice of each sentence espeak-ng is asked to speak
    synthesize = espeak.espeak_synthesize
    monkeypatch.setattr(espeak, "espeak_synthesize",
                        lambda text, **kw: (spoken.append(kw["voice"]), synthesize(text, **kw))[1])

    def reply(node: espeak.EspeakTTS) -> np.ndarray:
        return np.concatenate([m.pcm for m in node.process("text", TextDelta(turn=1, text="Good morning.", end=True))])

    nodes = []
    for _ in range(2):
        node = espeak.EspeakTTS()
        node.ctx = Context("tts", tmp_path)
        node.setup()
        nodes.append(node)
    _, session, _ = _sink(tmp_path)
    session.tts = nodes[1]
    assert session.use_voice("de") == "de" and nodes[1].voice == "de"
    spoken.clear()
    assert len(reply(nodes[1])) and len(reply(nodes[0]))
    assert spoken == ["de", "en-us"], "the session's node speaks with its voice, another session's with its own"
    assert session.use_voice("alloy") == "de", "an OpenAI voice name keeps the session's voice"
    with pytest.raises(ProtocolError, match="'no-such-voice' is not one"):
        session.use_voice("no-such-voice")
    assert nodes[1].voice == "de"
