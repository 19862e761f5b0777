"""Helpers for the remote LLM tests: build a node against a server, run one turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from s2s_flow.messages import Message, Speech, TextDelta, Transcript
from s2s_flow.node import Context


def llm_node(cls: type, base_url: str, tmp_path: Path, *, setup: bool = True, **options: Any) -> Any:
    """A remote LLM node with a context, set up (warm-up request included) unless told not to."""
    node = cls(base_url=base_url, **options)
    node.ctx = Context("llm", tmp_path)
    if setup:
        node.setup()
    return node


def turn(node: Any, user: str | Message, n: int = 1) -> list[TextDelta]:
    """All TextDeltas of one reply to ``user`` (text, or a message such as Speech)."""
    msg = Transcript(turn=n, text=user) if isinstance(user, str) else user
    port = "audio" if isinstance(msg, Speech) else "text"
    return list(node.process(port, msg))


def text_of(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def sentences(deltas: list[TextDelta]) -> list[str]:
    """The reply cut where ``sentence_end`` marks it (what TTS would speak, one by one)."""
    out, cur = [], ""
    for d in deltas:
        cur += d.text
        if d.sentence_end:
            out.append(cur)
            cur = ""
    return out + ([cur] if cur.strip() else [])
