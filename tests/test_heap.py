"""io.small_heap (s2s_flow/heap.py): with it, large blocks a turn frees go back to the machine even
after glibc has seen a larger one freed (its threshold would have risen); without it they stay."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.managed import REPO

_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    from s2s_flow import heap
    if sys.argv[1] == "small":
        assert heap.small(), "glibc took the settings"
    def rss_mb():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096 / 2**20
    big = np.ones(8 << 20, np.uint8)  # a freed 8 MiB block: glibc's threshold rises to it by default
    del big
    before = rss_mb()
    blocks = [np.ones(1 << 20, np.uint8) for _ in range(64)]  # a busy turn: 64 MiB in 1 MiB blocks
    del blocks[:-1]  # all freed but the last (which would sit on top of the heap)
    print(round(rss_mb() - before, 1))
""")


def _kept_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_a_small_heap_gives_back_what_a_busy_turn_freed():
    assert _kept_mb("default") > 32, "glibc kept the freed blocks (the case io.small_heap is for)"
    assert _kept_mb("small") < 8, "with heap.small() all but the live block went back"


def test_the_realtime_server_keeps_a_small_heap_only_when_asked():  # it costs voice-to-voice time
    from nodes.io.realtime.nodes import RealtimeSource
    from s2s_flow.compose import compose

    cfg, _ = compose(["recipe=local_cpu", "io=realtime"])
    assert cfg.io.small_heap is False
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.small_heap=true"])
    assert RealtimeSource(small_heap=cfg.io.small_heap).small_heap is True
