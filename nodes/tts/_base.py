"""What every TTS backend shares: sentences in, chunked audio out, one end marker per reply.

A backend subclasses :class:`SentenceTTS` and implements ``setup()`` (load the engine),
``native_rate`` and ``synthesize(sentence)``; this class turns the LLM's streamed
:class:`TextDelta` pieces into sentences, speaks each one as soon as it is complete,
resamples to the node's output rate, cuts the audio into short chunks so a barge-in
stops playback quickly, and closes each reply with an empty ``AudioOut(end=True)``.
With ``first_clause_words`` the first clause of a reply ("The capital is Canberra,") goes
ahead of the rest of its sentence, so the first audio does not wait for a full stop; with
``first_clause_max_words`` a first sentence with no comma in sight is cut after that many words.
With ``max_words`` a long sentence is synthesized in pieces of at most that many words, cut at its
clause ends where it has them: a neural voice's working memory grows with the text it is given
(Piper: about 4.7 MB per word, measured), so a server's concurrent sessions stay bounded.
The first text of each reply sent to synthesis is a ``tts_start`` trace event: where the
LLM's part of the critical path ends and the TTS's begins (s2s_flow/metrics.py).

Shared voices (many sessions, one model): each chunk is made in a slot of the voice's scheduler
(s2s_flow/inference.py, the backend's ``inference_key()``), a reply's first clause as ``first``
work, its later sentences as ``later`` work due when the listener runs out of audio, and with a
sink that plays at the listener's pace (nodes/_playback.py) no further ahead of what was played
than ``lead_s`` and what a piece takes now: the voice stays free for other sessions' first clauses,
and the listener has the lead left when a piece is made, however loaded the machine. While another
session's first words are in flight a later piece waits as long as the listener keeps audio enough
for it: a third of the lead and what a piece takes. What a piece takes is the voice's, from what its
pieces of every session took lately (:class:`PieceTimes`): a new session's first later piece keeps
the margin the machine's load needs now. A speculative reply's work that is shed waits for its
turn's confirmation, then goes on as confirmed work.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import numpy as np

from nodes._http import RemoteError
from nodes._live import turn_failed
from nodes._playback import playback_of
from s2s_flow.audio import StreamResampler, to_float32
from s2s_flow.errors import ConfigError
from s2s_flow.inference import Cancelled, Shed, critical
from s2s_flow.messages import AudioOut, TextDelta
from s2s_flow.node import Node, Voiced

__all__ = ["SentenceTTS", "first_clause", "in_pieces", "in_turn", "leading_piece", "speakable"]

_EMPTY = np.zeros(0, dtype=np.float32)
_HALF_LIFE_S = 20.0  # what a piece took lately: the slowest, halved every 20 s however many pieces come
# A clause ends at a comma, semicolon, colon or dash followed by a space ("3,000" is not one).
_CLAUSE_END = re.compile(r"[,;:\u2013\u2014](?=\s)|\s-(?=\s)")


def first_clause(text: str, min_words: int, max_words: int = 0) -> int:
    """Length of the leading clause of ``text`` that has at least ``min_words`` words, or of its
    first ``max_words`` words once the word after them has begun (so the last one is whole); 0
    while neither is there."""
    for match in _CLAUSE_END.finditer(text):
        if len(text[: match.start()].split()) >= min_words:
            return match.end()
    if max_words:
        words = list(re.finditer(r"\S+", text))
        if len(words) > max_words:
            return words[max_words - 1].end()
    return 0


def _clause_cut(text: str, max_words: int) -> int:
    """End of the last clause of ``text`` within its first ``max_words`` words (0: none there)."""
    cut = 0
    for match in _CLAUSE_END.finditer(text):
        if len(text[: match.start()].split()) > max_words:
            break
        cut = match.end()
    return cut


def leading_piece(text: str, max_words: int) -> int:
    """Length of the piece to speak now of a sentence still being written: once it has more than
    ``max_words`` words (so the last of them is whole), up to its last clause end within them, else
    those words; 0 while it has no more. A run-on sentence is spoken as it comes, not once it ends."""
    words = list(re.finditer(r"\S+", text))
    if not max_words or len(words) <= max_words:
        return 0
    return _clause_cut(text, max_words) or words[max_words - 1].end()


def in_pieces(text: str, max_words: int) -> list[str]:
    """``text`` cut into pieces of at most ``max_words`` words (0: whole): after its last clause end
    within reach, else into runs of equal length (no one-word tail after a long run)."""
    pieces: list[str] = []
    while max_words:
        words = list(re.finditer(r"\S+", text))
        if len(words) <= max_words:
            break
        cut = _clause_cut(text, max_words)
        if not cut:
            runs = -(-len(words) // max_words)
            cut = words[-(-len(words) // runs) - 1].end()
        pieces.append(text[:cut].strip())
        text = text[cut:].strip()
    return [p for p in (*pieces, text.strip()) if p]


T = TypeVar("T")
_END = object()


def in_turn(items: Iterable[T], lock: Any) -> Iterator[T]:
    """The items of a shared engine's stream, each made while holding ``lock`` (a Lock, or a
    Semaphore of slots), which is free again before the item is handed on: a session whose
    consumer waits holds no other session up."""
    stream = iter(items)
    while True:
        with lock:
            item = next(stream, _END)
        if item is _END:
            return
        yield item  # type: ignore[misc]


def speakable(text: str) -> bool:
    """A sentence worth synthesizing has at least one letter or digit (not just '...' or '*')."""
    return any(ch.isalnum() for ch in text)


class PieceTimes:
    """What a voice's pieces took lately, from their text to their first audio, a wait for the voice's
    slot included: the slowest, halved every 20 s. One per voice in the process
    (:meth:`of`), shared by every session that speaks with it: what a piece takes depends on the
    load of the whole machine, and a session that just started learns it from the others."""

    _lock = threading.Lock()
    _voices: ClassVar[dict[str, PieceTimes]] = {}

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._s, self._at, self._clock = 0.0, 0.0, clock  # 0 until the voice made a piece

    @classmethod
    def of(cls, voice: str) -> PieceTimes:
        with cls._lock:
            return cls._voices.setdefault(voice, cls())

    @property
    def s(self) -> float:
        """Seconds: the slowest piece of late, halved every ``_HALF_LIFE_S`` since it was made. By time,
        not per piece: eight sessions make a few pieces a second, and a fade per piece forgot a slow one
        within a second or two (on a loaded 2-core AMD EPYC, 8 conversations: replies with a gap 68 of
        128 with a fade by a fifth per piece, 38 with this)."""
        return self._s * 0.5 ** ((self._clock() - self._at) / _HALF_LIFE_S)

    def took(self, seconds: float) -> None:
        with self._lock:
            self._s, self._at = max(self.s, seconds), self._clock()


class SentenceTTS(Node, Voiced):
    """Base of the TTS nodes: accumulate deltas into sentences, synthesize, chunk, end marker. A
    session switches its voice through the node contract's ``Voiced`` (``voice_name``, ``use_voice``)."""

    inputs = {"text": TextDelta}
    outputs = {"audio": AudioOut}

    #: longest AudioOut chunk in seconds: downstream can cut playback at this granularity
    max_chunk_s: ClassVar[float] = 0.5

    def __init__(self, *, sample_rate: int | None = None, first_clause_words: int = 0,
                 first_clause_max_words: int = 0, max_words: int = 0, threads: int | str = 0,
                 lead_s: float = 1.5) -> None:
        if sample_rate is not None and not 8000 <= sample_rate <= 192_000:
            raise ConfigError(
                f"tts.sample_rate={sample_rate} is not a usable audio rate: give a rate in Hz "
                "between 8000 and 192000 (e.g. tts.sample_rate=16000 or 24000), or null to "
                "keep the voice's native rate."
            )
        if first_clause_words < 0:
            raise ConfigError(
                f"tts.first_clause_words={first_clause_words} must be >= 0: the fewest words of a "
                "reply's first clause spoken ahead of its sentence (0: whole sentences only; e.g. 4)."
            )
        if first_clause_max_words and not 0 < first_clause_words <= first_clause_max_words:
            raise ConfigError(
                f"tts.first_clause_max_words={first_clause_max_words} with tts.first_clause_words="
                f"{first_clause_words}: the cap needs the first clause on (first_clause_words > 0) and "
                "at least as many words as it (e.g. 4 and 8), or 0 to wait for punctuation.")
        if max_words < 0:
            raise ConfigError(f"tts.max_words={max_words} must be >= 0: the most words synthesized at once, a "
                              "longer sentence being spoken in pieces (0: whole sentences; e.g. 12).")
        if lead_s < 0:
            raise ConfigError(f"tts.lead_s={lead_s} must be >= 0: the seconds of a reply made ahead of what the "
                              "listener has played (e.g. 1.5; 0: every sentence as soon as its text is there).")
        from nodes._calibrate import check_threads

        check_threads(threads, "tts.threads", "CPU threads of the synthesizer's own pool; 0: one per core")
        self.sample_rate = sample_rate
        self.first_clause_words = first_clause_words
        self.first_clause_max_words = first_clause_max_words
        self.max_words = max_words
        #: CPU threads of the synthesizer's own pool (piper's onnxruntime), 0 = its default, "auto" =
        #: timed on this machine (nodes/_calibrate.py); a CPU budget keeps TTS off the cores the LLM
        #: generates on. Engines without a pool ignore it.
        self.threads = threads
        self._clause_open = False  # the reply has spoken nothing yet: its first clause may go ahead
        self._rate_out = sample_rate
        self._pending = ""
        self._pending_turn: int | None = None  # turn of a reply that started and has not ended
        self._cut_turn = -1  # turns below this were interrupted
        self.speaking_turn = 0  # turn of the sentence being synthesized
        self._started_turn: int | None = None  # the last reply whose first text went to synthesis
        #: seconds of a reply made ahead of what the listener has played, on top of what a piece takes
        #: now (paced sinks only; 0: off)
        self.lead_s = float(lead_s)
        self._made_s = 0.0  # audio of the reply being spoken made so far (seconds)
        self._failed_turn: int | None = None  # a live reply whose endpoint failed: the rest goes unspoken

    # -- what a backend implements -------------------------------------------------------

    @property
    def native_rate(self) -> int:
        """Sample rate of the arrays ``synthesize`` yields (known after ``setup()``)."""
        raise NotImplementedError

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        """Speak one sentence: yield mono PCM (float32 or int16) at ``native_rate`` as it is made."""
        raise NotImplementedError

    def cancel_synthesis(self) -> None:
        """Barge-in while synthesizing (called from another thread): abort quickly if possible."""

    @property
    def voice_name(self) -> str:
        """The voice this node speaks with, by name (what a server reports to its clients)."""
        voice = getattr(self, "voice", None)
        return voice if isinstance(voice, str) and voice else type(self).__name__

    def use_voice(self, name: str) -> bool:
        """Speak with the voice ``name`` from the next sentence on, if this backend can switch to it
        within the session (a server's ``session.update``); False leaves the voice as it was. The
        default knows only its own voice."""
        return name == self.voice_name

    # -- the stage ----------------------------------------------------------------------

    def port_rate(self, port: str) -> int | None:
        """The output rate, when known before ``setup()``: ``sample_rate`` or a fixed native rate."""
        if self.sample_rate is not None:
            return self.sample_rate
        try:
            return self.native_rate
        except (AttributeError, NotImplementedError):  # only the loaded voice knows
            return None

    def warm_up(self) -> None:
        """Run the engine once so the first real sentence does not pay for lazy initialisation."""
        for _ in self.synthesize("Hello."):
            pass

    def process(self, port: str, msg: TextDelta) -> Iterator[AudioOut]:
        if msg.turn < self._cut_turn or not self.ctx.session.speaks(msg.turn):
            return  # an interrupted reply, or one without audio (a server's text-only response)
        if self._pending_turn != msg.turn:  # a new reply
            self._pending = ""  # the rest of an interrupted reply: never speak it
            self._clause_open = self.first_clause_words > 0
        self._pending_turn = msg.turn
        self._pending += msg.text
        if msg.sentence_end or msg.end:
            sentence, self._pending = self._pending.strip(), ""
            if speakable(sentence):
                self._clause_open = False
                yield from self._speak(sentence, msg.turn)
        elif self._clause_open and (cut := first_clause(self._pending, self.first_clause_words,
                                                        self.first_clause_max_words)):
            clause, self._pending = self._pending[:cut].strip(), self._pending[cut:]
            self._clause_open = False
            yield from self._speak(clause, msg.turn)
        else:  # a sentence longer than max_words goes out in pieces as it is written, not once it ends
            while not self._clause_open and (cut := leading_piece(self._pending, self.max_words)):
                piece, self._pending = self._pending[:cut].strip(), self._pending[cut:]
                if speakable(piece):
                    yield from self._speak(piece, msg.turn)
        if msg.end:
            self._pending_turn = None
            yield AudioOut(turn=msg.turn, pcm=_EMPTY, rate=self._out_rate(), end=True)

    def finish(self) -> Iterator[AudioOut]:
        """The text stream ended mid-reply: speak what is left and close the reply."""
        if self._pending_turn is None or self._pending_turn < self._cut_turn:
            return
        turn, sentence, self._pending = self._pending_turn, self._pending.strip(), ""
        self._pending_turn = None
        if speakable(sentence):
            yield from self._speak(sentence, turn)
        yield AudioOut(turn=turn, pcm=_EMPTY, rate=self._out_rate(), end=True)

    def on_interrupt(self, turn: int) -> None:
        self._cut_turn = max(self._cut_turn, turn)
        self.cancel_synthesis()
        playback_of(self.ctx).wake()  # a reply waiting for its listener stops waiting

    # -- helpers ------------------------------------------------------------------------

    def interrupted(self, turn: int) -> bool:
        """True once a barge-in made ``turn`` stale: backends stop streaming when it is."""
        return turn < self._cut_turn

    def _out_rate(self) -> int:
        """``sample_rate``, else the native rate seen first: one rate for the whole run."""
        if self._rate_out is None:
            self._rate_out = self.native_rate
        return self._rate_out

    def _speak(self, sentence: str, turn: int) -> Iterator[AudioOut]:
        self.speaking_turn = turn
        if self._started_turn != turn:  # the reply's first words: the LLM's part ends here
            self._started_turn = turn
            self._made_s = 0.0
            self.ctx.record("tts_start", turn=turn, words=len(sentence.split()))
        if self._failed_turn == turn:
            return
        try:
            yield from self._synthesized(sentence, turn)
        except RemoteError as exc:  # a live reply goes on unspoken: its end marker closes it
            if not turn_failed(self.ctx, "tts", turn, exc):
                raise
            self._failed_turn = turn

    def _synthesized(self, sentence: str, turn: int) -> Iterator[AudioOut]:
        rate_out = self._out_rate()
        resample: StreamResampler | None = None  # one for the sentence: its pieces join seamlessly
        text = sentence
        playback = playback_of(self.ctx)
        times = self._piece_times()
        for text in in_pieces(sentence, self.max_words):
            kind, deadline = self._schedule(turn)
            if self.interrupted(turn):
                return
            made_before, began = self._made_s, time.monotonic()  # began: None once its first audio is made
            stream = iter(self.synthesize(text))
            try:
                while (pcm := self._made_in_slot(stream, kind, turn, deadline)) is not _END:
                    if self.interrupted(turn):
                        return
                    if began is not None:  # what the piece took to its first audio (the rest comes faster)
                        times.took(time.monotonic() - began)
                        began = None
                    if resample is None:  # made at the first audio: a remote voice reports its rate late
                        resample = StreamResampler(self.native_rate, rate_out)
                    audio = to_float32(np.asarray(pcm).reshape(-1))
                    yield from self._chunks(resample(audio), rate_out, text, turn)
            finally:  # a barge-in leaves early: let the engine release its stream now
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            # the text's pace, for an LLM that writes a reply just ahead of its listener (llm.lead_s)
            playback.spoken(turn, len(text) + 1, self._made_s - made_before)
        if resample is not None and not self.interrupted(turn):
            yield from self._chunks(resample.flush(), rate_out, text, turn)

    def _piece_times(self) -> PieceTimes:
        """The voice's, shared by the process's sessions (by its scheduler's name, or its voice's)."""
        return PieceTimes.of(self.inference_key() or f"{type(self).__name__}:{self.voice_name}")

    def _schedule(self, turn: int) -> tuple[str, float | None]:
        """The kind and deadline of the reply's next piece: its first is ``first`` work; a later one
        waits until the listener is within ``lead_s`` and what a piece takes now of it (a paced sink),
        then is due when the listener will have heard what was made before it."""
        if self._made_s == 0.0:
            return "first", None
        playback = playback_of(self.ctx)
        if not playback.paced:
            return "later", None
        cancelled = lambda: self.interrupted(turn) or self.ctx.stopping.is_set()  # noqa: E731
        if self.lead_s:
            # what a piece takes now (the voice's, measured by every session's pieces): the piece is
            # begun that much earlier, so the listener has the lead left when it is made, loaded or not
            times = self._piece_times()
            if self._made_s > (ahead := self.lead_s + times.s):
                playback.wait_played(turn, self._made_s - ahead, cancelled=cancelled)
            # another session's first words go first while the listener has audio enough: a third of
            # the lead, and what a piece takes now (or the listener runs out meanwhile)
            critical.yield_to(lambda: self._made_s - playback.played_s(turn) > self.lead_s / 3 + times.s, cancelled)
        return "later", time.monotonic() + max(0.0, self._made_s - playback.played_s(turn))

    def _made_in_slot(self, stream: Iterator[np.ndarray], kind: str, turn: int, deadline: float | None) -> Any:
        """The engine's next chunk, made in a slot of the shared voice (``_END`` after the last). A
        speculative reply's chunk that was shed waits for the turn's confirmation (or its withdrawal)."""
        while True:
            try:
                with self.inference_slot(kind, turn=turn, deadline=deadline,
                                         cancelled=lambda: self.interrupted(turn)):
                    return next(stream, _END)
            except Cancelled:  # a barge-in while it waited
                return _END
            except Shed as shed:
                self.ctx.log.debug("turn %d: %s; waiting for its confirmation", turn, shed)
                if not self.ctx.work.wait_confirmed(
                        turn, cancelled=lambda: self.interrupted(turn) or self.ctx.stopping.is_set()):
                    return _END

    def _chunks(self, audio: np.ndarray, rate: int, sentence: str, turn: int) -> Iterator[AudioOut]:
        self._made_s += len(audio) / rate
        step = max(1, int(self.max_chunk_s * rate))
        for start in range(0, len(audio), step):
            yield AudioOut(turn=turn, pcm=np.ascontiguousarray(audio[start : start + step]), rate=rate,
                           text=sentence)
