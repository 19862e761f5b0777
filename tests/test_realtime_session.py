"""io=realtime without a server: a session's sink and its responses' lifecycles, its conversation
view, its turn settings and voice, driven with messages built by hand (what the graph would send)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nodes.io.realtime import RealtimeSink
from nodes.io.realtime.protocol import ProtocolError, SessionConfig
from nodes.io.realtime.response import Response
from nodes.io.realtime.session import Session
from nodes.llm._conversation import Conversation
from s2s_flow.messages import AudioOut, Speech, SpeechStarted, TextDelta, Transcript
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
    epoch = [0]

    def interrupt(turn: int, reason: str) -> None:
        wire.interrupts.append((turn, reason))
        epoch[0] = max(epoch[0], turn)
        sink.on_interrupt(turn)

    sink.ctx = Context("sink", tmp_path, epoch=lambda: epoch[0], interrupt=interrupt, session=session)
    sink.ctx.inputs_connected = frozenset(RealtimeSink.inputs)
    sink.setup()
    return sink, session, wire


def _speech(turn: int, *, speculative: bool = False) -> Speech:
    return Speech(turn=turn, pcm=np.zeros(1600, np.float32), rate=16000, start=0.5, end=0.6, speech_end_t=0.0,
                  speculative=speculative)


def _user_turn(sink: RealtimeSink, turn: int, text: str, start: float = 0.2) -> None:
    """A spoken user turn as the graph reports it to the sink: its start, its speech, its transcript."""
    sink.process("started", SpeechStarted(turn=turn, start=start))
    sink.process("speech", _speech(turn))
    sink.process("user", Transcript(turn=turn, text=text))


def test_a_turn_that_goes_on_after_a_withdrawn_speculation_stays_one_user_item(tmp_path):
    sink, session, wire = _sink(tmp_path)
    # turn 1: asked and answered (its reply is under way)
    _user_turn(sink, 1, "Tell me a story.")
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


def _lifecycle(wire: _Wire, response_id: str) -> list[str]:
    """The events of one response, from response.created to response.done."""
    return [e["type"] for e in wire.events if response_id in (e.get("response_id"), e.get("response", {}).get("id"))]


def test_a_reply_cut_by_the_users_speech_closes_its_parts_before_response_done(tmp_path):
    sink, session, wire = _sink(tmp_path)
    _user_turn(sink, 1, "Tell me a story.")
    sink.process("agent", TextDelta(turn=1, text="Once upon a time. ", sentence_end=True))
    tone = np.full(2400, 0.1, np.float32)  # 100 ms at the session's output rate
    sink.process("audio", AudioOut(turn=1, pcm=tone, rate=24000, text="Once upon a time."))
    sink.process("agent", TextDelta(turn=1, text="There was a dragon."))  # said, not yet spoken
    sink.process("started", SpeechStarted(turn=2, start=3.0))  # the user barges in

    resp = session.responses[1]
    assert _lifecycle(wire, resp.id) == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_audio_transcript.delta", "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "response.done"]
    transcript = wire.of("response.output_audio_transcript.done")[0]["transcript"]
    assert transcript == "Once upon a time. There was a dragon.", "the transcript as sent"
    item = wire.of("response.output_item.done")[0]["item"]
    assert item["status"] == "incomplete" and wire.of("conversation.item.done")[-1]["item"] == item
    done = wire.of("response.done")[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    assert done["output"] == [item]
    assert session.playback.heard(1) == "Once upon a time.", "the history keeps what was spoken"
    sink.process("audio", AudioOut(turn=1, pcm=tone, rate=24000, text="There was a dragon."))
    assert _lifecycle(wire, resp.id)[-1] == "response.done", "nothing of it after its response.done"


def test_a_reply_ends_when_both_its_words_and_its_audio_are_in_and_fails_if_its_llm_broke_off(tmp_path):
    """The sink's ports are read in no fixed order: the TTS's end of audio may come before the LLM's
    last words (or its error), which still belong to the response."""
    sink, session, wire = _sink(tmp_path)
    _user_turn(sink, 1, "Hello?")
    sink.process("audio", AudioOut(turn=1, pcm=np.full(2400, 0.1, np.float32), rate=24000, text="Hi there."))
    sink.process("audio", AudioOut(turn=1, pcm=np.zeros(0, np.float32), rate=24000, end=True))
    assert not wire.of("response.done"), "its words are not all in"
    sink.process("agent", TextDelta(turn=1, text="Hi there.", end=True))
    (done,) = wire.of("response.done")
    assert done["response"]["status"] == "completed"
    assert wire.of("response.output_audio_transcript.done")[0]["transcript"] == "Hi there."

    _user_turn(sink, 2, "And then?", start=5.0)
    sink.process("audio", AudioOut(turn=2, pcm=np.zeros(0, np.float32), rate=24000, end=True))
    sink.process("agent", TextDelta(turn=2, text="", end=True, error="the stream broke off"))
    failed = wire.of("response.done")[-1]["response"]
    assert failed["status"] == "failed" and failed["status_details"]["error"]["message"] == "the stream broke off"
    assert [e["response"]["status"] for e in wire.of("response.done")] == ["completed", "failed"]


def test_a_confirmed_speculative_reply_may_end_before_its_transcript_which_still_completes_the_item(tmp_path):
    """A reply held at a speculative pause is released at the turn's confirmation, when the STT's
    transcript goes out too: it may reach the sink first, and even end. The transcript that follows
    completes the user's item, and leaves no turn behind as the one being answered."""
    sink, session, wire = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.2))
    sink.process("speech", _speech(1))
    sink.process("audio", AudioOut(turn=1, pcm=np.full(2400, 0.1, np.float32), rate=24000, text="Hi there."))
    sink.process("agent", TextDelta(turn=1, text="Hi there.", end=True))
    sink.process("audio", AudioOut(turn=1, pcm=np.zeros(0, np.float32), rate=24000, end=True))
    assert [e["response"]["status"] for e in wire.of("response.done")] == ["completed"]
    sink.process("user", Transcript(turn=1, text="Hello?"))
    (completed,) = wire.of("conversation.item.input_audio_transcription.completed")
    assert completed["transcript"] == "Hello?"
    assert session.answering is None, "its response is done: no tool call can belong to it now"
    assert not session.active(), "a response.create may follow"


