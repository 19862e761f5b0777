"""The host under a benchmark: how busy its cores were and how fast it ran meanwhile.

On a shared host the same vCPU runs 1.8-4x slower in some minutes than in others, so a latency is
compared with another only beside these figures::

    before = host_ticks(); ...; host_load(before, host_ticks())   # {"busy_pct": .., "stolen_pct": ..}
    with HostSpeed() as speed: ...; loop_figures(speed.samples)    # {"loop_ms": .., ...}
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

__all__ = ["HostSpeed", "host_load", "host_ticks", "loop_figures"]


def host_ticks() -> list[int]:
    """This machine's CPU ticks so far, all cores (/proc/stat: user, nice, system, idle, iowait, irq,
    softirq, steal, ...); [] where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def host_load(before: list[int], after: list[int]) -> dict[str, float]:
    """Between two :func:`host_ticks`: how busy the cores were and how much of their time the
    hypervisor gave to other machines (steal), in %; {} without /proc/stat."""
    if len(before) < 8 or len(after) < 8:
        return {}
    d = [b - a for a, b in zip(before[:8], after[:8], strict=True)]
    total = sum(d) or 1
    return {"busy_pct": round(100 * (total - d[3] - d[4] - d[7]) / total, 1),
            "stolen_pct": round(100 * d[7] / total, 1)}


#: the host's speed, in a process of its own: the thread CPU time of a fixed Python loop every
#: ``interval`` s (CPU time: a wait for a core busy with the server is not counted, a core running
#: slower is); 17-80 ms of CPU every 2 s on AMD EPYC family 25 model 1 (at most 4 % of a core)
_PROBE = """
import sys, time
while True:
    c = time.thread_time()
    s = 0
    for i in range(300_000):
        s += i * i
    print(round(1000 * (time.thread_time() - c), 1), flush=True)
    time.sleep(float(sys.argv[1]))
"""


class HostSpeed:
    """The host's own speed while a benchmark runs. On a shared host the same vCPU runs a fixed loop
    1.8-4x slower in some minutes than in others (AMD EPYC family 25 model 1, an idle machine: 16.8
    ms in one minute, 29.4 and 37-84 ms in later ones), and the hypervisor's steal time does not show
    it (0 %): a neighbour on the same physical core or memory, most likely. A latency taken in a slow
    minute is compared with one taken in a fast minute only beside these figures.
    ``with HostSpeed() as host: ...; loop_figures(host.samples)``."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []

    def __enter__(self) -> HostSpeed:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(self.interval_s)],
                                      stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        self.samples = [float(x) for x in out.split()]


def loop_figures(samples: list[float]) -> dict[str, float]:
    """:class:`HostSpeed` samples (of one block, or several pooled) as ``loop_ms``: the loop's median
    CPU ms, ``loop_ms_range``: its fastest and slowest, and ``probes``; {} if none."""
    if not samples:
        return {}
    return {"loop_ms": round(float(np.median(samples)), 1),
            "loop_ms_range": [min(samples), max(samples)], "probes": len(samples)}
