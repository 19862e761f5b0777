"""The shared models' scheduler (s2s_flow/inference.py): order, slots, promotion, shedding.

Threads wait for slots here as sessions' nodes do; each test holds the slots itself, queues work
behind them and lets go, so what it checks is the order work was granted in, never how long it took.
"""

from __future__ import annotations

import threading
import time

import pytest

from s2s_flow import inference
from s2s_flow.inference import Scheduler, Session, Shed


def queue_behind(sched: Scheduler, n_waiting: int, *, timeout: float = 10.0) -> None:
    """Return once ``n_waiting`` calls wait in ``sched``'s queue."""
    deadline = time.monotonic() + timeout
    while sum(sched.snapshot()["queued"].values()) < n_waiting:
        assert time.monotonic() < deadline, sched.snapshot()
        time.sleep(0.001)


class Requests:
    """Calls made from threads of their own; ``granted`` lists them in the order they got a slot."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.granted: list[str] = []
        self.shed: list[str] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def make(self, name: str, kind: str, **kw: object) -> None:
        def run() -> None:
            try:
                with self.sched.slot(kind, **kw) as ran_as, self._lock:  # type: ignore[arg-type]
                    self.granted.append(f"{name}:{ran_as}")
            except Shed:
                with self._lock:
                    self.shed.append(name)

        waiting = sum(self.sched.snapshot()["queued"].values())
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        queue_behind(self.sched, waiting + 1)  # queued in this order

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)
            assert not thread.is_alive()


def test_a_free_slot_is_taken_at_once_on_the_callers_thread() -> None:
    sched = Scheduler("free", slots=2)
    seen: list[str] = []
    with sched.slot("first") as kind:
        seen.append(threading.current_thread().name)
        assert kind == "first"
        assert sched.snapshot()["running"] == 1
        with sched.slot("partial"):  # a second slot: no queue either
            assert sched.snapshot()["running"] == 2
    assert seen == [threading.current_thread().name]
    snap = sched.snapshot()
    assert snap["running"] == 0 and snap["queued"] == dict.fromkeys(inference.KINDS, 0)
    assert snap["wait_s"]["first"] == 0.0 and snap["shed"] == dict.fromkeys(inference.KINDS, 0)


def test_work_is_served_by_kind_then_deadline_not_by_arrival() -> None:
    sched = Scheduler("order", slots=1, shed_after_s=60)
    requests = Requests(sched)
    with sched.slot("first"):  # the model is busy: everything below queues, in this order
        requests.make("partial", "partial")
        requests.make("spec", "speculative")
        requests.make("later-due-late", "later", deadline=time.monotonic() + 50)
        requests.make("later-due-soon", "later", deadline=time.monotonic() + 5)
        requests.make("first-a", "first")
        requests.make("first-b", "first")
        assert sched.snapshot()["queued"] == {"first": 2, "later": 2, "speculative": 1, "partial": 1}
    requests.join()
    assert requests.granted == ["first-a:first", "first-b:first", "later-due-soon:later",
                                "later-due-late:later", "spec:speculative", "partial:partial"]
    waits = sched.snapshot()["wait_s"]
    assert all(waits[kind] > 0 for kind in inference.KINDS), waits  # each of them waited in the queue


def test_n_slots_run_n_calls_at_once_and_queue_the_next() -> None:
    sched = Scheduler("slots", slots=2)
    inside, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with sched.slot("first"):
            inside.wait(10)
            release.wait(10)

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    for t in holders:
        t.start()
    inside.wait(10)  # both are in at once
    assert sched.snapshot()["running"] == 2
    requests = Requests(sched)
    requests.make("third", "first")
    assert requests.granted == []  # a third waits
    release.set()
    requests.join()
    assert requests.granted == ["third:first"]
    for t in holders:
        t.join(10)


def test_a_speculative_turn_confirmed_while_queued_is_promoted_ahead_of_later_work() -> None:
    sched = inference.scheduler("test-promotion", 1)
    sched.shed_after_s = 60
    session, other = Session("a"), Session("b")
    session.speculate(7)
    requests = Requests(sched)
    with sched.slot("first"):
        requests.make("b-later", "later", session=other, turn=3, deadline=time.monotonic() + 50)
        # a confirmed kind asked for a turn still speculative runs as speculative work
        requests.make("a-turn7", "first", session=session, turn=7)
        requests.make("a-turn7-later", "later", session=session, turn=7, deadline=time.monotonic() + 1)
        requests.make("a-turn7-decode", "speculative", session=session, turn=7)  # asked as speculative
        assert sched.snapshot()["queued"]["speculative"] == 3
        session.confirm(7)  # the VAD confirmed the turn: its queued work is promoted
        assert sched.snapshot()["queued"] == {"first": 2, "later": 2, "speculative": 0, "partial": 0}
    requests.join()
    assert requests.granted == ["a-turn7:first", "a-turn7-decode:first", "a-turn7-later:later", "b-later:later"]
    assert session.kind("first", 7) == "first"


def test_speculative_and_partial_work_is_shed_under_load_counted_and_the_caller_told() -> None:
    sched = Scheduler("shed", slots=1, shed_after_s=0.0)  # any wait at all counts as load here
    requests = Requests(sched)
    with sched.slot("first"):
        for kind in ("speculative", "partial"):
            with pytest.raises(Shed) as shed, sched.slot(kind):
                pytest.fail("shed work must not run")
            assert shed.value.kind == kind and shed.value.model == "shed"
        sched.shed_after_s = 60
        requests.make("confirmed", "first")  # confirmed work is never shed
    requests.join()
    assert requests.granted == ["confirmed:first"] and requests.shed == []
    snap = sched.snapshot()
    assert snap["shed"] == {"first": 0, "later": 0, "speculative": 1, "partial": 1}
    assert snap["queued"] == dict.fromkeys(inference.KINDS, 0) and snap["running"] == 0


def test_speculative_work_that_gets_a_slot_in_time_is_not_shed() -> None:
    sched = Scheduler("in-time", slots=1, shed_after_s=60)
    requests = Requests(sched)
    with sched.slot("first"):
        requests.make("spec", "speculative")
    requests.join()
    assert requests.granted == ["spec:speculative"] and sched.snapshot()["shed"]["speculative"] == 0


def test_snapshot_names_every_models_queue_in_one_shape() -> None:
    sched = inference.scheduler("test-snapshot", 3)
    assert inference.scheduler("test-snapshot", 3) is sched  # one per model name
    snap = inference.snapshot()["test-snapshot"]
    assert set(snap) == {"queued", "running", "wait_s", "shed"}
    for field in ("queued", "wait_s", "shed"):
        assert set(snap[field]) == set(inference.KINDS)
    assert snap["running"] == 0


def test_waiting_for_a_confirmation_ends_with_it_or_with_the_turns_withdrawal() -> None:
    session = Session()
    session.speculate(4)
    confirmed: list[bool] = []
    waiter = threading.Thread(target=lambda: confirmed.append(session.wait_confirmed(4, lambda: False)))
    waiter.start()
    session.confirm(4)
    waiter.join(10)
    assert confirmed == [True]
    session.speculate(5)
    assert session.wait_confirmed(5, cancelled=lambda: True) is False  # withdrawn: the work is dropped


def test_a_waiter_cancelled_by_a_barge_in_leaves_the_queue() -> None:
    sched = Scheduler("cancel", slots=1)
    barged = threading.Event()
    outcome: list[str] = []

    def wait() -> None:
        try:
            with sched.slot("first", cancelled=barged.is_set):
                outcome.append("ran")
        except inference.Cancelled:
            outcome.append("cancelled")

    with sched.slot("first"):
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        queue_behind(sched, 1)
        barged.set()
        waiter.join(10)
        assert outcome == ["cancelled"] and sched.snapshot()["queued"]["first"] == 0
