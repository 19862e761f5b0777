"""bench_realtime.py --conversations records the host beside every N (benchmarks/_conversations.py):
its own speed while the N runs (HostSpeed: the CPU time of a fixed loop, in a process of its own) and
how busy the cores were and how much time the hypervisor stole (host_load, from /proc/stat).
Measured here on this machine's real counters."""

from __future__ import annotations

import os
import threading
import time

import pytest

from benchmarks._host import HostSpeed, host_load, host_ticks, loop_figures

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="/proc/stat is Linux's")


def test_a_core_kept_busy_shows_in_the_hosts_load() -> None:
    cores = os.cpu_count() or 1
    before = host_ticks()
    stop = time.monotonic() + 0.6

    def spin() -> None:
        while time.monotonic() < stop:
            pass

    spinner = threading.Thread(target=spin)  # one core of the machine's, busy for 0.6 s
    spinner.start()
    spinner.join()
    load = host_load(before, host_ticks())
    # one busy core of N is 100/N % of the machine; a stolen share or a coarse tick takes some of it
    assert 0.4 * 100 / cores < load["busy_pct"] <= 100, load
    assert 0 <= load["stolen_pct"] <= 100, load


def test_without_counters_the_load_is_not_made_up() -> None:
    assert host_load([], host_ticks()) == {}
    assert host_load(host_ticks(), []) == {}


def test_the_hosts_speed_is_sampled_while_the_block_runs() -> None:
    with HostSpeed(interval_s=0.1) as speed:
        time.sleep(1.5)  # the probe's interpreter starts, then a loop every 0.1 s
    figures = loop_figures(speed.samples)
    assert figures["probes"] >= 2, figures
    low, high = figures["loop_ms_range"]
    assert 0 < low <= figures["loop_ms"] <= high, figures
    assert loop_figures(HostSpeed().samples) == {}  # never run: nothing made up
