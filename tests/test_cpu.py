"""The process's CPU time by stage (s2s_flow/cpu.py): a node's thread counted while it runs and once
it has ended, never twice, and the parts adding up to the process's CPU time."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest

from s2s_flow import cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="running threads are read from /proc")

BURN_S = 0.3
TICK_S = 0.05  # /proc counts in clock ticks (10 ms): a few of them either way


def test_a_node_thread_is_counted_while_it_runs_and_once_after_it_ends():
    burned, go = threading.Event(), threading.Event()

    def node() -> None:
        while time.thread_time() < BURN_S:  # CPU time, not wall time: the same on a busy machine
            pass
        burned.set()
        go.wait(30)  # asleep: no more CPU
        cpu.thread_ended("spin")  # what the scheduler's node thread does as it ends

    before = cpu.by_stage().get("spin", 0.0)
    thread = threading.Thread(target=node, name="node:spin")
    thread.start()
    try:
        assert burned.wait(30)
        running = cpu.by_stage()["spin"] - before
    finally:
        go.set()
        thread.join(30)
    ended = cpu.by_stage()["spin"] - before
    assert BURN_S - TICK_S <= running <= BURN_S + TICK_S, running
    assert BURN_S - TICK_S <= ended <= BURN_S + TICK_S, f"counted once when it ended: {ended} (running: {running})"


def test_the_stages_add_up_to_the_process_cpu_time():
    stages = cpu.by_stage()
    total = time.process_time()
    assert {"native", "other"} <= set(stages)
    assert all(seconds >= 0 for seconds in stages.values()), stages
    assert abs(sum(stages.values()) - total) <= TICK_S + 0.02 * total, (stages, total)


def test_threads_that_end_while_the_stages_are_read_are_never_lost_nor_counted_twice():
    # a server's sessions end many threads at once, while /metrics may be read
    go, spent = threading.Event(), []

    def node() -> None:
        go.wait(30)
        while time.thread_time() < 0.02:
            pass
        spent.append(time.thread_time())
        cpu.thread_ended("churn")

    before = cpu.by_stage().get("churn", 0.0)
    threads = [threading.Thread(target=node, name="node:churn") for _ in range(24)]
    for thread in threads:
        thread.start()
    go.set()
    seen = []
    while any(thread.is_alive() for thread in threads):
        seen.append(cpu.by_stage().get("churn", 0.0) - before)
    seen.append(cpu.by_stage()["churn"] - before)
    assert all(b >= a - 1e-6 for a, b in itertools.pairwise(seen)), f"a reading went down: {seen}"
    # each thread's 20 ms once (what it spent after its own reading, waiting for the lock, is ~0.1 ms)
    assert abs(seen[-1] - sum(spent)) < 0.005, (seen[-1], sum(spent))
