"""The process's CPU time by stage (s2s_flow/cpu.py): a node's thread counted while it runs and once
it has ended, never twice, and the parts adding up to the process's CPU time."""

from __future__ import annotations

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
