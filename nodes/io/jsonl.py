"""Append any message stream to a JSON Lines file: a tap for non-linear graphs.

    # conf: record every final transcript next to the normal run
    s2s-run '+nodes.log={_target_:nodes.io.jsonl.JsonlSink,path:transcripts.jsonl}' \
            'edges=["stt.text -> log.in"]'
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from s2s_flow.messages import Message
from s2s_flow.node import Node


class JsonlSink(Node):
    """One JSON object per message: its type, turn, time and fields (audio as its length)."""

    inputs = {"in": Message}

    def __init__(self, *, path: str = "messages.jsonl"):
        self.path = path
        self._file = None

    def setup(self) -> None:
        path = Path(self.path).expanduser()
        path = path if path.is_absolute() else self.ctx.run_dir / path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def process(self, port: str, msg: Message) -> None:
        row = {"type": type(msg).__name__, "conversation": self.ctx.conversation}
        for f in dataclasses.fields(msg):
            value = getattr(msg, f.name)
            row[f.name] = f"<{len(value)} samples>" if isinstance(value, np.ndarray) else value
        assert self._file is not None
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
