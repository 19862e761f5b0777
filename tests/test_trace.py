"""The trace's per-batch updates (the engine's hot path): one record update per batch, or per run
of one turn in a mixed batch, against a plain message-by-message account of the same calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, TextDelta, Transcript
from s2s_flow.trace import NodeTurn, Trace

PCM = np.zeros(4, np.float32)


def message(kind: int, turn: int, t: float) -> Message:
    """Every kind of message the trace treats apart: no milestone, a milestone or not by content."""
    if kind == 0:
        return AudioChunk(pcm=PCM, rate=16000, turn=turn, t=t)
    if kind == 1:
        return TextDelta(text="", turn=turn, t=t)  # no milestone
    if kind == 2:
        return TextDelta(text="a", turn=turn, t=t)
    if kind == 3:
        return TextDelta(text="a.", sentence_end=True, turn=turn, t=t)
    if kind == 4:
        return AudioOut(pcm=PCM[:0] if turn % 2 else PCM, rate=16000, turn=turn, t=t)
    if kind == 5:
        return Transcript(text="x", final=bool(turn % 2), turn=turn, t=t)
    return Speech(pcm=PCM, rate=16000, start=0.0, end=1.0, speech_end_t=t - 0.5, turn=turn, t=t)


batches = st.lists(
    st.tuples(st.booleans(),  # received (True) or emitted
              st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.floats(0, 100)), min_size=1, max_size=12),
              st.floats(0, 200)),
    min_size=1, max_size=8)


def one_by_one(calls: list) -> dict[int, NodeTurn]:
    """What the records must say, message by message (put times oldest first, as a ring hands them)."""
    table: dict[int, NodeTurn] = {}
    for incoming, spec, now in calls:
        for kind, turn, t in spec:
            msg, rec = message(kind, turn, t), table.setdefault(turn, NodeTurn())
            name = msg.mark() if msg.has_marks else None
            if incoming:
                rec.first_in = now if rec.first_in is None else rec.first_in
                rec.last_in, rec.n_in = now, rec.n_in + 1
                rec.wait_s += now - t
                rec.wait_max_s = max(rec.wait_max_s, now - t)
                if name is not None:
                    rec.marks_in.setdefault(name, now)
            else:
                rec.first_out = now if rec.first_out is None else rec.first_out
                rec.last_out, rec.n_out = now, rec.n_out + 1
                if name is not None:
                    rec.marks_out.setdefault(name, msg.mark_time())
    return table


@settings(max_examples=300, deadline=None)
@given(calls=batches)
def test_a_batch_is_recorded_as_its_messages_one_by_one_would_be(calls):
    calls = [(incoming, sorted(spec, key=lambda m: m[2]), now) for incoming, spec, now in calls]
    tr, table = Trace(), {}
    for incoming, spec, now in calls:
        batch = [message(kind, turn, t) for kind, turn, t in spec]
        if incoming:
            tr.received(table, batch, [t for _, _, t in spec], now)
        else:
            tr.emitted(table, batch, now)
    want = one_by_one(calls)
    assert table.keys() == want.keys()
    for turn, rec in want.items():
        got = table[turn]
        assert got.wait_s == pytest.approx(rec.wait_s, rel=1e-9, abs=1e-9)
        got.wait_s = rec.wait_s
        assert got == rec, turn


def test_the_trace_records_a_batch_per_turn_with_its_waits_and_first_marks():
    tr, table = Trace(), {}
    batch = [TextDelta(turn=1, text="a", t=1.0), TextDelta(turn=1, text="b.", sentence_end=True, t=1.1),
             TextDelta(turn=2, text="c", t=1.2), TextDelta(turn=2, text="d", t=1.3),
             TextDelta(turn=1, text="e", t=1.4)]
    tr.received(table, batch, [9.0, 9.5, 9.6, 9.7, 9.8], 10.0)
    one, two = table[1], table[2]
    assert (one.n_in, two.n_in) == (3, 2)
    assert one.wait_s == pytest.approx(1.0 + 0.5 + 0.2) and one.wait_max_s == pytest.approx(1.0)
    assert two.wait_s == pytest.approx(0.4 + 0.3) and two.wait_max_s == pytest.approx(0.4)
    assert one.marks == {"in:token": 10.0, "in:sentence": 10.0} and two.marks == {"in:token": 10.0}
    tr.emitted(table, batch, 11.0)
    assert one.marks["out:token"] == 1.0 and one.marks["out:sentence"] == 1.1 and two.marks["out:token"] == 1.2
    assert (one.n_out, two.n_out, one.first_out, one.last_out) == (3, 2, 11.0, 11.0)
    later = TextDelta(turn=1, text="f.", sentence_end=True, t=2.0)
    tr.emitted(table, [later], 12.0)
    assert one.marks["out:sentence"] == 1.1 and one.last_out == 12.0  # the first milestone is kept


def test_an_error_in_mark_reaches_the_caller():
    class Broken(TextDelta):
        __slots__ = ()

        def mark(self) -> str:
            raise RuntimeError("no mark")

    with pytest.raises(RuntimeError, match="no mark"):
        Trace().emitted({}, [Broken(text="a")], 1.0)
