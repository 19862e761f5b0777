"""SileroVAD on real Piper speech: turns, timing, end of stream, rates, errors."""

from __future__ import annotations

import logging
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from nodes.vad.silero import SileroVAD
from s2s_flow import node
from s2s_flow.errors import ConfigError, MissingDependency
from s2s_flow.messages import AudioChunk, Message, Speech, SpeechStarted
from s2s_flow.node import Context
from tests.support.speech import speech_with_pauses

T0 = 1000.0  # monotonic time of the stream's first sample in these simulated real-time runs
TEXTS = ["Hello there, how are you doing today?", "Please tell me a short story about a cat."]

# Silero's errors against the true bounds of this speech (deterministic audio:
# tests/support/speech.py), measured at 16 and 8 kHz: starts 8-18 ms early; ends 58-112 ms
# late (30 of them are speech_pad_ms, the rest Silero's decay), the longest at 8 kHz;
# speech_end_t -4 to +50 ms. (With Piper's noise, 8 draws moved ends by up to 35 ms more.)
# Each bound is the largest measured error plus at least one 32 ms window, so a VAD decision
# that moves by a window on another CPU still passes.
START_TOL_S = 0.1
END_TOL_S = 0.15
SPEECH_END_T_TOL_S = 0.1


def make_vad(tmp_path: Path, **params) -> SileroVAD:
    vad = SileroVAD(**params)
    vad.ctx = Context("vad", tmp_path)
    vad.setup()
    return vad


def run(vad: SileroVAD, pcm: np.ndarray, rate: int, chunk: int | None = None) -> list[Message]:
    """Feed ``pcm`` as a live source would: chunk i is stamped with the time its last sample arrived."""
    chunk = chunk or rate // 50
    out: list[Message] = []
    for i in range(0, len(pcm), chunk):
        piece = pcm[i : i + chunk]
        msg = AudioChunk(pcm=piece, rate=rate, start=i / rate, t=T0 + (i + len(piece)) / rate)
        out += list(vad.process("audio", msg))
    out += list(vad.finish() or [])
    return out


def speeches(out: list[Message]) -> list[Speech]:
    return [m for m in out if isinstance(m, Speech)]


@pytest.mark.parametrize("rate", [16000, 8000])
def test_two_utterances_separated_by_a_pause_are_two_turns_at_the_right_times(tmp_path, rate):
    pcm, truth = speech_with_pauses(TEXTS, rate, pause_s=1.5)
    out = run(make_vad(tmp_path, sample_rate=rate), pcm, rate)

    kinds = [(type(m).__name__, m.turn) for m in out]
    assert kinds == [("SpeechStarted", 1), ("Speech", 1), ("SpeechStarted", 2), ("Speech", 2)]
    for speech, (start, end) in zip(speeches(out), truth, strict=True):
        assert abs(speech.start - start) < START_TOL_S, (speech.start, start)
        assert abs(speech.end - end) < END_TOL_S, (speech.end, end)
        assert speech.rate == rate
        assert len(speech.pcm) == round((speech.end - speech.start) * rate)
        # latency is measured from the real end of speech, not from when the hangover expired
        assert abs(speech.speech_end_t - (T0 + end)) < SPEECH_END_T_TOL_S, (speech.speech_end_t - T0, end)
        started = next(m for m in out if isinstance(m, SpeechStarted) and m.turn == speech.turn)
        assert started.start == pytest.approx(speech.start)


def test_speech_pcm_is_the_utterance_audio(tmp_path):
    rate = 16000
    pcm, truth = speech_with_pauses(TEXTS[:1], rate)
    (speech,) = speeches(run(make_vad(tmp_path), pcm, rate))
    first = round(speech.start * rate)
    np.testing.assert_array_equal(speech.pcm, pcm[first : first + len(speech.pcm)])


def test_chunk_length_does_not_change_the_turns(tmp_path):
    rate = 16000
    pcm, _ = speech_with_pauses(TEXTS, rate)
    reference = [(s.start, s.end) for s in speeches(run(make_vad(tmp_path), pcm, rate, chunk=512))]
    for chunk in (100, 1234, 8000):
        got = [(s.start, s.end) for s in speeches(run(make_vad(tmp_path), pcm, rate, chunk=chunk))]
        assert got == reference, chunk


def test_silence_only_gives_nothing_and_warns(tmp_path, caplog):
    rate = 16000
    noise = np.random.default_rng(0).normal(0, 1e-3, 3 * rate).astype(np.float32)
    with caplog.at_level(logging.WARNING):
        out = run(make_vad(tmp_path), np.concatenate([np.zeros(rate, np.float32), noise]), rate)
    assert out == []
    assert "no speech found in the input" in caplog.text


def test_an_utterance_in_progress_at_end_of_stream_is_emitted(tmp_path):
    rate = 16000
    pcm, (truth,) = speech_with_pauses(TEXTS[:1], rate, tail_s=0.0)
    cut = round((truth[0] + 1.0) * rate)  # the stream stops one second into the sentence
    out = run(make_vad(tmp_path), pcm[:cut], rate)
    (speech,) = speeches(out)
    assert abs(speech.start - truth[0]) < START_TOL_S
    assert speech.end == pytest.approx(cut / rate, abs=0.04)
    assert [type(m) for m in out] == [SpeechStarted, Speech]


