"""vad.turn=smart_turn on real Piper speech: a finished question ends after the short silence,
a pause mid-sentence does not end the turn (fixed silence does), the long silence always does.

Time here is the stream's own (samples fed), never the wall clock: each decision is read
from the position in the stream at which the VAD made it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from nodes.vad.silero import SileroVAD
from nodes.vad.smart_turn import smart_turn_model_path, whisper_log_mel
from s2s_flow import node
from s2s_flow.errors import ConfigError, MissingDependency
from s2s_flow.messages import AudioChunk, Speech
from s2s_flow.node import Context, keep_shared
from tests.support.speech import synthesize

RATE = 16000
SMART = {"turn": "smart_turn", "min_silence_ms": 200, "max_silence_ms": 1000}

# Measured probabilities that the turn is finished (deterministic Piper audio): the question
# 0.99 after its short silence; the sentence cut before "Paris tomorrow?" 0.01.
QUESTION = "What is the capital of Australia?"
FIRST_HALF, SECOND_HALF = "What is the weather going to be like in", "Paris tomorrow?"


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def _run(tmp_path: Path, pcm: np.ndarray, **params) -> tuple[list[tuple[Speech, float]], list[dict]]:
    """Feed 20 ms chunks as a microphone would; each Speech with the stream time (s) it came out at."""
    events: list[dict] = []
    vad = SileroVAD(**params)
    vad.ctx = Context("vad", tmp_path, record=lambda kind, **fields: events.append({"kind": kind, **fields}))
    vad.setup()
    out = []
    for i in range(0, len(pcm), 320):
        piece = pcm[i : i + 320]
        end = (i + len(piece)) / RATE
        chunk = AudioChunk(pcm=piece, rate=RATE, start=i / RATE, t=1000.0 + end)
        out += [(m, end) for m in vad.process("audio", chunk) if isinstance(m, Speech)]
    out += [(m, len(pcm) / RATE) for m in vad.finish() or [] if isinstance(m, Speech)]
    return out, events


def test_features_match_the_whisper_extractor_that_ships_with_the_model(smart_turn_wheel):
    path = smart_turn_model_path().parent.parent / "_whisper_features.py"
    spec = importlib.util.spec_from_file_location("_pipecat_whisper_features", path)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)  # the file alone: pipecat itself is not imported
    audio = np.concatenate([_silence(3.0), synthesize(QUESTION), _silence(8.0)])[: 8 * RATE]
    np.testing.assert_allclose(whisper_log_mel(audio), reference.compute_whisper_log_mel_features(audio),
                               atol=1e-5)


def test_the_model_reads_what_pipecats_own_analyzer_gives_it(smart_turn_wheel):
    """pipecat's LocalSmartTurnAnalyzerV3 (the wheel installed) and our VAD on the same stream,
    asked at the same moments (tests/support/pipecat_turn.py, in a process of its own): the
    same audio (the turn from half a second before its start, up to now) and the same answer."""
    for module in ("loguru", "wait_for2"):  # what importing pipecat's analyzer needs besides the wheel
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"pipecat's analyzer needs {module}: pip install 's2s-flow[test]'")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "tests.support.pipecat_turn"], cwd=root, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    asked = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(asked) == 3  # the question's end, the mid-sentence pause, the sentence's end
    for a in asked:
        # pipecat also keeps the part of the 32 ms piece in which its start falls
        assert 0 <= a["pipecat_samples"] - a["ours_samples"] < 512
        assert a["ours"] == pytest.approx(a["pipecat"], abs=1e-3)
    assert asked[0]["ours"] > 0.5 > asked[1]["ours"]  # finished; not finished at the pause


def test_a_finished_question_ends_the_turn_after_the_short_silence(tmp_path, smart_turn_wheel):
    speech = synthesize(QUESTION)
    pcm = np.concatenate([_silence(0.5), speech, _silence(2.0)])
    true_end = 0.5 + len(speech) / RATE

    [(turn, at)], events = _run(tmp_path, pcm, **SMART)
    [(fixed, fixed_at)], _ = _run(tmp_path, pcm)  # vad.turn=silence, 500 ms

    assert [e["by"] for e in events] == ["smart_turn"]
    assert events[0]["probability"] >= 0.5
    assert at - true_end < 0.5  # decided inside what the fixed hangover still waits for
    assert at < fixed_at
    assert turn.end == pytest.approx(fixed.end) and turn.start == pytest.approx(fixed.start)


def test_a_pause_mid_sentence_does_not_end_the_turn(tmp_path, smart_turn_wheel):
    first, second = synthesize(FIRST_HALF), synthesize(SECOND_HALF)
    pcm = np.concatenate([_silence(0.5), first, _silence(0.6), second, _silence(2.0)])

    turns, events = _run(tmp_path, pcm, **SMART)
    fixed, _ = _run(tmp_path, pcm)

    assert len(fixed) == 2  # 600 ms of silence: the fixed hangover cuts the user off
    assert len(turns) == 1  # the model heard an unfinished sentence and waited
    (speech, _), = turns
    assert speech.start < 0.5 + len(first) / RATE < 0.5 + len(first) / RATE + 0.6 < speech.end
    assert len(events) == 1  # the mid-sentence pause ended nothing


def test_an_unfinished_sentence_ends_after_max_silence(tmp_path, smart_turn_wheel):
    first = synthesize(FIRST_HALF)
    pcm = np.concatenate([_silence(0.5), first, _silence(3.0)])
    [(speech, at)], events = _run(tmp_path, pcm, **SMART)
    assert [e["by"] for e in events] == ["max_silence"]
    assert events[0]["silence_ms"] >= 1000
    assert at - (0.5 + len(first) / RATE) >= 1.0


@pytest.mark.parametrize(
    ("params", "option"),
    [({"turn": "semantic"}, "vad.turn"),
     ({"turn": "smart_turn", "min_silence_ms": 500, "max_silence_ms": 300}, "vad.max_silence_ms"),
     ({"turn": "smart_turn", "sample_rate": 8000}, "vad.sample_rate=16000"),
     ({"turn": "smart_turn", "turn_threshold": 1.0}, "vad.turn_threshold"),
     ({"turn_threads": 0}, "vad.turn_threads")],
)
def test_bad_turn_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        SileroVAD(**params)


def test_a_missing_pipecat_wheel_gives_the_no_deps_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pipecat", None)  # how an environment without the wheel looks to find_spec
    monkeypatch.setattr(node, "_SHARED", weakref.WeakValueDictionary())  # none loaded by earlier tests
    vad = SileroVAD(**SMART)
    vad.ctx = Context("vad", tmp_path)
    with pytest.raises(MissingDependency) as err:
        vad.setup()
    assert err.value.command == "pip install --no-deps pipecat-ai onnxruntime"


def test_metrics_say_what_ended_each_turn():
    from s2s_flow import metrics
    from tests.test_metrics import graph_for, synthetic_trace

    trace = synthetic_trace(turns=2)
    trace.event("turn_end", node="vad", turn=1, by="smart_turn", silence_ms=224, probability=0.99)
    trace.event("turn_end", node="vad", turn=2, by="max_silence", silence_ms=1024)
    rows = metrics.report(trace, {}, graph_for())["turns"]
    assert [row["turn_end"] for row in rows] == ["smart_turn", "max_silence"]


def test_sessions_share_one_turn_model_that_a_server_keeps_warm(tmp_path, smart_turn_wheel):
    with keep_shared() as held:  # what io=realtime does while it serves
        first, second = SileroVAD(**SMART), SileroVAD(**SMART)
        for vad in (first, second):
            vad.ctx = Context("vad", tmp_path)
            vad.setup()
        assert first._smart_turn is second._smart_turn
        model = weakref.ref(first._smart_turn)
        del first, second, vad
        gc.collect()
        assert model() is not None and any(kept is model() for kept in held), "kept between sessions"
