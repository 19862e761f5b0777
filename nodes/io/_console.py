"""The conversation on the terminal as it happens: a live line while the user speaks (partial
transcript), replaced by the final text; the agent's sentences as they are played."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ConsoleView"]


class ConsoleView:
    """Thread-safe printer: the sink thread and the playback thread both write to it."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console(highlight=False)
        self._lock = threading.Lock()
        self._live: Any = None
        self._agent_turn: int | None = None

    def _line(self, text: Any) -> None:
        """Set the live line (terminals only); an empty text removes it."""
        if not self.console.is_terminal:
            return
        if self._live is None:
            if not text:
                return
            from rich.live import Live

            self._live = Live(console=self.console, auto_refresh=False, transient=True)
            self._live.start()
        self._live.update(text or "", refresh=True)

    def partial(self, text: str) -> None:
        from rich.text import Text

        with self._lock:
            self._line(Text.assemble(("you  ", "bold cyan"), (text + " ...", "dim")))

    def user(self, text: str) -> None:
        from rich.text import Text

        with self._lock:
            self._line("")
            self._agent_turn = None
            self.console.print(Text.assemble(("you  ", "bold cyan"), text))

    def agent(self, turn: int, sentence: str) -> None:
        """A sentence of the reply starts playing (or is complete, without audio)."""
        from rich.text import Text

        with self._lock:
            self._line("")
            label = "agent" if self._agent_turn != turn else "     "
            self._agent_turn = turn
            self.console.print(Text.assemble((label, "bold green"), " ", sentence))

    def interrupted(self, heard: str) -> None:
        from rich.text import Text

        with self._lock:
            tail = heard.split()[-4:]
            where = f" after \"...{' '.join(tail)}\"" if tail else " before a word was played"
            self.console.print(Text(f"      (interrupted{where})", style="yellow"))

    def close(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None
