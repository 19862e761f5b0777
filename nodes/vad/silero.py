"""Silero VAD through onnxruntime: cuts the microphone stream into user utterances.

The model file ships inside the ``silero-vad`` wheel; it is located with ``find_spec`` and
never imported, because ``import silero_vad`` imports torch.
"""

from __future__ import annotations

import importlib.util
import math
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from s2s_flow.audio import to_float32, to_mono
from s2s_flow.errors import ConfigError, MissingDependency
from s2s_flow.messages import AudioChunk, Message, Speech, SpeechSoFar, SpeechStarted
from s2s_flow.node import Node, SettingRefused, TurnSettings, require

__all__ = ["SileroVAD", "silero_model_path"]

_MAX_ZERO_FILL_S = 1.0  # a gap in the input longer than this restarts the timeline

_IDLE, _CANDIDATE, _SPEECH = "idle", "candidate", "speech"
#: audio before the speech's start that the turn model sees, as pipecat's own analyzer gives it
#: (LocalSmartTurnAnalyzerV3: SmartTurnParams.pre_speech_ms): the model was trained on turns
#: with their onset, and a clip starting at the first voiced window reads as cut off
TURN_PRE_SPEECH_S = 0.5
_TURN_DETECTORS = ("silence", "smart_turn", "text", "hybrid")
_HEARS = ("smart_turn", "hybrid")  # the policies that ask the audio model
_READS = ("text", "hybrid")  # ... and those that read the words (nodes/_turn_text.py)


# silero-vad asks for torch, which vad=silero never imports: its wheel goes in without it.
_INSTALL = "pip install --no-deps silero-vad onnxruntime"


def silero_model_path() -> Path:
    """Path of ``silero_vad.onnx`` inside the installed wheel, found without importing it."""
    spec = importlib.util.find_spec("silero_vad")
    path = Path(spec.origin).parent / "data" / "silero_vad.onnx" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise MissingDependency("silero_vad", "vad", command=_INSTALL, cause=ImportError(
            "vad=silero reads silero_vad.onnx from the silero-vad wheel; --no-deps keeps out the torch it asks for"))
    return path