def test_a_cancelled_text_reply_closes_its_text_part_and_one_never_begun_opens_none(tmp_path):
    config = SessionConfig()
    config.update({"output_modalities": ["text"]})
    sink, session, wire = _sink(tmp_path, config)
    _user_turn(sink, 1, "Tell me a story.")
    sink.process("agent", TextDelta(turn=1, text="Once upon"))
    session.cancel_begun()
    sink.ctx.interrupt(2, "response.cancel")  # what the source does with response.cancel
    resp = session.responses[1]
    assert _lifecycle(wire, resp.id) == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.done"]
    assert wire.of("response.output_text.done")[0]["text"] == "Once upon"
    assert wire.of("response.done")[0]["response"]["status_details"]["reason"] == "client_cancelled"

    waiting = Response("resp_waiting", modalities=["text"])
    session.hold(5, session.user_item(5))  # a spoken turn held for response.create, its transcript on its way
    session.ask(waiting)
    assert not waiting.dispatched
    session.cancel_asked()
    assert _lifecycle(wire, "resp_waiting") == ["response.created", "response.done"], "no part was opened"


def test_a_reply_that_ends_in_client_tool_calls_closes_what_it_said_first(tmp_path):
    from nodes.io.realtime.client_tools import ClientCall

    sink, session, wire = _sink(tmp_path)
    _user_turn(sink, 1, "What is the weather in Paris?")
    sink.process("agent", TextDelta(turn=1, text="Let me check. "))
    session.end_with_calls(1, [ClientCall("call_1", "get_weather", '{"city": "Paris"}', 1)])
    resp = session.responses[1]
    assert _lifecycle(wire, resp.id) == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_audio_transcript.delta", "response.output_audio.done",
        "response.output_audio_transcript.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.done"]
    done = wire.of("response.done")[0]["response"]
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message", "function_call"]


