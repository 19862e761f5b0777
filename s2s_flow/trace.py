"""Per node, per turn timing recorded by the engine, so metrics need no node code.

For every (turn, node) the scheduler records when the first message arrived, when the
first and last outputs left, how many went each way and how long messages waited in
rings. Messages also name milestones (``Message.mark()``: speech_end, token, sentence,
audio ...); the first time each milestone is seen, in or out of a node, is kept.
Each node's record is written only by that node's thread, so no lock is needed, and
memory grows with turns, not with messages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Any

from s2s_flow.messages import Message

__all__ = ["Trace", "NodeTurn"]

_turn = attrgetter("turn")


def _mixed(batch: list[Message], turn: int) -> bool:
    return list(map(_turn, batch)).count(turn) != len(batch)


def _runs(batch: list[Message]) -> Iterator[tuple[list[Message], slice]]:
    """Split a batch into runs of consecutive messages of one turn."""
    i = 0
    for _, group in groupby(batch, key=_turn):
        n = sum(1 for _ in group)
        yield batch[i:i + n], slice(i, i + n)
        i += n


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
    marks_in: dict[str, float] = field(default_factory=dict)  # milestone -> first time it came in
    marks_out: dict[str, float] = field(default_factory=dict)  # milestone -> when it happened, first out

    @property
    def marks(self) -> dict[str, float]:
        """Both, as "in:audio" / "out:sentence" -> time."""
        return {**{"in:" + k: t for k, t in self.marks_in.items()},
                **{"out:" + k: t for k, t in self.marks_out.items()}}


class Trace:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.nodes: dict[str, dict[int, NodeTurn]] = {}
        self.events: list[dict[str, Any]] = []  # rare engine events: interrupts, errors, sessions
        self.conversations: dict[int, str] = {}  # turn -> conversation it belongs to

    def node(self, name: str) -> dict[int, NodeTurn]:
        return self.nodes.setdefault(name, {})

    # received() and emitted() are the engine's hot path: one record update per batch (per
    # run of one turn in the rare mixed batch), sums taken with sum(), and only types that can
    # stand for a milestone asked for one.

    def received(self, table: dict[int, NodeTurn], batch: list[Message], put_times: list[float],
                 now: float) -> None:
        """A batch taken from one ring at ``now``, oldest first, with the time each was put."""
        turn, n = batch[0].turn, len(batch)
        if n > 1 and _mixed(batch, turn):
            for run, span in _runs(batch):
                self.received(table, run, put_times[span], now)
            return
        rec = table.get(turn)
        if rec is None:
            rec = table[turn] = NodeTurn(first_in=now)
        elif rec.first_in is None:
            rec.first_in = now
        rec.last_in = now
        rec.n_in += n
        oldest = now - put_times[0]
        rec.wait_s += oldest if n == 1 else n * now - sum(put_times)
        if oldest > rec.wait_max_s:
            rec.wait_max_s = oldest
        marks = rec.marks_in
        for msg in batch:
            if msg.has_marks:
                name = msg.mark()
                if name is not None and name not in marks:
                    marks[name] = now

    def emitted(self, table: dict[int, NodeTurn], batch: list[Message], now: float) -> None:
        """Messages a node sent at ``now``, in order."""
        turn, n = batch[0].turn, len(batch)
        if n > 1 and _mixed(batch, turn):
            for run, _ in _runs(batch):
                self.emitted(table, run, now)
            return
        rec = table.get(turn)
        if rec is None:
            rec = table[turn] = NodeTurn(first_out=now)
        elif rec.first_out is None:
            rec.first_out = now
        rec.last_out = now
        rec.n_out += n
        marks = rec.marks_out
        for msg in batch:
            if msg.has_marks:
                name = msg.mark()
                if name is not None and name not in marks:
                    marks[name] = msg.mark_time()

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, "t": time.monotonic(), **fields})

    def turns(self) -> list[int]:
        return sorted({t for table in self.nodes.values() for t in table if t > 0})

    def to_dict(self) -> dict[str, Any]:
        """Times relative to the start of the run, in seconds."""
        def rel(rec: NodeTurn) -> dict[str, Any]:
            d = asdict(rec)
            del d["marks_in"], d["marks_out"]
            for k in ("first_in", "last_in", "first_out", "last_out"):
                if d[k] is not None:
                    d[k] = round(d[k] - self.t0, 6)
            d["marks"] = {k: round(v - self.t0, 6) for k, v in rec.marks.items()}  # the JSON keeps one dict
            return d

        return {
            "nodes": {n: {str(t): rel(r) for t, r in table.items()} for n, table in self.nodes.items()},
            "events": [{**e, "t": round(e["t"] - self.t0, 6)} for e in self.events],
            "conversations": {str(k): v for k, v in self.conversations.items()},
        }
