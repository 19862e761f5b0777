"""io.small_heap (s2s_flow/heap.py): with it, large blocks a turn frees go back to the machine even
after glibc has seen a larger one freed (its threshold would have risen); without it they stay.
Driven through the realtime source's ``serve()``, in a fresh process each, as s2s-run serves: only
the server loop is replaced, by the allocations of a busy turn."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.managed import REPO

_PROBE = textwrap.dedent("""
    import sys
    import types
    import numpy as np
    from nodes.io.realtime.nodes import RealtimeSource

    def rss_mb():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096 / 2**20

    def busy_turn():
        big = np.ones(8 << 20, np.uint8)  # a freed 8 MiB block: glibc's threshold rises to it by default
        del big
        before = rss_mb()
        blocks = [np.ones(1 << 20, np.uint8) for _ in range(64)]  # 64 MiB in 1 MiB blocks
        del blocks[:-1]  # all freed but the last (which would sit on top of the heap)
        return {"kept_mb": round(rss_mb() - before, 1)}

    source = RealtimeSource(small_heap=sys.argv[1] == "true")
    source.server = lambda make_graph, run_dir, **options: types.SimpleNamespace(run=busy_turn)
    print(source.serve(None, None)["kept_mb"])
""")


def _kept_mb(small_heap: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, small_heap], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_a_server_with_a_small_heap_gives_back_what_a_busy_turn_freed():
    assert _kept_mb("false") > 32, "glibc kept the freed blocks (the case io.small_heap is for)"
    assert _kept_mb("true") < 8, "with io.small_heap all but the live block went back"


def test_a_small_heap_is_asked_for_not_the_default():  # it costs one conversation voice-to-voice time
    from s2s_flow.compose import compose

    assert compose(["recipe=local_cpu", "io=realtime"])[0].io.small_heap is False
