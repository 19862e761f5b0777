"""STT while the user speaks: the words two hypotheses of the growing utterance agree on are kept.

The VAD sends the utterance so far (``SpeechSoFar``, ``stt.stream_ms``); the STT decodes it when
its schedule says so and offers each hypothesis here. LocalAgreement-2 (as whisper_streaming
does): a word is stable once two consecutive hypotheses read it alike, and stable words are never
taken back. Each decode reads only the audio after the stable words, with their text as Whisper's
prompt, and at the end of the turn only that tail is left to decode; the stable text is what live
transcription deltas carry (append-only). A decode starts only at a pause after stable words (a
cut): between two words of connected speech the tail loses its first one.

The schedule fits the machine: the decode cost is measured as it runs (an exponential moving
average), and after each decode the STT rests as long as ``duty`` says (0.5: as long as it
worked), so a slow CPU decodes less often and never falls behind the speech.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from s2s_flow.audio import resample
from s2s_flow.errors import ConfigError
from s2s_flow.inference import Shed
from s2s_flow.messages import Message, Speech, SpeechSoFar, Transcript

from ._base import UtteranceSTT

__all__ = ["StreamingSTT", "Word", "Growing", "Schedule", "last_pause", "key"]

#: the audio after the cut must be at least this long at the end of a turn: a shorter tail is
#: read from an earlier cut. A short tail read on its own loses words: with 0.6 s the second
#: halves of the hesitant requests (~1 s after a 400-700 ms pause) cost 3 more errors in 117
#: words than the whole decode (bench_stt_incremental.py --stream-ms 100)
MIN_TAIL_S = 2.0
#: a decode starts only at a pause this long: cut between two words of connected speech, the tail
#: lost its first word ("Can | you tell me" read "Tell me"; "the yolk | stays soft" read "they soft";
#: at the 100 ms, -20 dB closure in "What's | the capital" it read "What's Capitol")
MIN_GAP_S = 0.15
#: a decode of the growing utterance needs this much new speech since the last one ...
MIN_NEW_S = 0.3
#: ... and the utterance this long at least (a shorter one is decoded whole at its end, at little cost)
MIN_GROWING_S = 1.0
#: ... and at most this long (Whisper's window, less the silence it is given after the speech)
MAX_GROWING_S = 29.0
QUIET_DB = -30.0  # a pause is this far below the loudest moment of the utterance so far
MAX_REREAD = 2  # words before the cut a decode may read again at its start
PAUSE_SLACK_S = 0.1  # a pause may begin this long after the last stable word's end (as Whisper times it)
MIN_CUT_S = 1.0  # nor before this much of the utterance: a shorter start saves little to read again


def key(word: str) -> str:
    """A word as the agreement compares it: lower case, letters and digits only."""
    return re.sub(r"[^\w]", "", word.lower())


@dataclass(frozen=True, slots=True)
class Word:
    text: str  # as Whisper wrote it (a leading space, punctuation attached)
    start: float  # seconds from the utterance's start
    end: float


class Growing:
    """One utterance as it grows: its stable words, the last hypothesis beyond them, the cuts."""

    def __init__(self, start: float) -> None:
        self.start = start  # the utterance's stream offset (s), as its SpeechSoFar and Speech give it
        self.stable: list[Word] = []
        self.pending: list[Word] = []  # the last hypothesis after the stable words
        #: (seconds, stable words before it): the pauses after stable words where a decode may
        #: start, the stable text before it as its prompt; the first is the utterance's start
        self.cuts: list[tuple[float, int]] = [(0.0, 0)]
        self.heard = 0  # samples the last hypothesis read (the next needs new speech)

    @property
    def text(self) -> str:
        return "".join(w.text for w in self.stable).strip()

    @property
    def cut(self) -> float:
        return self.cuts[-1][0]

    @property
    def at_cut(self) -> int:
        return self.cuts[-1][1]

    @property
    def prompt(self) -> str:
        return self.words(self.at_cut)

    def words(self, n: int) -> str:
        return "".join(w.text for w in self.stable[:n]).strip()

    def offer(self, words: list[Word]) -> list[Word]:
        """A hypothesis of the audio after the cut (times from the utterance's start): the words it
        shares with the previous one become stable (returned), the rest waits for the next. The
        stable words after the cut are read again by every decode: one that reads them otherwise is
        set aside (stable words are never taken back)."""
        ahead = [key(w.text) for w in self.stable[self.at_cut :]]
        for skip in range(MAX_REREAD + 1):  # a decode may read the word before the cut again
            if [key(w.text) for w in words[skip : skip + len(ahead)]] == ahead:
                words = words[skip + len(ahead) :]
                break
        else:
            return []
        n = 0
        while n < min(len(words), len(self.pending)) and key(words[n].text) == key(self.pending[n].text):
            n += 1
        n = min(n, len(words) - 1)  # the newest hypothesis's last word may be cut off by the audio's end
        newly, self.pending = words[:n], words[n:]
        self.stable += newly
        return newly

    def move_cut(self, audio: np.ndarray, rate: int) -> None:
        """The next decodes start in the latest pause (a stretch ``MIN_GAP_S`` long, ``QUIET_DB``
        below the loudest moment so far) after the cut whose words before it are all stable. A word
        is before a pause when it starts before the pause does: the words' times (from Whisper's
        cross-attention) are rough, the pause is in the sound."""
        words = [*self.stable, *self.pending]
        if len(self.stable) == self.at_cut or not words:
            return
        pause = last_pause(audio, rate, max(self.cut, MIN_CUT_S), words[len(self.stable) - 1].end + PAUSE_SLACK_S)
        while pause is not None:
            before = sum(w.start < pause[0] for w in words)
            if self.at_cut < before <= len(self.stable):
                self.cuts.append(((pause[0] + pause[1]) / 2, before))
                return
            pause = last_pause(audio, rate, max(self.cut, MIN_CUT_S), pause[0] - 0.01)

    def tail(self, seconds: float) -> tuple[float, str]:
        """Where the last decode of a ``seconds`` long utterance starts and the stable text before
        it: the latest cut that leaves at least ``MIN_TAIL_S`` of audio."""
        cut, n = next(((c, n) for c, n in reversed(self.cuts) if seconds - c >= MIN_TAIL_S), (0.0, 0))
        return cut, self.words(n)


class Schedule:
    """When the next decode of the growing utterance may start: after a rest as long as the measured
    cost and ``duty`` (the share of the time decoding may take) say."""

    ALPHA = 0.3  # weight of the newest decode in the moving average

    def __init__(self, duty: float) -> None:
        self.duty = duty
        self.cost: float | None = None  # seconds per decode, averaged
        self.free_at = 0.0  # monotonic time from which the next may start
        self.decodes = 0

    def due(self, now: float) -> bool:
        return now >= self.free_at

    def done(self, started: float, now: float) -> None:
        took = now - started
        self.cost = took if self.cost is None else (1 - self.ALPHA) * self.cost + self.ALPHA * took
        self.free_at = now + self.cost * (1 / self.duty - 1)
        self.decodes += 1


def last_pause(audio: np.ndarray, rate: int, after: float, before: float) -> tuple[float, float] | None:
    """The latest pause of ``audio`` that begins between ``after`` and ``before`` (s), as (start, end):
    10 ms frames ``QUIET_DB`` below the loudest frame so far, ``MIN_GAP_S`` in a row, followed by
    sound again (a pause at the end of the audio may be where the user stops); None if none."""
    frame = rate // 100
    n = len(audio) // frame
    if n == 0:
        return None
    energy = np.mean(audio[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1)
    quiet = energy < energy.max() * 10 ** (QUIET_DB / 10)
    found, i, hi = None, max(0, int(after * 100)), min(n, int(before * 100) + 1)
    while i < hi:
        if not quiet[i]:
            i += 1
            continue
        j = i
        while j < n and quiet[j]:
            j += 1
        if j - i >= MIN_GAP_S * 100 and j < n:
            found = (i / 100, j / 100)
        i = j
    return found


class StreamingSTT(UtteranceSTT):
    """An utterance STT that also decodes the utterance while it grows (``stream_ms`` > 0). A backend
    gives ``hypothesis(audio, cut, prompt)`` (the words after ``cut``, timed; None when in doubt)
    and ``decode_tail(audio, prompt)`` (the words of the turn's last stretch; None when in doubt),
    and calls ``init_stream`` in ``__init__``, ``start_stream`` in ``setup``, ``stop_stream`` in
    ``close``. The decodes of the growing utterance run on a thread of their own, so the turn's
    last decode never queues behind one (the backend's engine must run two calls at once)."""

    inputs = {"audio": Speech, "growing": SpeechSoFar}
    optional_inputs = frozenset({"growing"})

    def hypothesis(self, audio: np.ndarray, cut: float, prompt: str) -> list[Word] | None:
        raise NotImplementedError

    def decode_tail(self, audio: np.ndarray, prompt: str) -> tuple[str, str | None] | None:
        raise NotImplementedError

    def init_stream(self, stream_ms: int, duty: float) -> None:
        if not 0.05 <= duty <= 1.0:
            raise ConfigError(f"stt.stream_duty={duty} is the share of the time decoding may take while "
                              "the user speaks: use 0.05-1 (0.5: rest as long as each decode took).")
        self.stream_ms, self.stream_duty = stream_ms, duty
        self._growing: Growing | None = None  # the utterance being decoded as it grows
        self._schedule = Schedule(duty)
        self._spoken_turn = -1  # a turn whose speculative Speech came: its SpeechSoFar are late
        self.clock = time.monotonic  # what the schedule reads
        self._pool: Any = None  # the thread that decodes the growing utterance
        self._running: tuple[Growing, Any, np.ndarray] | None = None  # its decode: for what, the future, audio

    def start_stream(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.ctx.name}-growing")

    def stop_stream(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def process(self, port: str, msg: Message) -> Iterator[Transcript]:
        if isinstance(msg, SpeechSoFar):
            yield from self._grow(msg)
            return
        assert isinstance(msg, Speech)
        yield from self._collect(msg.turn)  # its stable words go out before the final transcript
        if msg.speculative:
            self._spoken_turn = msg.turn  # what comes of this turn while it pauses is its speculation's
        yield from super().process(port, msg)
        if not msg.speculative and self._growing is not None and abs(self._growing.start - msg.start) < 1e-6:
            self._growing = None  # the turn is over

    def _grow(self, msg: SpeechSoFar) -> Iterator[Transcript]:
        """Take in the last decode of the utterance so far if it is done, and send the stable words
        when they grew; start the next one on this audio if the schedule lets it."""
        yield from self._collect(msg.turn)
        now = self.clock()
        if (self._pool is None or msg.turn <= self._spoken_turn or self._running is not None
                or not self._schedule.due(now)):
            return
        growing = self._growing
        if growing is None or abs(growing.start - msg.start) > 1e-6:
            growing = self._growing = Growing(msg.start)
        rate = self.input_rate
        audio = resample(msg.pcm, msg.rate, rate)
        if (len(audio) - growing.heard < MIN_NEW_S * rate or len(audio) < MIN_GROWING_S * rate
                or len(audio) > MAX_GROWING_S * rate):
            return
        growing.heard = len(audio)
        cut, prompt = growing.cut, growing.prompt

        def decode() -> list[Word] | None:
            try:
                with self.inference_slot("partial", turn=msg.turn):
                    return self.hypothesis(audio, cut, prompt)
            except Shed:  # the model is busy with confirmed work: this hypothesis is skipped
                return None
            finally:
                self._schedule.done(now, self.clock())

        self._running = (growing, self._pool.submit(decode), audio)

    def _collect(self, turn: int, *, wait: bool = False) -> Iterator[Transcript]:
        """The finished decode of the growing utterance: its stable words, if it is still the one."""
        if self._running is None or not (wait or self._running[1].done()):
            return
        (growing, future, audio), self._running = self._running, None
        words = future.result()  # a failure in the decode stops the stage, as any decode's would
        if growing is not self._growing or words is None or not growing.offer(words):
            return
        growing.move_cut(audio, self.input_rate)
        yield Transcript(turn=turn, text=growing.text, language=getattr(self, "language", None), final=False)

    def transcribe_speech(self, msg: Speech, audio: np.ndarray) -> tuple[str, str | None]:
        """With words already stable: only the audio after the last pause in them, their text as the
        prompt; a tail decode in doubt falls back to the whole utterance."""
        growing = self._growing
        if growing is None or abs(growing.start - msg.start) > 1e-6 or not growing.stable:
            return self.transcribe(audio)
        cut, prefix = growing.tail(len(audio) / self.input_rate)
        if not prefix:
            return self.transcribe(audio)
        tail = audio[int(cut * self.input_rate):]
        decoded = self.decode_tail(tail, prefix)
        if decoded is None:
            self.ctx.log.debug("the tail after %r was in doubt: the whole utterance is decoded", prefix)
            return self.transcribe(audio)
        words = decoded[0].split()
        if words and key(words[0]) == key(prefix.split()[-1]):
            words = words[1:]  # the tail began a little early and read the last stable word again
        self.ctx.record("stt_tail", turn=msg.turn, read_s=round(len(tail) / self.input_rate, 2),
                        of_s=round(len(audio) / self.input_rate, 2))
        return " ".join([prefix, *words]), decoded[1]
