"""STT while the user speaks (stt.stream_ms) on real components: Silero VAD sends the utterance so far,
Whisper tiny.en decodes it as it grows on a thread of its own and keeps the words two hypotheses agree
on; the turn's end leaves only the audio after a pause in them to decode. The final transcript is the
one decoding the whole utterance gives; the live transcripts only grow and come before it.

Real time where the schedule matters (the audio is played at its own pace, as a microphone gives it);
what is checked is what was produced and in which order, never how long anything took.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from nodes.io.realtime import RealtimeSink
from nodes.stt._stream import Growing, Schedule, Word, last_pause
from nodes.stt.whisper import WhisperSTT
from nodes.vad.silero import SileroVAD
from s2s_flow.accuracy import word_errors
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, Speech, SpeechSoFar, SpeechStarted, Transcript
from s2s_flow.node import Context
from tests.support.speech import synthesize

RATE = 16000
# three sentences, ~9 s of speech, 300 ms apart: pauses a decode may start at
PASSAGE = ["I am planning a trip to Japan next spring.", "I would like to see Kyoto and Osaka.",
           "What should I book first?"]


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def _passage() -> np.ndarray:
    pieces = [_silence(0.5)]
    for text in PASSAGE:
        pieces += [synthesize(text, RATE), _silence(0.3)]
    return np.concatenate([*pieces, _silence(1.5)])


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    events: list[dict] = []
    node = WhisperSTT(window_s=10, beam_size=3, stream_ms=100)
    node.ctx = Context("stt", tmp_path_factory.mktemp("stt"),
                       record=lambda kind, **f: events.append({"kind": kind, **f}))
    node.setup()
    node.events = events
    yield node
    node.close()


def _live(stt: WhisperSTT, pcm: np.ndarray, **vad_params) -> list[Transcript]:
    """Play ``pcm`` in real time through the VAD into the STT; every transcript it made, in order."""
    vad = SileroVAD(stream_ms=100, **vad_params)
    turns = {"n": 0}

    def new_turn() -> int:
        turns["n"] += 1
        return turns["n"]

    vad.ctx = Context("vad", Path("."), record=lambda kind, **f: None)
    vad.ctx.new_turn = new_turn  # type: ignore[method-assign]
    vad.setup()
    out: list[Transcript] = []
    t0 = time.perf_counter()
    for i in range(0, len(pcm), 320):
        at = (i + 320) / RATE
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        for m in vad.process("audio", AudioChunk(pcm=pcm[i : i + 320], rate=RATE, start=i / RATE, t=at)):
            if isinstance(m, SpeechSoFar):
                out += stt.process("growing", m)
            elif isinstance(m, Speech):
                out += stt.process("audio", m)
    for m in vad.finish() or []:
        if isinstance(m, Speech):
            out += stt.process("audio", m)
    return out


def test_a_long_turn_is_decoded_as_it_grows_and_its_end_reads_only_the_tail(streaming):
    pcm = _passage()
    out = _live(streaming, pcm)
    partial = [t.text for t in out if not t.final]
    [final] = [t for t in out if t.final]
    assert partial, "the stable words went out while the user spoke"
    assert all(b.startswith(a) for a, b in zip(partial, partial[1:], strict=False))  # text that only grows
    assert out.index(final) == len(out) - 1  # ... all of it before the final transcript
    whole, _ = streaming.transcribe(np.concatenate([synthesize(t, RATE) for t in PASSAGE]))
    truth = " ".join(PASSAGE)
    # as accurate as decoding the whole utterance (one word of margin: another CPU reads another way)
    assert word_errors(truth, final.text)[0] <= word_errors(truth, whole)[0] + 1
    [tail] = [e for e in streaming.events if e["kind"] == "stt_tail"][-1:]
    assert tail["read_s"] < tail["of_s"] - 1.5  # the end of the turn decoded a tail after a pause


def test_a_short_turn_is_decoded_whole_and_the_same_as_without_the_stream(streaming):
    question = "What is the capital of Australia?"
    pcm = np.concatenate([_silence(0.5), synthesize(question, RATE), _silence(1.5)])
    out = _live(streaming, pcm)
    [final] = [t for t in out if t.final]
    plain = WhisperSTT(window_s=10, beam_size=3)
    plain.ctx = Context("stt", Path("."))
    plain.setup()
    [alone] = plain.process("audio", Speech(turn=1, pcm=pcm, rate=RATE, start=0.0, end=len(pcm) / RATE,
                                            speech_end_t=0.0))
    assert word_errors(question, final.text)[0] <= word_errors(question, alone.text)[0]


def test_the_vad_sends_the_utterance_so_far_as_its_speech_will_hold_it():
    vad = SileroVAD(stream_ms=96)
    vad.ctx = Context("vad", Path("."), record=lambda kind, **f: None)
    vad.setup()
    pcm = np.concatenate([_silence(0.5), synthesize(PASSAGE[0], RATE), _silence(1.0)])
    out = []
    for i in range(0, len(pcm), 320):
        out += vad.process("audio", AudioChunk(pcm=pcm[i : i + 320], rate=RATE, start=i / RATE, t=i / RATE))
    so_far = [m for m in out if isinstance(m, SpeechSoFar)]
    [speech] = [m for m in out if isinstance(m, Speech)]
    assert len(so_far) >= 10 and out.index(so_far[-1]) < out.index(speech)
    assert [len(m.pcm) for m in so_far] == sorted(len(m.pcm) for m in so_far)
    assert all(m.start == speech.start and m.turn == speech.turn for m in so_far)
    for m in so_far:  # the same samples from the same start
        np.testing.assert_array_equal(m.pcm, speech.pcm[: len(m.pcm)])
    steps = np.diff([len(m.pcm) for m in so_far])
    assert set(steps) <= {3 * 512, 4 * 512}  # every 96 ms of speech (the windows are 32 ms)


def test_the_words_two_hypotheses_agree_on_become_stable_and_stay():
    growing = Growing(0.0)
    words = ["Set", "a", "timer", "for", "twenty", "minutes"]

    def hyp(n: int, last: str | None = None) -> list[Word]:
        said = words[:n] if last is None else [*words[: n - 1], last]
        return [Word(" " + w, 0.3 * i, 0.3 * i + 0.25) for i, w in enumerate(said)]

    assert growing.offer(hyp(2)) == []  # nothing to agree with yet
    assert [w.text for w in growing.offer(hyp(3))] == [" Set", " a"]  # read alike twice
    assert growing.offer(hyp(3)) == []  # "timer" is the newest's last word: it may be cut off
    growing.offer(hyp(5, last="twin"))
    assert growing.text == "Set a timer"  # agreed now; "for" is new, "twin" too
    growing.offer(hyp(6))
    assert growing.text == "Set a timer for"  # "twin" and "twenty" differ: neither is kept
    growing.offer([Word(" Sat", 0.0, 0.2)])  # a decode that reads the stable words otherwise ...
    assert growing.text == "Set a timer for"  # ... takes nothing back


def test_a_decode_starts_only_at_a_pause_after_stable_words():
    speech = synthesize(PASSAGE[0], RATE)
    audio = np.concatenate([speech, _silence(0.3), speech])
    pause = last_pause(audio, RATE, 0.0, len(audio) / RATE)
    assert pause is not None and pause[0] == pytest.approx(len(speech) / RATE, abs=0.15)
    assert last_pause(np.concatenate([speech, _silence(0.5)]), RATE, 0.0, 10.0) != (len(speech) / RATE, 10.0)


def test_the_schedule_rests_as_long_as_the_measured_cost_says():
    fast, slow = Schedule(0.5), Schedule(0.5)
    for start in (0.0, 1.0, 2.0):
        fast.done(start, start + 0.05)
        slow.done(start, start + 0.4)
    assert fast.cost == pytest.approx(0.05) and slow.cost == pytest.approx(0.4)
    assert fast.due(2.1) and not slow.due(2.7) and slow.due(2.8)  # a slow CPU decodes less often
    quarter = Schedule(0.25)
    quarter.done(0.0, 0.1)
    assert not quarter.due(0.39) and quarter.due(0.4)  # rests three times as long as it worked


def test_live_transcripts_become_transcription_deltas_in_the_realtime_sink(tmp_path):
    import json

    from nodes.io.realtime.protocol import SessionConfig
    from nodes.io.realtime.session import Session

    sent: list[dict] = []
    session = Session(lambda text: sent.append(json.loads(text)), SessionConfig())
    sink = RealtimeSink()
    sink.ctx = Context("sink", tmp_path, session=session)
    sink.ctx.inputs_connected = frozenset(RealtimeSink.inputs)
    sink.setup()
    sink.process("started", SpeechStarted(turn=1, start=0.0))
    for text in ("Set a", "Set a timer for", "Set a timer for twenty"):
        sink.process("user", Transcript(turn=1, text=text, final=False))
    sink.process("user", Transcript(turn=1, text="Set a timer for twenty minutes please."))
    deltas = [e["delta"] for e in sent if e["type"] == "conversation.item.input_audio_transcription.delta"]
    # only words two consecutive hypotheses agree on go out: "twenty", in one hypothesis only, waits
    # for the final transcript (the last delta, before completed)
    assert deltas == ["Set a", " timer for", " twenty minutes please."]
    assert "".join(deltas) == "Set a timer for twenty minutes please."
    [done] = [e for e in sent if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert done["transcript"] == "Set a timer for twenty minutes please."


@pytest.mark.parametrize(("make", "option"), [
    (lambda: WhisperSTT(stream_ms=100), "stt.window_s=10"),
    (lambda: WhisperSTT(stream_ms=100, window_s=10, stream_duty=0), "stt.stream_duty"),
    (lambda: SileroVAD(stream_ms=10), "vad.stream_ms"),
])
def test_bad_stream_settings_are_config_errors_naming_the_option(make, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        make()
