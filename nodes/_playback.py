"""What the listener really heard: a record shared by the nodes of one run.

The speaker sink writes it (the text of each reply as far as it was played before a
barge-in, and until when the agent is audible); the microphone's echo guard reads the
second, and an LLM backend reads the first to cut its history to what was heard::

    truncate_to_heard(self.ctx, self.conversation)   # in an LLM's process(), before add_user

It is also the session's playback clock. A sink that plays at the listener's pace (io=realtime,
the speaker) marks it ``paced`` and tells it when a reply started playing and how much of it was
sent; a TTS reads ``played_s(turn)`` to make a reply's later sentences just in time, ``tts.lead_s``
ahead of the listener (``wait_played``), and tells it how much of a reply's text became how much
audio (``spoken``); an LLM that streams from a server reads that to write a reply's later
sentences ``llm.lead_s`` ahead of the listener (``ahead_s``, ``wait_ahead``). A file run's sink
marks nothing: no pacing.

The record lives in the run-wide ``ctx.run_state`` dict, so every node of a run sees the same one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from s2s_flow.node import Context

__all__ = ["Playback", "playback_of", "truncate_to_heard"]

#: seconds of speech per character of English text (~13 characters a second) until a voice has
#: spoken enough of the run to measure its own pace
DEFAULT_S_PER_CHAR = 0.075


class Playback:
    """Thread-safe: written by the speaker's playback thread and the sink, read by other nodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a reply started, or more of it was sent
        self._heard: dict[int, str] = {}
        self._started: dict[int, float] = {}
        self._sent: dict[int, float] = {}  # seconds of each reply's audio sent to the listener
        self._spoken: dict[int, tuple[int, float]] = {}  # per reply: characters synthesized, their seconds
        self._s_per_char = DEFAULT_S_PER_CHAR  # the voice's pace, from what it has spoken
        #: set by a sink that plays at the listener's pace: a TTS paces its replies by this clock
        self.paced = False
        self._audible_until = 0.0
        self.cuts: list[dict[str, Any]] = []  # one per interrupted reply: turn, t, heard, played_s

    def started(self, turn: int, t: float) -> None:
        """The first audio of ``turn``'s reply went to the device at ``t`` (kept once)."""
        with self._lock:
            self._started.setdefault(turn, t)
            self._changed.notify_all()

    def sent(self, turn: int, seconds: float) -> None:
        """``seconds`` more of ``turn``'s reply went to the listener (queued to play)."""
        with self._lock:
            self._sent[turn] = self._sent.get(turn, 0.0) + seconds
            for old in [t for t in self._sent if t < turn - 8]:  # replies long over
                del self._sent[old]
                self._started.pop(old, None)
                self._spoken.pop(old, None)
            self._changed.notify_all()

    def spoken(self, turn: int, chars: int, seconds: float) -> None:
        """A TTS made ``seconds`` of audio out of ``chars`` more characters of ``turn``'s reply."""
        with self._lock:
            done, made = self._spoken.get(turn, (0, 0.0))
            self._spoken[turn] = (done + chars, made + seconds)
            if chars >= 8 and seconds > 0:  # the voice's pace, smoothed over its pieces
                self._s_per_char += 0.3 * (seconds / chars - self._s_per_char)
            self._changed.notify_all()

    def ahead_s(self, turn: int, chars: int, now: float | None = None) -> float:
        """How far ahead of the listener ``turn``'s reply is once it has ``chars`` characters of text:
        its audio made and not heard yet, and its text not spoken yet at the voice's pace (s)."""
        with self._lock:
            return self._ahead(turn, chars, time.monotonic() if now is None else now)

    def _ahead(self, turn: int, chars: int, now: float) -> float:
        done, made = self._spoken.get(turn, (0, 0.0))
        return max(0.0, made - self._played(turn, now)) + max(0, chars - done) * self._s_per_char

    def wait_ahead(self, turn: int, chars: int, lead_s: float, cancelled: Callable[[], bool],
                   stall_s: float = 10.0) -> str:
        """Block until a reply of ``chars`` characters is at most ``lead_s`` ahead of the listener:
        ``"due"``; ``"cancelled"`` once ``cancelled()`` (a barge-in, the end: :meth:`wake`); ``"stalled"``
        for a reply nobody plays (its voice failed, its turn held): ``stall_s`` with nothing more
        made or heard of it."""
        with self._lock:
            last, since = None, time.monotonic()
            while not cancelled():
                now = time.monotonic()
                if self._ahead(turn, chars, now) <= lead_s:
                    return "due"
                state = (self._spoken.get(turn), self._played(turn, now))
                if state != last:
                    last, since = state, now
                elif now - since >= stall_s:
                    return "stalled"
                self._changed.wait(0.1)
        return "cancelled"

    def played_s(self, turn: int, now: float | None = None) -> float:
        """How much of ``turn``'s reply the listener has heard by ``now``: the time since it started
        playing, at most what was sent of it (0 before it started)."""
        with self._lock:
            return self._played(turn, time.monotonic() if now is None else now)

    def _played(self, turn: int, now: float) -> float:
        start = self._started.get(turn)
        return 0.0 if start is None else max(0.0, min(now - start, self._sent.get(turn, 0.0)))

    def wait_played(self, turn: int, seconds: float, cancelled: Callable[[], bool]) -> None:
        """Block until ``seconds`` of ``turn``'s reply were played, or ``cancelled()`` (a barge-in,
        the end: call :meth:`wake` to have it looked at now)."""
        with self._lock:
            while not cancelled():
                now = time.monotonic()
                played = self._played(turn, now)
                if played >= seconds:
                    return
                start = self._started.get(turn)
                playing = start is not None and self._sent.get(turn, 0.0) > played
                # playing: wake when enough has; else when the sink starts it or sends more
                self._changed.wait(min(seconds - played, 0.5) if playing else 0.5)

    def wake(self) -> None:
        """Have the waits look at their ``cancelled()`` now."""
        with self._lock:
            self._changed.notify_all()

    def started_at(self, turn: int) -> float | None:
        with self._lock:
            return self._started.get(turn)

    def set_heard(self, turn: int, text: str, *, played_s: float, t: float) -> None:
        """A barge-in cut ``turn``'s reply: ``text`` is what was played of it."""
        with self._lock:
            self._heard[turn] = text
            self.cuts.append({"turn": turn, "t": t, "heard": text, "played_s": round(played_s, 3)})

    def heard(self, turn: int) -> str | None:
        """What was heard of ``turn``'s reply if a barge-in cut it; None if it was not cut."""
        with self._lock:
            return self._heard.get(turn)

    def set_audible_until(self, t: float) -> None:
        with self._lock:
            self._audible_until = max(self._audible_until, t)

    def audible(self, now: float | None = None) -> bool:
        """Whether the agent's voice may be in the room now (echo guard)."""
        return (time.monotonic() if now is None else now) < self._audible_until


_LOCK = threading.Lock()


def playback_of(ctx: Context) -> Playback:
    """The run's record: every node of one scheduler run gets the same object."""
    with _LOCK:
        return ctx.run_state.setdefault("playback", Playback())


class _Conversation(Protocol):
    exchanges: list[Any]

    def truncate_last_reply(self, text: str) -> None: ...


def truncate_to_heard(ctx: Context, conversation: _Conversation) -> bool:
    """Cut the last reply of ``conversation`` to what the user heard, if a barge-in cut it.

    Call it when a new user turn arrives, before adding it: by then the reply was recorded
    as produced, and the speaker has reported how much of it was played. True if cut.
    """
    if not conversation.exchanges:
        return False
    heard = playback_of(ctx).heard(conversation.exchanges[-1].turn)
    if heard is None:
        return False
    conversation.truncate_last_reply(heard)
    return True
