"""Metrics of speculative replies (vad.speculate_ms): a synthetic trace with known times, exact answers.

A speculated turn's critical path starts when the VAD sent the utterance early; the gate
between TTS and the sink holds the reply until the turn is confirmed, and that hold is a
part of its own; a withdrawn turn (the user went on) is counted, never measured. The trace is
filled through the calls the scheduler makes, with the events the VAD records.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from s2s_flow import metrics
from s2s_flow.compose import compose
from s2s_flow.graph import build_graph
from s2s_flow.messages import AudioOut, Message, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.trace import Trace

PCM = np.zeros(160, np.float32)


def graph_with_gate():
    """The default graph with speculation on: nodes/vad/gate.py sits between TTS and the sink."""
    cfg, choices = compose(["vad.speculate_ms=200"])
    graph = build_graph(cfg, choices)
    assert graph.chain[-2:] == ["gate", "sink"]
    return graph


def at(trace: Trace, node: str, msg: Message, t: float) -> None:
    trace.emitted(trace.node(node), [msg], t)


def into(trace: Trace, node: str, msg: Message, t: float, queued: float = 0.001) -> None:
    trace.received(trace.node(node), [msg], [t - queued], t)


def speculated_turn(trace: Trace, turn: int, t: float, *, confirm: float | None) -> None:
    """The user stops at ``t``; the VAD speculates 200 ms later and confirms at ``t + confirm``
    (None: the user goes on at t+0.45 and the turn is withdrawn). The reply's first audio leaves
    TTS at t+0.65; the gate lets go at the later of its arrival and the confirmation."""
    trace.events.append({"kind": "speculation", "t": t + 0.2, "node": "vad", "turn": turn, "silence_ms": 200})
    at(trace, "vad", SpeechStarted(turn=turn, t=t - 1.0), t - 1.0)
    early = Speech(turn=turn, pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=t, t=t + 0.2,
                   speculative=True)
    at(trace, "vad", early, t + 0.2)
    into(trace, "stt", early, t + 0.202, 0.002)
    heard = Transcript(turn=turn, text="what is", speculative=True, t=t + 0.35)
    at(trace, "stt", heard, t + 0.35)
    into(trace, "llm", heard, t + 0.351)
    token = TextDelta(turn=turn, text="It", t=t + 0.45)
    sentence = TextDelta(turn=turn, text=" is.", sentence_end=True, t=t + 0.55)
    at(trace, "llm", token, t + 0.45)
    at(trace, "llm", sentence, t + 0.55)
    into(trace, "tts", token, t + 0.451)
    into(trace, "tts", sentence, t + 0.552, 0.002)
    audio = AudioOut(turn=turn, pcm=PCM, rate=22050, t=t + 0.65)
    at(trace, "tts", audio, t + 0.65)
    into(trace, "gate", early, t + 0.201)
    into(trace, "gate", token, t + 0.451)
    into(trace, "gate", sentence, t + 0.552)
    into(trace, "gate", audio, t + 0.652, 0.002)
    if confirm is None:  # the user went on: the VAD withdraws the turn, the next one continues it
        trace.events.append({"kind": "speculation_end", "t": t + 0.45, "node": "vad", "turn": turn,
                             "outcome": "wasted"})
        trace.events.append({"kind": "interrupt", "t": t + 0.451, "turn": turn + 1, "reason": "speculation",
                             "dropped": 2})
        return
    final = Speech(turn=turn, pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=t, t=t + confirm)
    at(trace, "vad", final, t + confirm)
    trace.events.append({"kind": "speculation_end", "t": t + confirm, "node": "vad", "turn": turn,
                         "outcome": "confirmed"})
    into(trace, "stt", final, t + confirm + 0.001)
    confirmed = Transcript(turn=turn, text="what is", t=t + confirm + 0.002)
    at(trace, "stt", confirmed, t + confirm + 0.002)
    into(trace, "gate", final, t + confirm + 0.003)  # the confirming utterance opens the gate
    opened = t + confirm + 0.004  # what was held goes out now; what comes later passes at once
    for msg, came in ((token, 0.451), (sentence, 0.552), (audio, 0.652)):
        at(trace, "gate", msg, max(opened, t + came + 0.001))  # as they are: their marks keep their times
    into(trace, "sink", audio, max(opened, t + 0.653) + 0.002, 0.002)


def plain_turn(trace: Trace, turn: int, t: float) -> None:
    """A turn the VAD ends at once, without speculation: it goes out 500 ms after the end of speech."""
    at(trace, "vad", SpeechStarted(turn=turn, t=t - 1.0), t - 1.0)
    speech = Speech(turn=turn, pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=t, t=t + 0.5)
    at(trace, "vad", speech, t + 0.5)
    into(trace, "stt", speech, t + 0.502, 0.002)
    heard = Transcript(turn=turn, text="hello", t=t + 0.7)
    at(trace, "stt", heard, t + 0.7)
    into(trace, "llm", heard, t + 0.701)
    sentence = TextDelta(turn=turn, text="Hi.", sentence_end=True, t=t + 0.9)
    at(trace, "llm", sentence, t + 0.9)
    into(trace, "tts", sentence, t + 0.901)
    into(trace, "gate", sentence, t + 0.901)
    at(trace, "gate", sentence, t + 0.902)
    audio = AudioOut(turn=turn, pcm=PCM, rate=22050, t=t + 1.0)
    at(trace, "tts", audio, t + 1.0)
    into(trace, "gate", audio, t + 1.001)
    at(trace, "gate", audio, t + 1.001)
    into(trace, "sink", audio, t + 1.003, 0.002)


def new_trace() -> Trace:
    trace = Trace()
    trace.t0 = 0.0
    return trace


def test_a_held_reply_starts_at_the_speculation_and_its_hold_is_a_part_of_its_own():
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=0.8)  # the audio waits at the gate from +652 to +804 ms
    (turn,) = metrics.report(trace, {}, graph_with_gate())["turns"]
    assert turn["speculated"] and turn["speculation"] == "confirmed" and turn["reply"]
    assert turn["vad_ms"] == pytest.approx(200.0)  # the reply started on the early pause
    assert turn["turn_confirmed_ms"] == pytest.approx(800.0)  # the VAD's last emission: the confirmation
    assert turn["stage_vad_ms"] == pytest.approx(200.0)
    assert turn["stage_stt_ms"] == pytest.approx(148.0)
    assert turn["stage_llm_ms"] == pytest.approx(199.0)
    assert turn["stage_tts_ms"] == pytest.approx(98.0)
    assert turn["stage_gate_ms"] == pytest.approx(152.0)  # held from 652 to the release at 804
    assert turn["ring_wait_ms"] == pytest.approx(2 + 1 + 2 + 2 + 2)  # the hold is not ring wait
    assert turn["voice_to_voice_ms"] == pytest.approx(806.0)  # first reply audio at the sink
    parts = sum(turn[f"stage_{r}_ms"] for r in ("vad", "stt", "llm", "tts", "gate")) + turn["ring_wait_ms"]
    assert parts == pytest.approx(turn["voice_to_voice_ms"])
    assert [s["part"] for s in turn["segments"]] == ["vad", "ring", "stt", "ring", "llm", "ring", "tts", "ring",
                                                     "gate", "ring"]


def test_a_first_clause_spoken_before_the_sentence_moves_the_split_between_llm_and_tts():
    """tts.first_clause_words: TTS starts on a clause (its ``tts_start`` event, at +460 ms) before
    the LLM's first sentence mark (+550): the LLM's part ends there, never a negative TTS part."""
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=0.8)
    trace.events.append({"kind": "tts_start", "t": 10.46, "node": "tts", "turn": 1, "words": 4})
    (turn,) = metrics.report(trace, {}, graph_with_gate())["turns"]
    assert turn["stage_llm_ms"] == pytest.approx(109.0)  # from the transcript's arrival at +351
    assert turn["stage_tts_ms"] == pytest.approx(190.0)  # from +460 to the first audio at +650
    assert turn["llm_first_sentence_ms"] == pytest.approx(550.0)  # the milestone itself is unchanged
    assert turn["llm_first_words_ms"] == pytest.approx(460.0)  # what TTS began on: the clause
    parts = sum(turn[f"stage_{r}_ms"] for r in ("vad", "stt", "llm", "tts", "gate")) + turn["ring_wait_ms"]
    assert parts == pytest.approx(turn["voice_to_voice_ms"])


def test_a_full_stop_long_after_the_first_audio_is_reported_as_what_it_is():
    """A long first sentence spoken in pieces (tts.max_words): the first audio comes long before
    the LLM's first full stop. The table names both: the words TTS began on, and the full stop."""
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=0.8)
    trace.events.append({"kind": "tts_start", "t": 10.46, "node": "tts", "turn": 1, "words": 4})
    data = trace.to_dict()  # as trace.json holds it
    data["nodes"]["llm"]["1"]["marks"]["out:sentence"] = 10.0 + 26.214  # the first full stop, 26 s in
    (turn,) = metrics.report(data, {}, graph_with_gate())["turns"]
    assert turn["llm_first_words_ms"] == pytest.approx(460.0)
    assert turn["llm_first_words_ms"] < turn["voice_to_voice_ms"] < turn["llm_first_sentence_ms"]
    assert turn["llm_first_sentence_ms"] == pytest.approx(26214.0)
    labels = dict(metrics.MILESTONES)
    assert labels["llm_first_words_ms"] == "LLM first words to TTS"
    assert "full stop" in labels["llm_first_sentence_ms"]


