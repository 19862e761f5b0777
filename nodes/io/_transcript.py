"""What every sink shares: the words of each turn and ``transcript.jsonl``, one row per turn."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from s2s_flow.errors import ConfigError
from s2s_flow.messages import Message, TextDelta, Transcript

__all__ = ["TurnText", "TranscriptFile", "check_output_dir"]


@dataclass
class TurnText:
    """One turn's words: the user's final transcript and the agent's reply as streamed."""

    user: str | None = None
    agent: list[str] = field(default_factory=list)
    agent_done: bool = False

    def note(self, msg: Message) -> None:
        """Take a Transcript (final only) or a TextDelta; ignore anything else."""
        if isinstance(msg, Transcript):
            if msg.final and not msg.speculative:
                self.user = msg.text
        elif isinstance(msg, TextDelta):
            self.agent.append(msg.text)
            self.agent_done |= msg.end

    @property
    def reply(self) -> str:
        return "".join(self.agent).strip()


def check_output_dir(output_dir: str | None) -> None:
    """``io.output_dir`` must be creatable and writable (checked at compose time)."""
    if output_dir is None:
        return
    out = Path(output_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"io.output_dir={output_dir}: cannot create it ({exc.strerror}); "
                          "choose a writable directory") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"io.output_dir={output_dir} is not writable; choose a writable directory")


class TranscriptFile:
    """``<dir>/transcript.jsonl``, appended one row per turn and flushed per row, so a stopped
    run keeps every turn already finished.

    A row is final once written: a message of its turn that comes later (the confirmed transcript
    of a speculative turn, after the reply the gate released in one burst was already complete) is
    one a sink must not start a second row with; :meth:`written` says so."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "transcript.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._written: set[tuple[str, int]] = set()

    def write(self, row: dict[str, Any]) -> None:
        self._written.add((row["conversation"], row["turn"]))
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()

    def written(self, conversation: str, turn: int) -> bool:
        """Whether this turn's row is already out."""
        return (conversation, turn) in self._written

    def close(self) -> None:
        self._file.close()
