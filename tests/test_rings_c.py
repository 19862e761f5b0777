"""The C rings (s2s_flow/_rings.c) against the reference in rings.py, op by op.

test_rings.py runs every behaviour test on both; here random sequences of operations run on
both side by side and must give the same results, counters and errors. Plus what only the C
code can get wrong: references (nothing leaked, nothing freed early, cycles collected), the
paths taken for big batches, and refusals of the wrong arguments.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_flow import rings

pytestmark = pytest.mark.skipif(rings.native is None, reason="s2s_flow/_rings.c is not built "
                                "(test_rings.py::test_the_install_builds_the_c_rings says so)")

_, _, _, PyInbox, PyRing = rings.IMPLEMENTATIONS["python"]
C = rings.native

ring_specs = st.lists(st.tuples(st.integers(1, 8), st.sampled_from(rings.POLICIES)), min_size=1, max_size=3)
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("put_many"), st.integers(0, 2), st.lists(st.integers(0, 99), max_size=8)),
    st.tuples(st.just("get"), st.integers(0, 2)),
    st.tuples(st.just("flush"), st.integers(0, 2), st.one_of(st.none(), st.integers(0, 100))),
    st.tuples(st.just("close"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("control"), st.integers(0, 99)),
    st.tuples(st.just("wait"),),
), max_size=60)


def apply(inbox, ring_list, op):
    """One operation, as a comparable result; never one that would block this thread."""
    kind = op[0]
    ring = ring_list[op[1] % len(ring_list)] if len(op) > 1 and kind != "control" else None
    try:
        if kind == "put":
            if ring.policy == "block" and len(ring) >= ring.capacity and not ring.closed:
                return "would block"
            wakes: list = []
            return ring.put(op[2], wakes if op[3] else None), wakes
        if kind == "put_many":
            if ring.policy == "block" and len(ring) + len(op[2]) > ring.capacity and not ring.closed:
                return "would block"
            return ring.put_many(op[2], []), len(ring)
        if kind == "get":
            return ring.get(0)
        if kind == "flush":
            return ring.flush(None if op[2] is None else (lambda v, t=op[2]: v < t))
        if kind == "close":
            return ring.close(discard=op[2]), ring.closed, inbox.open
        if kind == "control":
            return inbox.post_control(op[1])
        control, data, done = inbox.wait(0)
        for _, items, times in data:
            assert len(times) == len(items) and times == sorted(times)
        return control, [(ring_list.index(r), items) for r, items, _ in data], done
    except (rings.RingClosed, TimeoutError) as exc:
        return type(exc).__name__, str(exc)


def state(ring_list):
    return [(len(r), r.closed, r.stats()) for r in ring_list]  # nothing here blocks: blocked_s is 0


def build(inbox_cls, ring_cls, specs):
    inbox = inbox_cls()
    return inbox, [ring_cls(cap, policy, inbox=inbox, name=f"r{i}") for i, (cap, policy) in enumerate(specs)]


@settings(max_examples=400, deadline=None)
@given(specs=ring_specs, fill=st.lists(st.lists(st.integers(0, 99), max_size=8), min_size=3, max_size=3),
       sequence=ops)
def test_the_c_rings_give_the_reference_results_op_by_op(specs, fill, sequence):
    c_inbox, c_rings = build(C.Inbox, C.Ring, specs)
    py_inbox, py_rings = build(PyInbox, PyRing, specs)
    start = [("put_many", i, items[:cap]) for i, ((cap, _), items) in enumerate(zip(specs, fill, strict=False))]
    for op in [*start, *sequence, ("wait",)]:  # the last wait shows what each ring still holds
        assert apply(c_inbox, c_rings, op) == apply(py_inbox, py_rings, op), op
        assert state(c_rings) == state(py_rings), op
        assert c_inbox.open == py_inbox.open


def test_put_times_are_time_monotonic_readings():
    import time

    ring = C.Ring(4)
    before = time.monotonic()
    ring.put("x")
    after = time.monotonic()
    (_, _, (put,)), = ring.inbox.wait(0)[1]
    assert before <= put <= after


class Item:
    """An item whose death can be watched."""


def test_items_are_neither_leaked_nor_freed_early():
    item = Item()
    base = sys.getrefcount(item)
    inbox = C.Inbox()
    a, b = C.Ring(3, "drop_oldest", inbox=inbox), C.Ring(2, "block", inbox=inbox)
    for _ in range(200):
        for _ in range(5):
            a.put(item)  # drops the oldest twice
        b.put_many([item, item], [])
        inbox.post_control(item)
        control, data, _ = inbox.wait(0)
        assert control == [item] and [len(items) for _, items, _ in data] == [3, 2]
        del control, data
        b.put(item)
        b.flush()
        a.put(item)
        a.flush(lambda x: x is item)
    assert sys.getrefcount(item) == base
    a.put(item)
    b.put(item)
    a.close(discard=True)
    b.close()
    del inbox, a, b
    gc.collect()
    assert sys.getrefcount(item) == base  # the queued items went with their rings


def test_a_ring_and_its_inbox_are_collected_with_what_they_hold():
    item = Item()
    watch = weakref.ref(item)
    inbox = C.Inbox()
    ring = C.Ring(4, inbox=inbox)  # ring -> inbox -> rings -> ring: a cycle
    ring.put(item)
    ring.dst_port = "in"  # the scheduler's note lives in the ring's __dict__
    del item, inbox, ring
    gc.collect()
    assert watch() is None  # only the ring held it: the cycle was collected


def test_big_batches_and_many_rings_come_out_whole_and_in_order():
    """More items and more rings than wait() keeps on its stack."""
    inbox = C.Inbox()
    many = [C.Ring(100, inbox=inbox, name=f"r{i}") for i in range(40)]
    for i, ring in enumerate(many):
        ring.put_many([(i, j) for j in range(i % 7)])
    for i in range(10):
        inbox.post_control(("control", i))
    control, data, done = inbox.wait(0)
    assert control == [("control", i) for i in range(10)] and not done
    assert [(many.index(r), items) for r, items, _ in data] == [
        (i, [(i, j) for j in range(i % 7)]) for i in range(40) if i % 7]
    assert all(len(times) == len(items) for _, items, times in data)


def test_a_ring_grows_to_its_capacity_and_wraps_around():
    ring = C.Ring(1000, "drop_oldest")
    for i in range(2500):
        ring.put(i)
    assert len(ring) == 1000 and ring.stats().drops == 1500
    assert [ring.get(0) for _ in range(10)] == list(range(1500, 1510))
    ring.put_many(list(range(2500, 2510)))
    assert [ring.get(0) for _ in range(len(ring))] == list(range(1510, 2510))


def test_wrong_arguments_are_refused_with_what_was_expected():
    with pytest.raises(TypeError, match="inbox must be an s2s_flow._rings.Inbox"):
        C.Ring(4, inbox=PyInbox())
    ring = C.Ring(4)
    with pytest.raises(TypeError, match="deferred must be a list or None"):
        ring.put(1, ())
    with pytest.raises(TypeError, match="put_many\\(\\) takes a sequence"):
        ring.put_many(5)
    with pytest.raises(TypeError):
        C.Inbox(1)
    with pytest.raises(AttributeError):
        ring.capacity = 5  # read-only, as the counters are
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        C.Ring(0, name="x")
    assert len(ring) == 0 and ring.puts == 0  # nothing half-done


def test_a_stale_check_that_raises_leaves_the_ring_as_it_was():
    ring = C.Ring(8)
    ring.put_many([1, 2, 3])

    def stale(x):
        if x == 2:
            raise RuntimeError("boom")
        return True

    with pytest.raises(RuntimeError, match="boom"):
        ring.flush(stale)
    assert [ring.get(0) for _ in range(3)] == [1, 2, 3] and ring.stats().drops == 0