def test_a_reply_confirmed_before_its_audio_is_not_held():
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=0.5)  # the gate let the text go at +504; audio passes at once
    (turn,) = metrics.report(trace, {}, graph_with_gate())["turns"]
    assert turn["turn_confirmed_ms"] == pytest.approx(500.0)
    assert turn["stage_gate_ms"] == pytest.approx(0.0)
    assert turn["voice_to_voice_ms"] == pytest.approx(655.0)
    parts = sum(turn[f"stage_{r}_ms"] for r in ("vad", "stt", "llm", "tts", "gate")) + turn["ring_wait_ms"]
    assert parts == pytest.approx(turn["voice_to_voice_ms"])


def test_without_speculation_the_vad_part_ends_at_its_emission_and_the_gate_only_passes():
    trace = new_trace()
    plain_turn(trace, 1, 10.0)
    (turn,) = metrics.report(trace, {}, graph_with_gate())["turns"]
    assert not turn["speculated"] and turn["speculation"] is None and turn["reply"]
    assert turn["vad_ms"] == turn["turn_confirmed_ms"] == pytest.approx(500.0)
    assert turn["stage_tts_ms"] == pytest.approx(99.0)  # from TTS, not from the gate that also emits audio
    assert turn["stage_gate_ms"] == pytest.approx(0.0)
    assert turn["voice_to_voice_ms"] == pytest.approx(1003.0)