def test_an_utterance_longer_than_max_speech_s_is_cut_into_turns(tmp_path):
    rate = 16000
    text = "This sentence keeps going for quite a while, so that the detector has to cut it somewhere."
    pcm, (truth,) = speech_with_pauses([text], rate)
    out = run(make_vad(tmp_path, max_speech_s=2.0), pcm, rate)
    parts = speeches(out)
    assert len(parts) >= 2
    assert [p.turn for p in parts] == list(range(1, len(parts) + 1))
    assert parts[0].end - parts[0].start <= 2.0 + 0.1
    for before, after in zip(parts, parts[1:], strict=False):
        assert after.start <= before.end + 0.6  # the cut loses no speech
    assert abs(parts[-1].end - truth[1]) < END_TOL_S  # measured: 102 ms late


def test_audio_at_another_rate_is_an_error_naming_io_rate(tmp_path):
    vad = make_vad(tmp_path)
    chunk = AudioChunk(pcm=np.zeros(441, np.float32), rate=44100)
    with pytest.raises(ConfigError, match=r"io\.rate=16000"):
        list(vad.process("audio", chunk))


@pytest.mark.parametrize(
    ("params", "option"),
    [({"sample_rate": 44100}, "vad.sample_rate"), ({"threshold": 1.5}, "vad.threshold"),
     ({"min_silence_ms": -1}, "vad.min_silence_ms"), ({"max_speech_s": 0.1}, "vad.max_speech_s")],
)
def test_bad_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        SileroVAD(**params)


def test_a_dropped_chunk_keeps_the_timeline(tmp_path):
    """A source ring dropping audio (drop_oldest) must not shift later timestamps."""
    rate, chunk = 16000, 320
    pcm, truth = speech_with_pauses(TEXTS, rate)
    vad = make_vad(tmp_path)
    out: list[Message] = []
    for n, i in enumerate(range(0, len(pcm), chunk)):
        if n in (10, 11, 12):  # 60 ms lost during the leading silence
            continue
        msg = AudioChunk(pcm=pcm[i : i + chunk], rate=rate, start=i / rate, t=T0 + (i + chunk) / rate)
        out += list(vad.process("audio", msg))
    out += list(vad.finish() or [])
    for speech, (start, end) in zip(speeches(out), truth, strict=True):
        assert abs(speech.start - start) < START_TOL_S
        assert abs(speech.end - end) < END_TOL_S



def test_a_missing_silero_wheel_gives_the_no_deps_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "silero_vad", None)  # how an environment without the wheel looks to find_spec
    monkeypatch.setattr(node, "_SHARED", weakref.WeakValueDictionary())  # none loaded by earlier tests
    with pytest.raises(MissingDependency) as err:
        make_vad(tmp_path)
    assert err.value.command == "pip install --no-deps silero-vad onnxruntime"
    assert str(err.value).endswith("Install it with: pip install --no-deps silero-vad onnxruntime")
    assert "torch" in str(err.value) and "\n" not in str(err.value)


def test_a_sessions_turn_settings_change_where_turns_end_and_what_it_cannot_take_is_refused(tmp_path):
    """The node contract's TurnSettings (a Realtime client's turn_detection), on real speech: a
    1 s pause ends the turn at silence_duration_ms=500 and not at 1500."""
    from s2s_flow.node import SettingRefused, TurnSettings

    rate = 16000
    pcm, truth = speech_with_pauses(TEXTS, rate, pause_s=1.0, tail_s=2.0)
    vad = make_vad(tmp_path)
    assert isinstance(vad, TurnSettings)
    assert vad.turn_settings() == {"threshold": 0.5, "silence_duration_ms": 500, "prefix_padding_ms": 30}
    assert len(speeches(run(vad, pcm, rate))) == 2
    longer = {"threshold": 0.6, "silence_duration_ms": 1500, "prefix_padding_ms": 300}
    vad = make_vad(tmp_path)
    vad.apply_turn_settings(vad.fit_turn_settings(longer))
    assert vad.turn_settings() == longer
    (one,) = speeches(run(vad, pcm, rate))
    assert one.start < truth[0][0] - 0.25, "the turn's audio starts 300 ms before the speech"
    assert abs(one.end - truth[1][1]) < END_TOL_S + 0.3, "one turn, to the end of the second utterance"

    speculating = SileroVAD(speculate_ms=200)
    with pytest.raises(SettingRefused, match="speculate_ms") as refused:
        speculating.fit_turn_settings({**longer, "silence_duration_ms": 150})
    assert refused.value.setting == "silence_duration_ms"
    assert speculating.fit_turn_settings(longer)["prefix_padding_ms"] == 200, "lowered to what a speculation pads"
    with pytest.raises(SettingRefused, match="max_silence_ms"):
        SileroVAD(turn="smart_turn", min_silence_ms=200, max_silence_ms=1000).fit_turn_settings(longer)
