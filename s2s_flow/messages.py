"""The typed messages that flow between nodes.

Every message is immutable, carries the conversational ``turn`` it belongs to and the
monotonic time ``t`` at which it was made. Data messages travel on bounded rings;
control messages (:class:`Interrupt`) travel on each node's control lane, which never
waits behind data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "Message",
    "AudioChunk",
    "SpeechStarted",
    "Speech",
    "SpeechSoFar",
    "Transcript",
    "TextDelta",
    "AudioOut",
    "Interrupt",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    turn: int = 0
    t: float = field(default_factory=time.monotonic)

    #: Default ring for edges carrying this type: (capacity, policy). A generic edge is as deep
    #: as a text edge: small messages, and each ring-full costs a thread hand-over.
    ring: ClassVar[tuple[int, str]] = (256, "block")
    #: Whether a message of this type can stand for a milestone (the trace asks only those).
    has_marks: ClassVar[bool] = False

    def mark(self) -> str | None:
        """The milestone this message stands for (speech_end, token, audio ...), if any; read by
        the trace, which keeps the first time each milestone passes in and out of every node.
        It depends only on the message's fields."""
        return None

    def mark_time(self) -> float:
        """When the milestone happened: by default, when the message was made."""
        return self.t


@dataclass(frozen=True, slots=True, kw_only=True)
class AudioChunk(Message):
    """A block of mono float32 PCM from a source. ``start`` is its offset in the stream (s)."""

    pcm: np.ndarray
    rate: int
    start: float = 0.0

    ring: ClassVar[tuple[int, str]] = (128, "drop_oldest")

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.rate


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStarted(Message):
    """Speech was confirmed by the VAD: a new user turn begins (barge-in keys on it).

    ``continues``: the turn whose speculative reply was just withdrawn because the user went
    on talking (``vad.speculate_ms``); this turn is the same utterance, not a new one.
    """

    start: float = 0.0
    continues: int = 0

    has_marks: ClassVar[bool] = True

    def mark(self) -> str:
        return "speech_started"


@dataclass(frozen=True, slots=True, kw_only=True)
class Speech(Message):
    """One finished user utterance.

    ``start``/``end`` are stream offsets in seconds; ``speech_end_t`` is the monotonic
    time at which the user really stopped talking (VAD stop minus its silence hangover).

    ``speculative``: sent at an early pause (``vad.speculate_ms``), before the turn is known to
    be over, so the reply can start. If the turn ends at that pause the VAD sends the same
    utterance again with ``speculative=False`` (the confirmation; held replies may play). If the
    user goes on, the VAD withdraws the turn (an interrupt, reason "speculation") and the
    utterance continues as a new turn (``SpeechStarted.continues``). Only the LLM path acts on a
    speculative message; sinks show a turn's user side from its confirmed messages.
    """

    pcm: np.ndarray
    rate: int
    start: float
    end: float
    speech_end_t: float
    speculative: bool = False

    ring: ClassVar[tuple[int, str]] = (8, "block")

    has_marks: ClassVar[bool] = True

    def mark(self) -> str:
        return "speech_end"

    def mark_time(self) -> float:
        return self.speech_end_t


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechSoFar(Message):
    """The user's utterance up to now, while they speak (``vad.stream_ms``): the same ``start`` and
    samples as its ``Speech`` will have, so an STT can decode it as it grows. The freshest wins:
    an edge keeps the last four (an STT still decoding one skips the older ones)."""

    pcm: np.ndarray
    rate: int
    start: float

    ring: ClassVar[tuple[int, str]] = (4, "drop_oldest")


@dataclass(frozen=True, slots=True, kw_only=True)
class Transcript(Message):
    """What the user said. ``final=False``: a live partial, for display only. ``speculative``:
    the transcript of a speculative ``Speech`` (the LLM may start on it; a confirmation with
    ``speculative=False`` follows if the turn ends there)."""

    text: str
    language: str | None = None
    final: bool = True
    speculative: bool = False
    images: tuple[str, ...] = ()  # image URLs (data: or http[s]:) shown with the words (llm.vision)

    ring: ClassVar[tuple[int, str]] = (16, "block")

    has_marks: ClassVar[bool] = True

    def mark(self) -> str:
        return "transcript_final" if self.final else "transcript_partial"


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta(Message):
    """Streamed reply text. ``sentence_end`` closes a sentence TTS can speak; ``end`` closes the reply,
    and ``error`` with it says that the reply broke off, and why (its node fails next)."""

    text: str
    sentence_end: bool = False
    end: bool = False
    error: str | None = None

    ring: ClassVar[tuple[int, str]] = (256, "block")

    has_marks: ClassVar[bool] = True

    def mark(self) -> str | None:
        if self.sentence_end:
            return "sentence"
        return "token" if self.text else None


@dataclass(frozen=True, slots=True, kw_only=True)
class AudioOut(Message):
    """Synthesized reply audio; ``end`` marks the last chunk of a reply (its pcm may be empty)."""

    pcm: np.ndarray
    rate: int
    text: str = ""
    end: bool = False

    ring: ClassVar[tuple[int, str]] = (64, "block")

    has_marks: ClassVar[bool] = True

    def mark(self) -> str | None:
        return "audio" if len(self.pcm) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupt(Message):
    """Barge-in: every message of a turn older than ``turn`` is stale from now on."""

    reason: str = "barge-in"
    detail: dict[str, Any] = field(default_factory=dict)