def test_the_gate_is_no_stage_even_where_it_reaches_the_marks_as_soon_as_the_stage():
    """The gate passes the LLM's and TTS's own messages, whose marks keep their times: a tie the
    stage must not lose by its name ("gate" sorts before "llm" and "tts")."""
    trace = new_trace()
    plain_turn(trace, 1, 10.0)
    rep = metrics.report(trace, {}, graph_with_gate())
    assert rep["roles"]["llm"] == ["llm"] and rep["roles"]["tts"] == ["tts"]
    assert rep["roles"]["gate"] == ["gate"] and rep["roles"]["sink"] == ["sink"]
    # from trace.json alone, under other names: recognised by what it did, not by what it is called
    data = json.loads(json.dumps(trace.to_dict()))
    data["nodes"] = {{"gate": "hold", "llm": "brain"}.get(k, k): v for k, v in data["nodes"].items()}
    offline = metrics.report(data)
    assert offline["roles"]["gate"] == ["hold"] and offline["roles"]["llm"] == ["brain"]
    assert offline["roles"]["tts"] == ["tts"]
    assert offline["turns"][0]["stage_tts_ms"] == pytest.approx(99.0)


def test_a_withdrawn_speculation_is_counted_but_is_no_reply():
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=None)  # the user went on: turn 2 continues the utterance
    speculated_turn(trace, 2, 11.0, confirm=0.8)
    plain_turn(trace, 3, 20.0)
    speculated_turn(trace, 4, 30.0, confirm=0.8)
    rep = metrics.report(trace, {}, graph_with_gate())
    first = rep["turns"][0]
    assert first["speculation"] == "wasted" and not first["reply"] and first["interrupted"]
    assert first["turn_confirmed_ms"] is None and first["voice_to_voice_ms"] is None
    # the first reply is the warm-up; the withdrawn turn is in no statistic
    assert rep["warmup_turn"] == 2 and rep["measured_turns"] == 2
    assert rep["summary"]["voice_to_voice_ms"]["n"] == 2
    assert rep["summary"]["vad_ms"]["n"] == 2  # turn 1's 200 ms is not among them
    assert (rep["speculations"], rep["speculation_confirmed"], rep["speculation_wasted"]) == (3, 2, 1)
    figures = metrics.figures(rep)
    assert figures["speculation_wasted"] == 1 and figures["speculations"] == 3
    assert figures["stage_gate_p50_ms"] is not None and figures["turn_confirmed_p50_ms"] is not None
    console = Console(record=True, width=300)
    metrics.show(rep, console)
    text = " ".join(console.export_text().split())
    assert "held until the turn is confirmed" in text and "turn confirmed (VAD)" in text
    assert "3 turns" in text and "without reply audio" not in text
    assert "3 speculative replies: 2 confirmed, 1 withdrawn" in text


def test_a_run_without_speculation_shows_no_speculation_rows():
    trace = new_trace()
    for i in (1, 2):
        plain_turn(trace, i, 10.0 * i)
    rep = metrics.report(trace, {}, graph_with_gate())
    assert rep["speculations"] == 0
    console = Console(record=True, width=300)
    metrics.show(rep, console)
    text = console.export_text()
    assert "turn confirmed" not in text and "speculative" not in text
    assert "held until the turn is confirmed" in text  # a gate is in the graph


def test_a_speculation_left_open_by_a_stopped_run_is_neither_outcome():
    trace = new_trace()
    speculated_turn(trace, 1, 10.0, confirm=None)
    trace.events = [e for e in trace.events if e["kind"] == "speculation"]
    rep = metrics.report(trace, {}, graph_with_gate())
    assert (rep["speculations"], rep["speculation_confirmed"], rep["speculation_wasted"]) == (1, 0, 0)
    assert rep["turns"][0]["reply"] and rep["turns"][0]["speculation"] is None
