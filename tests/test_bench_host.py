"""bench_realtime.py --conversations records the host beside every N (benchmarks/_conversations.py):
its speed just before (host_probe) and, during the N, how busy the cores were and how much time the
hypervisor stole (host_load, from /proc/stat). Measured here on this machine's real counters."""

from __future__ import annotations

import os
import threading
import time

import pytest

from benchmarks._conversations import host_load, host_probe, host_ticks

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


def test_the_probe_times_its_fixed_work() -> None:
    probe = host_probe()
    assert probe["loop_ms"] > 0 and probe["read_gb_s"] > 0, probe
