"""Metrics from the engine's trace: a synthetic trace with known times, exact answers.

The trace is filled through the same calls the scheduler makes (Trace.received/emitted),
with the messages real nodes send, on a graph wired from the real configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from s2s_flow import metrics
from s2s_flow.compose import compose
from s2s_flow.graph import build_graph
from s2s_flow.messages import AudioChunk, AudioOut, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.trace import Trace

PCM = np.zeros(160, np.float32)


def graph_for(*overrides: str):
    cfg, choices = compose(list(overrides))
    return build_graph(cfg, choices)


def play_turn(trace: Trace, turn: int, t: float, *, stt: bool = True, audio: bool = True) -> None:
    """One turn through vad -> (stt) -> llm -> tts -> sink, in seconds after ``t``.

    End of speech at t+0; the VAD lets go at t+0.5; STT 2 ms later ... as in a real run.
    """
    table = trace.node
    chunk = AudioChunk(pcm=PCM, rate=16000, t=t + 0.48)
    trace.emitted(table("source"), [chunk], t + 0.48)
    trace.received(table("vad"), [chunk], [t + 0.481 - 0.001], t + 0.481)
    trace.emitted(table("vad"), [SpeechStarted(turn=turn, t=t - 1.0)], t - 1.0)
    speech = Speech(turn=turn, pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=t, t=t + 0.5)
    trace.emitted(table("vad"), [speech], t + 0.5)
    upstream = speech
    at = t + 0.502
    if stt:
        trace.received(table("stt"), [speech], [at - 0.002], at)
        upstream = Transcript(turn=turn, text="hello", t=t + 0.7)
        trace.emitted(table("stt"), [upstream], t + 0.7)
        at = t + 0.701
    trace.received(table("llm"), [upstream], [at - 0.001], at)
    token = TextDelta(turn=turn, text="Hi", t=at + 0.2)
    sentence = TextDelta(turn=turn, text=" there.", sentence_end=True, t=at + 0.3)
    end = TextDelta(turn=turn, text="", end=True, t=at + 0.35)
    for msg in (token, sentence, end):
        trace.emitted(table("llm"), [msg], msg.t)
    trace.received(table("tts"), [token], [at + 0.201 - 0.001], at + 0.201)
    trace.received(table("tts"), [sentence], [at + 0.303 - 0.003], at + 0.303)
    trace.received(table("tts"), [end], [at + 0.45 - 0.1], at + 0.45)  # queued behind the synthesis
    if audio:
        out = AudioOut(turn=turn, pcm=PCM, rate=22050, t=at + 0.4)
        trace.emitted(table("tts"), [out], at + 0.4)
        trace.received(table("sink"), [out], [at + 0.404 - 0.004], at + 0.404)
    done = AudioOut(turn=turn, pcm=np.zeros(0, np.float32), rate=22050, end=True, t=at + 0.46)
    trace.emitted(table("tts"), [done], at + 0.46)
    trace.received(table("sink"), [done], [at + 0.461 - 0.001], at + 0.461)


def synthetic_trace(turns: int = 1, **kw) -> Trace:
    trace = Trace()
    trace.t0 = 0.0
    for i in range(1, turns + 1):
        play_turn(trace, i, 10.0 * i, **kw)
        trace.conversations[i] = f"conv{i}"
    return trace


def test_milestones_are_measured_from_the_true_end_of_speech():
    rep = metrics.report(synthetic_trace(), {}, graph_for())
    (turn,) = rep["turns"]
    assert turn["speech_end_s"] == pytest.approx(10.0)
    assert turn["vad_ms"] == pytest.approx(500.0)
    assert turn["stt_ms"] == pytest.approx(700.0)
    assert turn["llm_first_token_ms"] == pytest.approx(901.0)
    assert turn["llm_first_sentence_ms"] == pytest.approx(1001.0)
    assert turn["tts_first_audio_ms"] == pytest.approx(1101.0)
    assert turn["voice_to_voice_ms"] == pytest.approx(1105.0)
    assert turn["conversation"] == "conv1"


def test_stages_and_ring_waits_add_up_to_voice_to_voice():
    (turn,) = metrics.report(synthetic_trace(), {}, graph_for())["turns"]
    assert turn["stage_vad_ms"] == pytest.approx(500.0)
    assert turn["stage_stt_ms"] == pytest.approx(198.0)  # 0.7 - 0.502
    assert turn["stage_llm_ms"] == pytest.approx(300.0)  # sentence made 0.3 s after the transcript arrived
    assert turn["stage_tts_ms"] == pytest.approx(97.0)  # audio 0.097 s after the sentence arrived
    # hand-overs on the critical path only: 2 + 1 + 3 + 4 ms (not the 100 ms the end marker queued)
    assert turn["ring_wait_ms"] == pytest.approx(10.0)
    parts = turn["stage_vad_ms"] + turn["stage_stt_ms"] + turn["stage_llm_ms"] + turn["stage_tts_ms"]
    assert parts + turn["ring_wait_ms"] == pytest.approx(turn["voice_to_voice_ms"])
    assert turn["queued_ms"] == pytest.approx(2 + 1 + 1 + 3 + 100 + 4 + 1)


def test_without_stt_the_llm_takes_the_speech_and_there_is_no_stt_figure():
    graph = graph_for("stt=none")
    rep = metrics.report(synthetic_trace(stt=False), {}, graph)
    (turn,) = rep["turns"]
    assert rep["roles"]["stt"] == []
    assert turn["stt_ms"] is None and turn["stage_stt_ms"] is None
    assert turn["stage_llm_ms"] == pytest.approx(300.0)
    parts = turn["stage_vad_ms"] + turn["stage_llm_ms"] + turn["stage_tts_ms"] + turn["ring_wait_ms"]
    assert parts == pytest.approx(turn["voice_to_voice_ms"])


def test_stages_are_found_by_message_types_not_names():
    graph = graph_for()
    roles = metrics.report(synthetic_trace(), {}, graph)["roles"]
    assert roles == {"vad": ["vad"], "stt": ["stt"], "llm": ["llm"], "tts": ["tts"], "gate": [], "sink": ["sink"]}
    # renamed nodes (no graph: recognised by the marks they left)
    trace = synthetic_trace().to_dict()
    trace["nodes"] = {f"n_{k}": v for k, v in trace["nodes"].items()}
    rep = metrics.report(trace)
    assert rep["roles"]["llm"] == ["n_llm"] and rep["roles"]["sink"] == ["n_sink"]
    assert rep["turns"][0]["voice_to_voice_ms"] == pytest.approx(1105.0)


def test_a_partial_transcriber_beside_the_stt_does_not_shift_the_stt_stage():
    trace = synthetic_trace()
    speech = Speech(turn=1, pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=10.0, t=10.5)
    trace.received(trace.node("partials"), [speech], [10.5005 - 0.0005], 10.5005)  # takes the Speech first
    trace.emitted(trace.node("partials"), [Transcript(turn=1, text="hel", final=False, t=10.55)], 10.55)
    graph = graph_for("io=mic", "io.partials.interval_ms=500")
    rep = metrics.report(trace, {}, graph)
    assert rep["roles"]["stt"] == ["stt", "partials"]
    (turn,) = rep["turns"]
    assert turn["stage_stt_ms"] == pytest.approx(198.0) and turn["ring_wait_ms"] == pytest.approx(10.0)


def test_trace_json_gives_the_same_report_as_the_live_trace():
    trace = synthetic_trace(turns=3)
    rings = {"vad.speech -> stt.audio": {"capacity": 8, "policy": "block", "puts": 3, "drops": 0,
                                         "high_water": 1, "blocked_s": 0.0}}
    live = metrics.report(trace, rings, graph_for())
    offline = metrics.report(json.loads(json.dumps({**trace.to_dict(), "rings": rings})))
    assert [t["voice_to_voice_ms"] for t in live["turns"]] == [t["voice_to_voice_ms"] for t in offline["turns"]]
    assert live["summary"] == offline["summary"]


def test_the_warm_up_turn_is_reported_alone_and_left_out_of_the_statistics():
    trace = synthetic_trace(turns=4)
    # make the warm-up turn slow: its first audio reaches the sink 2 s late
    trace.node("sink")[1].marks_in["audio"] += 2.0
    rep = metrics.report(trace, {}, graph_for())
    assert rep["warmup_turn"] == 1 and rep["warmup_excluded"]
    assert rep["warmup"]["voice_to_voice_ms"] == pytest.approx(3105.0)
    v2v = rep["summary"]["voice_to_voice_ms"]
    assert v2v["n"] == 3 and v2v["max"] == pytest.approx(1105.0) and v2v["p50"] == pytest.approx(1105.0)
    assert [t["warmup"] for t in rep["turns"]] == [True, False, False, False]


def test_a_single_turn_is_its_own_statistic():
    rep = metrics.report(synthetic_trace(turns=1), {}, graph_for())
    assert not rep["warmup_excluded"]
    assert rep["summary"]["voice_to_voice_ms"]["n"] == 1


def test_percentiles_over_turns():
    trace = synthetic_trace(turns=11)
    for i in range(2, 12):  # measured turns: v2v = 1105 + 10*(i-2) ms
        trace.node("sink")[i].marks_in["audio"] += 0.010 * (i - 2)
    s = metrics.report(trace, {}, graph_for())["summary"]["voice_to_voice_ms"]
    assert s["n"] == 10
    assert s["p50"] == pytest.approx(1150.0)
    assert s["p95"] == pytest.approx(1190.5)
    assert s["max"] == pytest.approx(1195.0)


def test_a_turn_without_reply_audio_has_no_voice_to_voice():
    rep = metrics.report(synthetic_trace(audio=False), {}, graph_for())
    (turn,) = rep["turns"]
    assert turn["voice_to_voice_ms"] is None and turn["tts_first_audio_ms"] is None
    assert turn["ring_wait_ms"] is None
    assert turn["llm_first_sentence_ms"] == pytest.approx(1001.0)


def test_drops_per_edge_come_from_the_ring_counters():
    rings = {"source.audio -> vad.audio": {"capacity": 4, "policy": "drop_oldest", "puts": 90, "drops": 7,
                                           "high_water": 4, "blocked_s": 0.0},
             "vad.speech -> stt.audio": {"capacity": 8, "policy": "block", "puts": 1, "drops": 0,
                                         "high_water": 1, "blocked_s": 0.0}}
    rep = metrics.report(synthetic_trace(), rings, graph_for())
    assert rep["drops"] == {"source.audio -> vad.audio": 7} and rep["drops_total"] == 7
    assert rep["rings"]["vad.speech -> stt.audio"]["puts"] == 1


def test_interrupted_turns_are_flagged():
    trace = synthetic_trace(turns=2)
    trace.events.append({"kind": "interrupt", "t": 10.6, "turn": 2, "reason": "barge-in", "dropped": 3})
    rep = metrics.report(trace, {}, graph_for())
    assert [t["interrupted"] for t in rep["turns"]] == [True, False]


def test_written_shown_and_returned(tmp_path: Path):
    rep = metrics.report(synthetic_trace(turns=3), {}, graph_for())
    path = metrics.write(rep, tmp_path, timeline=True)
    assert json.loads(path.read_text())["summary"]["voice_to_voice_ms"]["p50"] == pytest.approx(1105.0)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    console = Console(record=True, width=120)
    metrics.show(rep, console)
    text = console.export_text()
    assert "voice-to-voice" in text and "1105" in text and "warm-up turn 1 not in the statistics" in text
    figures = metrics.figures(rep)
    assert figures["voice_to_voice_p50_ms"] == pytest.approx(1105.0)
    assert figures["warmup_voice_to_voice_ms"] == pytest.approx(1105.0)
    assert figures["measured_turns"] == 2


def test_no_timeline_unless_asked(tmp_path: Path):
    metrics.write(metrics.report(synthetic_trace(), {}, graph_for()), tmp_path)
    assert (tmp_path / "metrics.json").exists() and not (tmp_path / "timeline.png").exists()


def test_the_table_says_when_turns_queued_behind_earlier_ones():
    """Hand-overs cost well under a millisecond; long ring waits mean the input outran the stages."""
    rep = metrics.report(synthetic_trace(turns=3), {}, graph_for())
    console = Console(record=True, width=300)
    metrics.show(rep, console)
    assert "turns waited" not in console.export_text()
    rep["summary"]["ring_wait_ms"]["p50"] = 224.0
    console = Console(record=True, width=300)
    metrics.show(rep, console)
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "turns waited 224 ms (p50) in rings" in text and "faster than the stages" in text
