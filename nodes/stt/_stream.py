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
from dataclasses import dataclass

import numpy as np

__all__ = ["Word", "Growing", "Schedule", "last_pause", "key"]

#: the audio after the cut must be at least this long at the end of a turn: a shorter tail is
#: read from an earlier cut (too little sound to read on its own)
MIN_TAIL_S = 0.6
#: a decode starts only at a pause this long: cut between two words of connected speech, the tail
#: lost its first word ("Can | you tell me" read "Tell me"; "the yolk | stays soft" read "they soft";
#: at the 100 ms, -20 dB closure in "What's | the capital" it read "What's Capitol")
MIN_GAP_S = 0.15
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
