"""Holds a speculative reply until its turn is confirmed: nothing of a withdrawn turn is played.

With ``vad.speculate_ms`` the reply starts at an early pause, before the VAD knows the user
has finished. The gate sits between TTS and the sink (``gate`` in the chain, on by itself when
``vad.speculate_ms`` > 0) and watches the VAD's utterances: the reply text and audio of a turn
whose ``Speech`` came as speculative wait here until the confirming ``Speech`` of the same
turn arrives, then go on in order; if the user went on instead, the VAD's interrupt makes the
turn stale and what is held is dropped. Turns that were never speculative pass straight through.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from s2s_flow.messages import AudioOut, Message, Speech, TextDelta
from s2s_flow.node import Node

__all__ = ["TurnGate"]


class TurnGate(Node):
    """Reply messages of an unconfirmed speculative turn are held; confirmed, they are released."""

    inputs = {"speech": Speech, "text": TextDelta, "audio": AudioOut}
    outputs = {"text": TextDelta, "audio": AudioOut}
    optional_inputs = frozenset({"text", "audio"})
    taps = frozenset({"speech", "text"})  # the VAD's utterances and the LLM's text, which TTS consumes

    def __init__(self) -> None:
        self._lock = threading.Lock()  # interrupts come from other threads
        self._held: dict[int, list[Message]] = {}  # speculative turn -> its reply so far
        self._stale_below = 0

    def process(self, port: str, msg: Message) -> Iterator[Message]:
        with self._lock:
            if msg.turn < self._stale_below:
                return
            if isinstance(msg, Speech):
                if msg.speculative:
                    self._held.setdefault(msg.turn, [])
                    return
                released = self._held.pop(msg.turn, [])
            elif msg.turn in self._held:
                self._held[msg.turn].append(msg)
                return
            else:
                released = [msg]
        yield from released

    def on_interrupt(self, turn: int) -> None:
        with self._lock:
            self._stale_below = max(self._stale_below, turn)
            for held in [t for t in self._held if t < turn]:
                del self._held[held]

    def held(self) -> dict[int, int]:
        """Turns held now and how many messages each (for tests and logs)."""
        with self._lock:
            return {t: len(m) for t, m in self._held.items()}
