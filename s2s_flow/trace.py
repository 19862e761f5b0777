"""Per node, per turn timing recorded by the engine, so metrics need no node code.

For every (turn, node) the scheduler records when the first message arrived, when the
first and last outputs left, how many went each way and how long messages waited in
rings. Messages also name milestones (``Message.marks()``: speech_end, token, sentence,
audio ...); the first time each milestone is seen, in or out of a node, is kept.
Each node's record is written only by that node's thread, so no lock is needed, and
memory grows with turns, not with messages.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from s2s_flow.messages import Message

__all__ = ["Trace", "NodeTurn"]


@dataclass(slots=True)
class NodeTurn:
    first_in: float | None = None
    last_in: float | None = None
    first_out: float | None = None
    last_out: float | None = None
    n_in: int = 0
    n_out: int = 0
    wait_s: float = 0.0  # total time inputs spent queued in rings
    wait_max_s: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)  # "in:audio" / "out:sentence" -> first time


class Trace:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.nodes: dict[str, dict[int, NodeTurn]] = {}
        self.events: list[dict[str, Any]] = []  # rare engine events: interrupts, errors, sessions
        self.conversations: dict[int, str] = {}  # turn -> conversation it belongs to

    def node(self, name: str) -> dict[int, NodeTurn]:
        return self.nodes.setdefault(name, {})

    def received(self, table: dict[int, NodeTurn], msg: Message, now: float, waited: float) -> None:
        rec = table.get(msg.turn)
        if rec is None:
            rec = table[msg.turn] = NodeTurn(first_in=now)
        elif rec.first_in is None:
            rec.first_in = now
        rec.last_in = now
        rec.n_in += 1
        rec.wait_s += waited
        if waited > rec.wait_max_s:
            rec.wait_max_s = waited
        if msg.has_marks:
            for name in msg.marks():
                rec.marks.setdefault("in:" + name, now)

    def emitted(self, table: dict[int, NodeTurn], msg: Message, now: float) -> None:
        rec = table.get(msg.turn)
        if rec is None:
            rec = table[msg.turn] = NodeTurn(first_out=now)
        elif rec.first_out is None:
            rec.first_out = now
        rec.last_out = now
        rec.n_out += 1
        if msg.has_marks:
            for name, at in msg.marks().items():
                rec.marks.setdefault("out:" + name, at)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, "t": time.monotonic(), **fields})

    def turns(self) -> list[int]:
        return sorted({t for table in self.nodes.values() for t in table if t > 0})

    def to_dict(self) -> dict[str, Any]:
        """Times relative to the start of the run, in seconds."""
        def rel(rec: NodeTurn) -> dict[str, Any]:
            d = asdict(rec)
            for k in ("first_in", "last_in", "first_out", "last_out"):
                if d[k] is not None:
                    d[k] = round(d[k] - self.t0, 6)
            d["marks"] = {k: round(v - self.t0, 6) for k, v in rec.marks.items()}
            return d

        return {
            "nodes": {n: {str(t): rel(r) for t, r in table.items()} for n, table in self.nodes.items()},
            "events": [{**e, "t": round(e["t"] - self.t0, 6)} for e in self.events],
            "conversations": {str(k): v for k, v in self.conversations.items()},
        }