def test_a_continuation_whose_start_was_flushed_by_the_withdrawal_announces_the_speech(tmp_path):
    """The VAD's SpeechStarted(2) can still be on its way when the withdrawal's interrupt (turn 3)
    flushes it as stale: the continuation is then the first the sink hears of the user speaking."""
    sink, session, wire = _sink(tmp_path)
    _user_turn(sink, 1, "Tell me a story.")
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


def test_a_voice_turn_committed_as_a_text_response_begins_waits_instead_of_overlapping_it(tmp_path):
    """The interleaving the race makes: the user speaks (turn 1, answered by itself), a typed message
    and its response.create arrive before the VAD commits, the source begins that response as turn
    2, and only then does turn 1's transcript reach the LLM. The LLM does not answer it: the spoken
    item waits for the next response.create, and at no point are two responses in progress."""
    sink, session, wire = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    session.user_text("item_typed", "Say hello.")
    typed = Response("resp_typed")
    session.ask(typed)
    assert session.inbox.get_nowait() == ("respond", typed)
    sink.process("speech", _speech(1))  # the VAD commits turn 1
    session.begin(2, typed)
    sink.process("user", Transcript(turn=1, text="How far is a marathon?"))
    assert not session.answers(1), "turn 1 waits: the typed message's response is in progress"
    assert [(q.turn, q.text, q.ready) for q in session.pending] == [(1, "How far is a marathon?", True)]
    assert session.answering is None
    sink.process("agent", TextDelta(turn=2, text="Hello.", end=True))
    sink.process("audio", AudioOut(turn=2, pcm=np.zeros(0, np.float32), rate=24000, end=True))
    assert [e["response"]["id"] for e in wire.of("response.done")] == ["resp_typed"]
    assert len(wire.of("response.created")) == 1, "one response, and none for turn 1 by itself"
    resp = Response("resp_next")
    session.ask(resp)  # the next response.create answers the spoken item
    assert [q.text for q in resp.inputs] == ["How far is a marathon?"]


def test_a_response_create_after_a_voice_turn_commits_is_refused_until_its_reply_ends(tmp_path):
    sink, session, _ = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    assert not session.active(), "the user speaks: nothing is committed yet"
    sink.process("speech", _speech(1))
    assert session.active(), "committed: its reply is on its way"
    sink.process("user", Transcript(turn=1, text="How far is a marathon?"))
    sink.process("agent", TextDelta(turn=1, text="About 42 km.", end=True))
    assert session.active()
    sink.process("audio", AudioOut(turn=1, pcm=np.zeros(0, np.float32), rate=24000, end=True))
    assert not session.active()


def test_transcription_deltas_carry_only_words_two_partials_agree_on_and_none_after_completed(tmp_path):
    sink, _, wire = _sink(tmp_path)
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    for text in ("How", "How far", "How far it", "How far is a", "How far is a marathon"):
        sink.process("partial", Transcript(turn=1, text=text, final=False))
    sink.process("user", Transcript(turn=1, text="How far is a marathon?"))
    sink.process("partial", Transcript(turn=1, text="How far is a marathon race", final=False))  # late
    kinds = [e["type"] for e in wire.events]
    deltas = [e["delta"] for e in wire.of("conversation.item.input_audio_transcription.delta")]
    # agreed: "How" (1st, 2nd), "How far" (2nd, 3rd), "How far is a" (4th, 5th); "it" never sent
    assert deltas == ["How", " far", " is a", " marathon?"], deltas
    assert "".join(deltas) == "How far is a marathon?"
    last_delta = max(i for i, k in enumerate(kinds) if k == "conversation.item.input_audio_transcription.delta")
    assert last_delta < kinds.index("conversation.item.input_audio_transcription.completed")


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


