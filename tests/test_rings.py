"""Bounded rings: order, capacity and each overflow policy, also under concurrency, and the
deferred wake-ups a hop hands over."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_flow import rings
from s2s_flow.rings import Inbox, Ring, RingClosed, wake_all
from tests.support.managed import wait_until


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
    assert wait_until(lambda: ring._room, 5, 0.001)  # the producer is waiting for room
    assert len(ring._room) == 1 and len(ring) == 1
    time.sleep(0.05)
    assert ring.get(1) == "a"
    t.join(1)
    assert ring.get(1) == "b"
    assert ring.stats().blocked_s >= 0.05  # at least the time it waited for room


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
    assert wait_until(lambda: ring._room, 5, 0.001)  # the producer is blocked, waiting for room
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


def test_block_wakes_the_given_waiters_then_sleeps_until_released_or_timed_out():
    sleeper, me = rings.Waiter(), rings.Waiter()
    woke = threading.Event()

    def sleep() -> None:
        if rings.block(sleeper, [], 5.0):
            woke.set()

    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    wakes = [sleeper]
    assert rings.block(me, wakes, 0.05) is False  # nobody releases me: timed out
    assert wakes == [] and woke.wait(5)
    t.join(5)
    released = rings.Waiter()
    released.release()
    released.release()  # once only: a second release is a no-op
    assert rings.block(released, [], 5.0) is True


def test_a_deferred_wake_waits_for_the_putter_then_delivers():
    inbox = Inbox()
    ring = Ring(4, "block", inbox=inbox)
    got: list = []
    asleep = threading.Event()

    def consume() -> None:
        asleep.set()
        got.extend(m for _, items, _ in inbox.wait(5)[1] for m in items)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    asleep.wait(5)
    assert wait_until(lambda: inbox._waiter is not None, 5, 0.001)  # the consumer sleeps
    wakes: list = []
    ring.put("x", wakes)
    assert len(wakes) == 1 and inbox._waiter is None  # taken for later, not released
    t.join(0.1)
    assert t.is_alive() and got == []
    wake_all(wakes)
    t.join(5)
    assert got == ["x"] and wakes == []


def test_deferred_wakes_are_done_before_the_putter_blocks_for_room():
    """Otherwise a producer blocked on a full ring could keep another consumer asleep forever."""
    first, full = Inbox(), Inbox()
    a, b = Ring(4, "block", inbox=first), Ring(1, "block", inbox=full)
    b.put("old")
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(m for _, i, _ in first.wait(60)[1] for m in i), daemon=True)
    consumer.start()
    assert wait_until(lambda: first._waiter is not None, 5, 0.001)

    def produce() -> None:
        wakes: list = []
        a.put("x", wakes)  # deferred
        b.put("y", wakes)  # blocks: the deferred wake must go out first

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    consumer.join(5)
    assert got == ["x"]
    assert b.get(1) == "old"
    producer.join(5)
    assert not producer.is_alive() and b.get(1) == "y"


def test_block_wakes_many_waiters_and_refuses_anything_else():
    waiters = [rings.Waiter() for _ in range(20)]
    woken = []
    threads = [threading.Thread(target=lambda w=w: woken.append(rings.block(w, [], 5.0)), daemon=True)
               for w in waiters]
    for t in threads:
        t.start()
    rings.block(rings.Waiter(), list(waiters), 0.01)
    for t in threads:
        t.join(5)
    assert woken == [True] * 20
    with pytest.raises((TypeError, AttributeError)):
        rings.block(rings.Waiter(), [object()], 0.01)


def test_wake_now_wakes_the_given_waiters_and_refuses_anything_else():
    sleepers = [rings.Waiter() for _ in range(3)]
    woken: list = []
    threads = [threading.Thread(target=lambda w=w: woken.append(rings.block(w, [], 5.0)), daemon=True)
               for w in sleepers]
    for t in threads:
        t.start()
    wakes = list(sleepers)
    rings.wake_now(wakes)
    assert wakes == []
    for t in threads:
        t.join(5)
    assert woken == [True] * 3
    rings.wake_now([])  # nothing to do
    sleeper = rings.Waiter()
    bad = [sleeper, object()]
    with pytest.raises((TypeError, AttributeError)):
        rings.wake_now(bad)
    rings.wake_now([sleeper])  # whatever the refusal left, the waiter can still be woken
    assert rings.block(sleeper, [], 0.0) is True


def test_a_put_blocked_for_room_lands_in_the_ring_a_flush_left_behind():
    """flush() replaces the ring's storage while a producer waits for room: its item must go
    into the new storage, not the old one that nobody reads any more."""
    ring = Ring(1, "block")
    ring.put("old")
    producer = threading.Thread(target=ring.put, args=("new",), daemon=True)
    producer.start()
    assert wait_until(lambda: ring._room, 5, 0.001)  # blocked for room
    assert ring.flush() == 1
    producer.join(5)
    assert not producer.is_alive() and len(ring) == 1 and ring.get(1) == "new"


def test_block_refuses_a_bad_list_without_losing_the_waiters_in_it():
    sleeper = rings.Waiter()
    wakes = [sleeper, object()]
    with pytest.raises((TypeError, AttributeError)):
        rings.block(rings.Waiter(), wakes, 0.01)
    if wakes:  # what the refusal left: the sleeper can still be woken
        wakes.pop()
        rings.block(rings.Waiter(), wakes, 0.01)
    assert rings.block(sleeper, [], 0.0) is True


def test_a_signal_interrupts_a_blocked_wait_on_the_main_thread():
    """Ctrl-C reaches a tool blocked in Ring.get(): the handler runs, the wait does not go on."""
    import signal

    ring = Ring(1)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    closer = threading.Timer(10, ring.close)
    closer.start()
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            ring.get()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        closer.cancel()
    assert time.monotonic() - t0 < 5  # not the 10 s until close()


def test_a_signal_does_not_cut_a_timed_wait_short():
    import signal

    ring = Ring(1)
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(TimeoutError):
            ring.get(0.3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 >= 0.29
