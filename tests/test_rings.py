"""Bounded rings: order, capacity and each overflow policy, also under concurrency."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_flow.rings import Inbox, Ring, RingClosed


@given(items=st.lists(st.integers(), max_size=200), capacity=st.integers(1, 300))
def test_block_ring_keeps_fifo_order_within_capacity(items, capacity):
    ring = Ring(capacity, "block")
    for x in items[:capacity]:
        ring.put(x)
    assert [ring.get(0) for _ in items[:capacity]] == items[:capacity]


@given(items=st.lists(st.integers(), min_size=1, max_size=200), capacity=st.integers(1, 50))
def test_drop_oldest_keeps_the_newest_items(items, capacity):
    ring = Ring(capacity, "drop_oldest")
    for x in items:
        ring.put(x)
    kept = [ring.get(0) for _ in range(len(ring))]
    assert kept == items[-capacity:]
    assert ring.stats().drops == max(0, len(items) - capacity)
    assert ring.stats().high_water == min(len(items), capacity)


@given(items=st.lists(st.integers(), min_size=1, max_size=200), capacity=st.integers(1, 50))
def test_drop_newest_keeps_the_oldest_items(items, capacity):
    ring = Ring(capacity, "drop_newest")
    results = [ring.put(x) for x in items]
    assert [ring.get(0) for _ in range(len(ring))] == items[:capacity]
    assert results.count(False) == ring.stats().drops == max(0, len(items) - capacity)


@settings(deadline=None, max_examples=25)
@given(producers=st.integers(1, 4), per_producer=st.integers(1, 300), capacity=st.integers(1, 16))
def test_block_ring_loses_nothing_and_keeps_per_producer_order_under_concurrency(producers, per_producer,
                                                                                  capacity):
    ring = Ring(capacity, "block")
    max_len = []

    def produce(pid: int) -> None:
        for i in range(per_producer):
            ring.put((pid, i))
            max_len.append(len(ring))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    got = []
    for _ in range(producers * per_producer):
        got.append(ring.get(5))
    for t in threads:
        t.join(5)
    assert sorted(got) == sorted((p, i) for p in range(producers) for i in range(per_producer))
    for p in range(producers):
        assert [i for q, i in got if q == p] == list(range(per_producer))
    assert max(max_len) <= capacity and ring.stats().high_water <= capacity
    assert ring.stats().drops == 0


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 500), capacity=st.integers(1, 32))
def test_drop_oldest_never_blocks_a_producer_and_the_consumer_sees_increasing_items(n, capacity):
    ring = Ring(capacity, "drop_oldest")
    done = threading.Event()
    seen: list[int] = []

    def consume() -> None:
        while True:
            try:
                seen.append(ring.get(2))
            except (RingClosed, TimeoutError):
                done.set()
                return

    t = threading.Thread(target=consume)
    t.start()
    for i in range(n):
        ring.put(i)  # never waits
    ring.close()
    assert done.wait(5)
    t.join(1)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert seen[-1] == n - 1  # the freshest item always survives
    assert len(seen) + ring.stats().drops == n


def test_blocked_producer_counts_blocked_time_and_resumes_when_consumer_takes():
    ring = Ring(1, "block")
    ring.put("a")
    t = threading.Thread(target=ring.put, args=("b",))
    t.start()
    deadline = time.monotonic() + 5
    while not ring._blocked_waiters and time.monotonic() < deadline:  # the producer is waiting for room
        time.sleep(0.001)
    assert ring._blocked_waiters == 1 and len(ring) == 1
    assert ring.get(1) == "a"
    t.join(1)
    assert ring.get(1) == "b"
    assert ring.stats().blocked_s > 0


def test_close_wakes_a_blocked_producer_with_ring_closed():
    ring = Ring(1, "block")
    ring.put(1)
    errors = []

    def put() -> None:
        try:
            ring.put(2)
        except RingClosed as exc:
            errors.append(exc)

    t = threading.Thread(target=put)
    t.start()
    time.sleep(0.02)
    ring.close(discard=True)
    t.join(1)
    assert not t.is_alive() and errors


def test_closed_ring_is_drained_before_it_reports_closed():
    ring = Ring(4, "block")
    ring.put(1)
    ring.put(2)
    ring.close()
    assert [ring.get(0), ring.get(0)] == [1, 2]
    with pytest.raises(RingClosed):
        ring.get(0)


def test_flush_drops_only_stale_items_and_counts_them():
    ring = Ring(8, "block")
    for x in [1, 2, 3, 4]:
        ring.put(x)
    assert ring.flush(lambda x: x < 3) == 2
    assert [ring.get(0), ring.get(0)] == [3, 4]
    assert ring.stats().drops == 2


def test_inbox_wakes_on_any_input_and_delivers_control_even_when_data_is_full():
    inbox = Inbox()
    a, b = Ring(1, "block", inbox=inbox, name="a"), Ring(1, "block", inbox=inbox, name="b")
    a.put("x")
    inbox.post_control("interrupt")
    control, data, done = inbox.wait(1)
    assert control == ["interrupt"] and [m for _, items, _ in data for m in items] == ["x"] and not done
    threading.Timer(0.05, b.put, args=("y",)).start()
    control, data, done = inbox.wait(2)
    assert [m for _, items, _ in data for m in items] == ["y"]
    a.close()
    b.close()
    assert inbox.wait(1)[2] is True


def test_invalid_ring_settings_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="policy must be one of block, drop_oldest, drop_newest"):
        Ring(4, "lifo")
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Ring(0)