def test_a_deleted_message_leaves_the_words_and_images_of_those_answered_with_it(tmp_path):
    """Two typed messages answered by one response.create, the second with an image (llm.vision):
    deleting the first leaves the second whole in what the LLM is sent, its image part too."""
    _, session, _ = _sink(tmp_path)
    conversation = Conversation(None, 8)
    url = "data:image/png;base64,iVBORw0KGgo="
    for item in ("item_a", "item_b"):
        session.add_item(item)
    session.turn_items[1] = [("item_a", "My name is Ada.", ()), ("item_b", "What is in this picture?", (url,))]
    image = {"type": "image_url", "image_url": {"url": url}}
    conversation.add_user([{"type": "text", "text": "My name is Ada.\nWhat is in this picture?"}, image], 1)
    session.delete("item_a")
    assert session.history(conversation).messages() == [
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}]
    session.delete("item_b")
    assert session.history(conversation).messages() == []


def test_turn_detection_is_checked_whole_and_fitted_to_the_sessions_vad(tmp_path):
    from nodes.vad.silero import SileroVAD

    config = SessionConfig()
    config.update({"audio": {"input": {"turn_detection": {"threshold": 0.7, "silence_duration_ms": 800,
                                                          "prefix_padding_ms": 300}}}})
    with pytest.raises(ProtocolError, match="threshold"):
        config.update({"audio": {"input": {"turn_detection": {"threshold": 1.5}}}})
    assert config.turn_detection["threshold"] == 0.7, "all or nothing"
    config.update({"audio": {"input": {"turn_detection": None}}})
    assert config.manual and not config.auto_response
    config.update({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    assert config.turn_detection["silence_duration_ms"] == 800, "back to the last server_vad settings"

    _, session, _ = _sink(tmp_path)
    start = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500, "prefix_padding_ms": 30}
    with pytest.raises(ProtocolError, match=r"vad \(none\) takes no turn settings") as none:
        session.nodes.fit_turns(start, {**start, "threshold": 0.6})
    assert none.value.code == "unsupported_value"
    assert session.nodes.fit_turns(start, {**start, "create_response": False})["create_response"] is False, \
        "what is not the VAD's needs no VAD"
    session.nodes.vad = SileroVAD(speculate_ms=200)  # what bind() finds in a graph with vad.speculate_ms=200
    with pytest.raises(ProtocolError, match="speculate_ms") as refused:
        session.nodes.fit_turns(start, {**start, "silence_duration_ms": 150})
    assert (refused.value.code, refused.value.param) == (
        "invalid_value", "session.audio.input.turn_detection.silence_duration_ms")
    fitted = session.nodes.fit_turns(start, {**start, "prefix_padding_ms": 300})  # OpenAI's default
    assert fitted["prefix_padding_ms"] == 200, "a stock client's settings are taken, as far as the VAD can"


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
    session.nodes.tts = nodes[1]
    assert session.nodes.use_voice("de") == "de" and nodes[1].voice == "de"
    spoken.clear()
    assert len(reply(nodes[1])) and len(reply(nodes[0]))
    assert spoken == ["de", "en-us"], "the session's node speaks with its voice, another session's with its own"
    assert session.nodes.use_voice("alloy") == "alloy", "an OpenAI voice name is echoed as the client sent it"
    assert nodes[1].voice == "de", "and keeps the session's voice"
    with pytest.raises(ProtocolError, match="'no-such-voice' is not one"):
        session.nodes.use_voice("no-such-voice")
    assert nodes[1].voice == "de"


def test_the_realtime_package_imports_one_way():
    """Each module's imports (module level and inside functions) point one way: the transport
    imports the handlers, the handlers the session, the session the protocol; none back."""
    import ast
    from pathlib import Path

    import nodes.io.realtime as package

    here = Path(package.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in here.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nodes.io.realtime"):
                found |= {node.module.removeprefix("nodes.io.realtime").lstrip(".") or a.name for a in node.names}
        imports[path.stem] = found - {path.stem}

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m})) for m in imports.get(start, ()))

    assert not [m for m in imports if reaches(m, m)], imports
    assert imports["nodes"] >= {"server"}, "the source builds its server (lazily: nothing imports nodes.py back)"
    assert not reaches("server", "nodes") and not reaches("session", "client_events")
