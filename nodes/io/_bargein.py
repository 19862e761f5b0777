"""When user speech cuts the agent off: the barge-in rule, apart from any audio code."""

from __future__ import annotations

from s2s_flow.messages import Speech, SpeechStarted

__all__ = ["BargeIn"]


class BargeIn:
    """Confirmed user speech (the VAD's ``SpeechStarted``) interrupts once the user has spoken
    ``min_speech_s``, counted on the input stream's clock from the start of the speech.

    The stream clock is the end of the latest input chunk (``position``); an utterance that
    ends shorter than the minimum (a cough, "uh-huh") interrupts nothing. Without a clock,
    speech interrupts as soon as the VAD confirms it.
    """

    def __init__(self, *, enabled: bool = True, min_speech_s: float = 0.0) -> None:
        self.enabled, self.min_speech_s = enabled, min_speech_s
        self._pending: tuple[int, float] | None = None  # (turn, speech start in stream seconds)
        self._position: float | None = None

    def started(self, msg: SpeechStarted) -> int | None:
        """A user turn begins; returns the turn to interrupt for, if it is due already."""
        if not self.enabled:
            return None
        self._pending = (msg.turn, msg.start)
        return self._due()

    def position(self, seconds: float) -> int | None:
        """The input stream reached ``seconds``; returns a turn to interrupt for, if due now."""
        self._position = seconds
        return self._due() if self._pending else None

    def ended(self, msg: Speech) -> int | None:
        """The utterance ended: long enough interrupts (if not already), too short never will."""
        if self._pending is None or self._pending[0] != msg.turn:
            return None
        self._pending = None
        return msg.turn if msg.end - msg.start >= self.min_speech_s else None

    def _due(self) -> int | None:
        assert self._pending is not None
        turn, start = self._pending
        if self.min_speech_s > 0 and self._position is not None and self._position - start < self.min_speech_s:
            return None
        self._pending = None
        return turn
