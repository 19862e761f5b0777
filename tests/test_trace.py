"""The trace's per-batch updates: the C version (s2s_flow/_trace.c) against the Python
reference in s2s_flow/trace.py, on the same random batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_flow import trace
from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, TextDelta, Transcript
from s2s_flow.trace import NodeTurn, Trace

PCM = np.zeros(4, np.float32)


def python_trace() -> Trace:
    """A Trace that uses the Python methods (what a machine without a C compiler runs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace, "native", None)
        return Trace()


def test_the_install_builds_the_c_trace():
    assert trace.native is not None, "s2s_flow/_trace.c was not compiled: run scripts/bootstrap.sh (gcc, python3-dev)"
    assert Trace().received is trace.native.received


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


@settings(max_examples=300, deadline=None)
@given(calls=batches)
def test_the_c_trace_keeps_the_same_records_as_the_python_one(calls):
    c, py = Trace(), python_trace()
    tables: tuple[dict[int, NodeTurn], dict[int, NodeTurn]] = ({}, {})
    for incoming, spec, now in calls:
        batch = [message(kind, turn, t) for kind, turn, t in spec]
        for tr, table in zip((c, py), tables, strict=True):
            if incoming:
                tr.received(table, list(batch), [t for _, _, t in spec], now)
            else:
                tr.emitted(table, tuple(batch), now)
    native, reference = tables
    assert native.keys() == reference.keys()
    for turn, want in reference.items():
        got = native[turn]
        assert got.wait_s == pytest.approx(want.wait_s, rel=1e-9, abs=1e-9)
        got.wait_s = want.wait_s
        assert got == want, turn


def test_the_trace_records_a_batch_per_turn_with_its_waits_and_first_marks():
    for tr in (Trace(), python_trace()):
        table: dict[int, NodeTurn] = {}
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


def test_the_c_trace_refuses_what_is_not_a_batch_of_messages():
    tr, table = Trace(), {}
    with pytest.raises(IndexError):
        tr.received(table, [], [], 1.0)
    with pytest.raises(TypeError, match="expected a Message, got str"):
        tr.emitted(table, ["text"], 1.0)
    with pytest.raises(ValueError, match="one put time per message"):
        tr.received(table, [TextDelta(text="a")], [], 1.0)
    assert table == {}


def test_an_error_in_mark_reaches_the_caller():
    class Broken(TextDelta):
        __slots__ = ()

        def mark(self) -> str:
            raise RuntimeError("no mark")

    with pytest.raises(RuntimeError, match="no mark"):
        Trace().emitted({}, [Broken(text="a")], 1.0)


def test_threads_tracing_at_once_keep_their_own_records():
    """Every node thread calls the C trace; its cache of message types is shared by them."""
    import random
    import threading

    def work(seed: int, out: list) -> None:
        rnd = random.Random(seed)
        c, py, tables = Trace(), python_trace(), ({}, {})
        for _ in range(300):
            batch = [message(rnd.randrange(7), rnd.randrange(3), rnd.random()) for _ in range(rnd.randrange(1, 9))]
            times = [m.t for m in batch]
            for tr, table in zip((c, py), tables, strict=True):
                tr.received(table, batch, times, 5.0)
                tr.emitted(table, batch, 6.0)
        out.append(all(tables[0][t].n_in == r.n_in and tables[0][t].marks == r.marks for t, r in tables[1].items()))

    results: list = []
    threads = [threading.Thread(target=work, args=(seed, results)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 6


def test_a_message_is_asked_its_milestone_once_and_keeps_the_answer_out_of_sight():
    """The C trace keeps what mark() said on the message (mark() depends only on its fields)."""
    import copy
    import dataclasses
    import pickle

    asked: list = []

    class Counted(TextDelta):
        __slots__ = ()

        def mark(self) -> str:
            asked.append(self.text)
            return "token"

    msg = Counted(turn=1, text="a")
    tr = Trace()
    for node in ("llm", "tts", "sink"):
        tr.received(tr.node(node), [msg], [0.0], 1.0)
        tr.emitted(tr.node(node), [msg], 2.0)
    assert asked == ["a"] and tr.node("sink")[1].marks == {"in:token": 1.0, "out:token": msg.t}
    twin = Counted(turn=1, text="a", t=msg.t)  # never asked
    assert msg == twin and repr(msg) == repr(twin) and hash(msg) == hash(twin)
    real = TextDelta(turn=2, text="b", sentence_end=True)
    tr.emitted(tr.node("llm"), [real], 3.0)  # now it holds "sentence"
    for other in (copy.copy(real), copy.deepcopy(real), dataclasses.replace(real), pickle.loads(pickle.dumps(real)),
                  dataclasses.replace(real, sentence_end=False)):
        assert (other == real) is other.sentence_end
        tr.received(tr.node("other"), [other], [0.0], 4.0)
    assert tr.node("other")[2].marks_in == {"sentence": 4.0, "token": 4.0}  # the changed copy was asked anew