class SileroVAD(Node, TurnSettings):
    """Emits ``SpeechStarted`` once speech is confirmed and ``Speech`` when the user stops.

    The stream is cut into 32 ms windows; a window is speech at ``threshold`` and silence
    below ``threshold - 0.15`` (Silero's hysteresis). With ``turn="silence"`` an utterance
    ends after ``min_silence_ms`` of silence. With ``turn="smart_turn"`` the Smart Turn model
    is asked once per pause, after ``min_silence_ms`` (short: 200 ms), whether the user
    sounds finished (probability >= ``turn_threshold``); if not, the turn ends only when the
    user has been silent for ``max_silence_ms``. ``turn="text"`` asks the words instead: the
    LLM's probability that the speculative transcript ends the user's message (>= ``text_threshold``,
    nodes/_turn_text.py), waited for until it comes. ``turn="hybrid"`` ends the turn after
    ``min_silence_ms`` only when both say finished, and after ``max_silence_ms`` when either says
    not; with ``one_silence_ms`` set it is tiered: one of the two saying finished (the other not,
    or not read yet) ends the turn after that much silence, between the two. Either way
    ``speech_end_t`` is moved back to when the silence began, so latency is measured from the
    user's real end of speech.

    Speculation (``speculate_ms`` > 0): after that much silence, before the turn is known to be
    over, the utterance so far goes out as ``Speech(speculative=True)`` so STT and the LLM
    start at once (once per pause). If the turn then ends at that pause, the same utterance
    follows with ``speculative=False``: the confirmation. If the user speaks again first, the
    turn is withdrawn: an interrupt (reason "speculation") drops its reply at every hop, and
    the utterance goes on as a new turn, announced by ``SpeechStarted(continues=old turn)``.
    Both outcomes are recorded in the trace (``speculation``, ``speculation_end``).

    STT while the user speaks (``stream_ms`` > 0, set by ``stt.stream_ms``): every that many ms of a
    turn, the utterance so far goes out as ``SpeechSoFar`` (its samples as its ``Speech`` will hold
    them), for an STT that decodes it as it grows.
    """

    inputs = {"audio": AudioChunk}
    outputs = {"started": SpeechStarted, "speech": Speech, "growing": SpeechSoFar}

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        min_speech_ms: int = 250,
        min_silence_ms: int = 500,
        speech_pad_ms: int = 30,
        max_speech_s: float = 30.0,
        sample_rate: int = 16000,
        turn: str = "silence",
        max_silence_ms: int = 3000,
        turn_threshold: float = 0.5,
        turn_threads: int = 1,
        speculate_ms: int = 0,
        text_threshold: float = 0.3,
        one_silence_ms: int | None = None,
        stream_ms: int | None = 0,
    ) -> None:
        if sample_rate not in (8000, 16000):
            raise ConfigError(
                f"vad.sample_rate={sample_rate} is not supported: Silero VAD runs at 16000 or 8000 Hz. "
                "Set vad.sample_rate=16000 (and io.rate=16000)."
            )
        if not 0.15 < threshold < 1.0:
            raise ConfigError(
                f"vad.threshold={threshold} is out of range: it is a speech probability above which a "
                "32 ms window counts as speech; use a value between 0.2 and 0.95 (default 0.5)."
            )
        for name, value in (("min_speech_ms", min_speech_ms), ("min_silence_ms", min_silence_ms),
                            ("speech_pad_ms", speech_pad_ms)):
            if value < 0:
                raise ConfigError(f"vad.{name}={value} must be >= 0 (milliseconds).")
        if max_speech_s <= (min_speech_ms + 2 * speech_pad_ms) / 1000:
            raise ConfigError(
                f"vad.max_speech_s={max_speech_s} is too short: utterances longer than it are cut; "
                "use a few seconds at least (default 30)."
            )
        if turn not in _TURN_DETECTORS:
            raise ConfigError(
                f"vad.turn={turn!r} is not a turn detector: choose vad.turn=silence (the turn ends after "
                "vad.min_silence_ms of silence), vad.turn=smart_turn (the Smart Turn model decides "
                "after vad.min_silence_ms; vad.max_silence_ms ends the turn anyway), vad.turn=text (the "
                "LLM reads the words so far) or vad.turn=hybrid (both must say the user is done)."
            )
        if turn != "silence" and max_silence_ms <= min_silence_ms:
            raise ConfigError(
                f"vad.max_silence_ms={max_silence_ms} must be longer than vad.min_silence_ms="
                f"{min_silence_ms}: with vad.turn={turn} the detector is asked after the short "
                "silence and the long one ends the turn anyway (e.g. 200 and 1000)."
            )
        if one_silence_ms is not None and not (turn == "hybrid" and min_silence_ms < one_silence_ms < max_silence_ms):
            raise ConfigError(
                f"vad.one_silence_ms={one_silence_ms} is for vad.turn=hybrid (here {turn}), between "
                f"vad.min_silence_ms={min_silence_ms} and vad.max_silence_ms={max_silence_ms}: the silence after "
                "which one of the sound and the words saying finished is enough (e.g. 200, 400 and 1000), "
                "or null (both must agree, else the long silence)."
            )
        if turn in _READS:
            if not speculate_ms:
                raise ConfigError(
                    f"vad.turn={turn} reads the words said before the pause, which the speculative transcript "
                    "brings: set vad.speculate_ms (e.g. vad.speculate_ms=64 vad.min_silence_ms=200)."
                )
            if not 0.0 < text_threshold < 1.0:
                raise ConfigError(
                    f"vad.text_threshold={text_threshold} is out of range: it is the LLM's probability that "
                    "the user's message ends after the words so far; use 0.05-0.95."
                )
        if turn in _HEARS:
            if sample_rate != 16000:
                raise ConfigError(
                    f"vad.turn={turn} needs vad.sample_rate=16000 (the Smart Turn model reads 16 kHz audio); "
                    "set vad.sample_rate=16000 and io.rate=16000, or vad.turn=silence."
                )
            if not 0.0 < turn_threshold < 1.0:
                raise ConfigError(
                    f"vad.turn_threshold={turn_threshold} is out of range: it is the probability that "
                    "the user has finished above which the turn ends; use 0.05-0.95 (default 0.5)."
                )
        if speculate_ms and not speech_pad_ms <= speculate_ms < min_silence_ms:
            raise ConfigError(
                f"vad.speculate_ms={speculate_ms} must be 0 (off) or from vad.speech_pad_ms={speech_pad_ms} "
                f"up to below vad.min_silence_ms={min_silence_ms}: the reply starts after that much "
                "silence, before the turn is over (e.g. vad.speculate_ms=200 with vad.min_silence_ms=500)."
            )
        stream_ms = stream_ms or 0
        if stream_ms < 0 or 0 < stream_ms < 32:
            raise ConfigError(f"vad.stream_ms={stream_ms}: use 0 (off) or at least one 32 ms window (e.g. 100): "
                              "how often the utterance so far goes to an STT that decodes while the user speaks")
        if turn_threads < 1:
            raise ConfigError(f"vad.turn_threads={turn_threads} must be >= 1 (onnxruntime intra-op threads).")
        self.threshold = threshold
        self.turn_detector = turn
        self.max_silence_ms = max_silence_ms
        self.turn_threshold = turn_threshold
        self.text_threshold = text_threshold
        self.turn_threads = turn_threads
        self.min_speech_ms = min_speech_ms
        self.min_silence_ms = min_silence_ms
        self.speech_pad_ms = speech_pad_ms
        self.max_speech_s = max_speech_s
        self.sample_rate = sample_rate

        self.window = 512 if sample_rate == 16000 else 256
        self._context_size = 64 if sample_rate == 16000 else 32
        self._neg_threshold = max(threshold - 0.15, 0.01)
        self._min_speech = sample_rate * min_speech_ms // 1000
        self._min_silence = sample_rate * min_silence_ms // 1000
        self._pad = sample_rate * speech_pad_ms // 1000
        self._max_speech = int(sample_rate * max_speech_s)
        self._max_silence = sample_rate * max_silence_ms // 1000
        self.one_silence_ms = one_silence_ms
        self._one_silence = None if one_silence_ms is None else sample_rate * one_silence_ms // 1000
        self.speculate_ms = speculate_ms
        self._speculate = sample_rate * speculate_ms // 1000
        self._pre_speech = int(sample_rate * TURN_PRE_SPEECH_S) if turn != "silence" else 0
        self.stream_ms = stream_ms
        self._stream = sample_rate * stream_ms // 1000
        self._session = None
        self._smart_turn = None
        self._turn_text = None  # the words' record (vad.turn=text|hybrid), set up with the session
        self.turn = 0  # keeps rising across conversations: turns are unique within a run
        self.reset()

    def port_rate(self, port: str) -> int | None:
        return self.sample_rate

    # -- a session's turn settings (the node contract's TurnSettings) ----------------------

    def turn_settings(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "silence_duration_ms": self.min_silence_ms,
                "prefix_padding_ms": self.speech_pad_ms}

    def fit_turn_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """A session's settings as far as this VAD can take them (checked against ``__init__``'s
        limits by the caller): a silence it would not wait for is refused, the padding lowered to
        ``speculate_ms`` (the padding also closes the utterance a speculation sends)."""
        silence = settings["silence_duration_ms"]
        speculate = self.speculate_ms
        if speculate and silence <= speculate:
            raise SettingRefused("silence_duration_ms", f"turn_detection.silence_duration_ms={silence}: this server "
                                 f"starts a reply after vad.speculate_ms={speculate} ms of silence, before the turn "
                                 "ends; use more than that")
        if self.turn_detector == "smart_turn" and silence >= self.max_silence_ms:
            raise SettingRefused("silence_duration_ms", f"turn_detection.silence_duration_ms={silence}: this "
                                 f"server's turn model ends a turn after vad.max_silence_ms={self.max_silence_ms} ms "
                                 "anyway; use less")
        if speculate and settings["prefix_padding_ms"] > speculate:
            settings = {**settings, "prefix_padding_ms": speculate}
        return settings

    def apply_turn_settings(self, settings: dict[str, Any]) -> None:
        """Plain assignments, from the source's thread: a window being decided may still see the old ones."""
        rate = self.sample_rate
        threshold, silence, pad = (float(settings["threshold"]), int(settings["silence_duration_ms"]),
                                   int(settings["prefix_padding_ms"]))
        self.threshold, self._neg_threshold = threshold, max(threshold - 0.15, 0.01)
        self.min_silence_ms, self._min_silence = silence, rate * silence // 1000
        self.speech_pad_ms, self._pad = pad, rate * pad // 1000
        self._preroll = deque(self._preroll, maxlen=self._preroll_len())  # the audio kept before speech

    # The ONNX session is shared by every session of the process; the recurrent state and
    # the stream (self._state, self._input ...) are per session, passed in on every run().
    shared_safety = "thread-safe: onnxruntime's InferenceSession.run may be called from many threads"

    def shared_key(self) -> tuple:
        return ("silero",)

    def load_shared(self):
        ort = require("onnxruntime", "vad")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1  # a 32 ms window is far too small to share out
        opts.inter_op_num_threads = 1
        return ort.InferenceSession(str(silero_model_path()), sess_options=opts, providers=["CPUExecutionProvider"])

    def setup(self) -> None:
        self._session = self.shared()
        self._sr = np.array(self.sample_rate, dtype=np.int64)
        if self.turn_detector in _HEARS:
            from nodes.vad.smart_turn import shared_smart_turn

            self._smart_turn = shared_smart_turn(self.turn_threads)
        if self.turn_detector in _READS:
            from nodes._turn_text import turn_text_of

            self._turn_text = turn_text_of(self.ctx)
            self._turn_text.wanted = True
        self.reset()
        self.speech_probability(np.zeros(self.window, np.float32))  # warm up
        self.reset()

    def reset(self) -> None:
        """Forget the stream (after the warm-up; a benchmark playing one file after another)."""
        self.speech_count = 0
        self._state = np.zeros((2, 1, 128), np.float32)
        self._input = np.zeros((1, self._context_size + self.window), np.float32)  # context + window
        self._pending = np.zeros(0, np.float32)
        self._pending_pos = 0  # stream offset (samples) of _pending[0]
        self._next_pos: int | None = None  # stream offset just after the last sample received
        self._last_t = 0.0
        self._to_idle(deque())

    def speech_probability(self, window: np.ndarray) -> float:
        """Run one window (512 samples at 16 kHz, 256 at 8 kHz) through the model."""
        x, c = self._input, self._context_size
        x[0, c:] = window
        out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        x[0, :c] = x[0, -c:]  # the next window sees the end of this one as context
        return float(out[0, 0])

    # -- stream -------------------------------------------------------------------------

    def process(self, port: str, msg: AudioChunk) -> Iterator[Message]:
        if msg.rate != self.sample_rate:
            raise ConfigError(
                f"vad=silero runs at vad.sample_rate={self.sample_rate} Hz but its audio arrives at "
                f"{msg.rate} Hz: set io.rate={self.sample_rate} (Silero runs at 16000 or 8000 Hz; "
                "for 8000 also set vad.sample_rate=8000)."
            )
        pcm = to_mono(to_float32(np.asarray(msg.pcm))).reshape(-1)
        yield from self._place(msg)
        self._last_t = msg.t
        # a copy either way: utterances keep these samples, and a source may reuse its buffer
        self._pending = np.concatenate([self._pending, pcm]) if len(self._pending) else pcm.copy()
        self._next_pos = self._pending_pos + len(self._pending)
        while len(self._pending) >= self.window:
            window, self._pending = self._pending[: self.window], self._pending[self.window:]
            pos, self._pending_pos = self._pending_pos, self._pending_pos + self.window
            yield from self._step(window, pos, self.speech_probability(window), msg.t)

    def finish(self) -> Iterator[Message]:
        if self._phase == _SPEECH and self._next_pos is not None:
            yield self._cut_utterance()
        log = self.ctx.log
        if self.speech_count == 0:
            log.warning("no speech found in the input")
        else:
            log.info("%d utterance(s) detected", self.speech_count)

    def _place(self, msg: AudioChunk) -> Iterator[Message]:
        """Map the chunk onto the stream timeline: zero-fill short gaps, restart after long ones.

        Chunks that overlap or carry no offset simply follow the previous one.
        """
        start = round(msg.start * self.sample_rate)
        if self._next_pos is None:
            self._pending_pos = start
            return
        gap = start - self._next_pos
        if gap <= 0:
            return
        if gap <= _MAX_ZERO_FILL_S * self.sample_rate:
            self._pending = np.concatenate([self._pending, np.zeros(gap, np.float32)])
            return
        if self._phase == _SPEECH:  # the audio after a long dropout is another utterance
            yield self._cut_utterance()
        self._to_idle(deque())
        self._pending = np.zeros(0, np.float32)
        self._pending_pos = start

    def _cut_utterance(self) -> Speech:
        """The utterance in progress, ended where the stream stops (end of input, long dropout)."""
        if len(self._pending):
            self._utt.append(self._pending)
        end = self._temp_end if self._temp_end is not None else self._next_pos
        return self._utterance(end, self._last_t)

    # -- per-window state machine ---------------------------------------------------------

    def _step(self, window: np.ndarray, pos: int, prob: float, t: float) -> Iterator[Message]:
        end = pos + self.window
        if self._phase == _IDLE:
            self._preroll.append(window)
            if prob < self.threshold:
                return
            self._phase, self._speech_start = _CANDIDATE, pos
            self._utt = list(self._preroll)
            self._utt_start = end - sum(len(w) for w in self._utt)
        else:
            self._utt.append(window)

        if self._phase == _CANDIDATE:
            if prob < self._neg_threshold:  # a click or a breath, not speech
                self._to_idle(self._tail_windows())
            elif end - self._speech_start >= self._min_speech:
                yield self._confirm()
            return

        if prob >= self.threshold:
            if self._speculated:
                yield self._withdraw()
            self._temp_end = None
            self._audio_p = None
            self._last_voiced = pos
        elif prob < self._neg_threshold and self._temp_end is None:
            self._temp_end = pos  # silence begins here; the hangover starts counting
        if self._stream and self._temp_end is None and end - self._streamed >= self._stream:
            self._streamed = end  # while they speak: a pause is the speculation's (or the turn end's)
            yield self._so_far()
        over = self._temp_end is not None and self._turn_over(end - self._temp_end)
        if (not over and self._speculate and self._temp_end is not None and not self._speculated
                and end - self._temp_end >= self._speculate):
            self._speculated = True
            self.ctx.record("speculation", turn=self.turn,
                            silence_ms=round(1000 * (end - self._temp_end) / self.sample_rate))
            yield self._utterance(self._temp_end, t, speculative=True)
        elif over:
            yield self._utterance(self._temp_end, t)
            self._to_idle(self._tail_windows())
        elif end - self._speech_start >= self._max_speech:
            if self._temp_end is not None:  # already pausing: end the turn at the pause
                yield self._utterance(self._temp_end, t)
                self._to_idle(self._tail_windows())
            else:  # still talking: cut here and carry on as a new turn
                yield self._utterance(end, t)
                self._utt, self._utt_start, self._speech_start = [], end, end
                yield self._confirm()

    def _turn_over(self, silence: int) -> bool:
        """Whether ``silence`` samples of pause end the turn (and record why when they do)."""
        if silence < self._min_silence:
            return False
        if self.turn_detector == "silence":
            return True
        if silence >= self._max_silence:
            self._record_end("max_silence", silence)
            return True
        if self._audio_p is None and self._smart_turn is not None:
            # once per pause: a longer silence only makes the model more sure
            # never speculative work: this decides whether the turn (speculated on or not) is over
            with self._smart_turn.inference.slot("first", session=self.ctx.work):
                self._audio_p = self._smart_turn.probability(self._turn_audio())
            if self._audio_p < self.turn_threshold:
                self.ctx.log.debug("turn %d: pause, not finished by the sound (p=%.2f)", self.turn, self._audio_p)
        if self._one_silence is not None:
            return self._tiered(silence)
        if self._audio_p is not None and self._audio_p < self.turn_threshold:
            return False  # the sound says not finished: the long silence decides
        fields = {"probability": round(self._audio_p, 3)} if self._audio_p is not None else {}
        if self._turn_text is not None:
            if self._turn_text.scorer is None:  # no LLM gives scores: the sound alone, or the silence
                if self._smart_turn is None:
                    return False
            else:
                text_p = self._turn_text.get(self.turn)
                if text_p is None or text_p < self.text_threshold:
                    return False  # not read yet (asked again next window), or not finished by the words
                fields["text_probability"] = round(text_p, 3)
        self._record_end(self.turn_detector, silence, **fields)
        return True

    def _tiered(self, silence: int) -> bool:
        """vad.turn=hybrid with one_silence_ms: both signals finished end the turn now, one of
        them after ``one_silence_ms``, none only at the long silence (handled by the caller)."""
        fields = {"probability": round(self._audio_p, 3)}
        audio_done = self._audio_p >= self.turn_threshold
        text_p = None if self._turn_text.scorer is None else self._turn_text.get(self.turn)
        text_done = text_p is not None and text_p >= self.text_threshold
        if text_p is not None:
            fields["text_probability"] = round(text_p, 3)
        if audio_done and text_done:
            self._record_end("hybrid", silence, **fields)
            return True
        if (audio_done or text_done) and silence >= self._one_silence:
            self._record_end("hybrid_one", silence, **fields)
            return True
        return False

    def _turn_audio(self) -> np.ndarray:
        """What the turn model reads: the whole turn from ``TURN_PRE_SPEECH_S`` before its start
        up to now (the pause so far included); it keeps the last 8 s itself."""
        pcm = np.concatenate(self._utt)
        return pcm[max(0, self._speech_start - self._pre_speech - self._utt_start):]

    def _record_end(self, by: str, silence: int, **fields: float) -> None:
        self.ctx.record("turn_end", turn=self.turn, by=by,
                        silence_ms=round(1000 * silence / self.sample_rate), **fields)

    def _so_far(self) -> SpeechSoFar:
        """The utterance up to the end of this window, cut where its ``Speech`` will start."""
        start = max(self._utt_start, self._speech_start - self._pad)
        pcm = np.concatenate(self._utt)[start - self._utt_start:]
        return SpeechSoFar(turn=self.turn, pcm=pcm, rate=self.sample_rate, start=start / self.sample_rate)

    def _withdraw(self) -> SpeechStarted:
        """The user went on after a speculative ``Speech``: its turn's reply is dropped everywhere
        and the utterance continues as a new turn."""
        old = self.turn
        self.turn = self.ctx.new_turn()
        self._speculated = False
        self.ctx.record("speculation_end", turn=old, outcome="wasted")
        self.ctx.interrupt(self.turn, "speculation")
        start = max(self._utt_start, self._speech_start - self._pad)
        return SpeechStarted(turn=self.turn, start=start / self.sample_rate, continues=old)

    def _confirm(self) -> SpeechStarted:
        self._phase = _SPEECH
        self._streamed = self._speech_start
        self._temp_end = None
        self._audio_p = None
        self._last_voiced = None
        self.turn = self.ctx.new_turn() if hasattr(self, "ctx") else self.turn + 1
        start = max(self._utt_start, self._speech_start - self._pad)
        return SpeechStarted(turn=self.turn, start=start / self.sample_rate)

    def _utterance(self, speech_end: int, t: float, *, speculative: bool = False) -> Speech:
        """The finished utterance (or, ``speculative``, the utterance so far at a pause); ``t`` is
        the time of the chunk in which the end was decided."""
        pcm = np.concatenate(self._utt) if self._utt else np.zeros(0, np.float32)
        utt_end = self._utt_start + len(pcm)
        start = max(self._utt_start, self._speech_start - self._pad)
        end = min(utt_end, speech_end + self._pad)
        if speculative:
            self.ctx.work.speculate(self.turn)  # its work is speculative, in every shared model's queue
        else:
            self.speech_count += 1
            self._phase = _IDLE
            if self._speculated:
                self._speculated = False
                self.ctx.record("speculation_end", turn=self.turn, outcome="confirmed")
                self.ctx.work.confirm(self.turn)  # what waits of it in a queue is promoted
        chunk_end = self._next_pos if self._next_pos is not None else utt_end
        return Speech(
            turn=self.turn,
            pcm=pcm[start - self._utt_start : end - self._utt_start].copy(),
            rate=self.sample_rate,
            start=start / self.sample_rate,
            end=end / self.sample_rate,
            # Silero's probability lags the sound by about a window and decays over one or two
            # more, so the start of the last window that was still speech is the best estimate
            # of the true end (tests/test_metrics_speech.py: within one window of the truth).
            speech_end_t=t - (chunk_end - min(speech_end, self._last_voiced or speech_end)) / self.sample_rate,
            speculative=speculative,
        )

    def _tail_windows(self) -> deque:
        return deque(self._utt[-self._preroll_len():])

    def _preroll_len(self) -> int:
        """Windows kept before speech: the padding of the utterance, or what the turn model sees."""
        return math.ceil(max(self._pad, self._pre_speech) / self.window) + 1

    def _to_idle(self, preroll: deque) -> None:
        self._phase = _IDLE
        self._preroll: deque = deque(preroll, maxlen=self._preroll_len())
        self._utt: list[np.ndarray] = []
        self._utt_start = 0
        self._speech_start = 0
        self._temp_end: int | None = None
        self._audio_p: float | None = None  # the turn model's answer for this pause
        self._speculated = False  # a speculative Speech went out for this pause
        self._last_voiced: int | None = None  # start of the last window that was speech
        self._streamed = 0  # stream offset up to which the utterance so far last went out
