"""Every node's ``setup()`` at once, each on a daemon thread of its own, with a live progress line.

Not a pool: a pool is joined on the way out, so a setup stalled in a download or on a server
that never answers would hold the process after a signal. A daemon thread that never returns
is left behind, and the caller names its node (:func:`set_up_all` returns the names).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from s2s_flow.node import Node

__all__ = ["set_up_all"]


def set_up_all(nodes: Mapping[str, Node], *, stopping: threading.Event, progress: Mapping[str, str],
               returned: Callable[[str, BaseException | None, float], None], console: Any = None) -> list[str]:
    """Run every node's ``setup()`` in parallel until all have returned or ``stopping`` is set.

    ``returned(name, error, seconds)`` is called (on this thread) as each setup returns, ``error``
    None when it succeeded; ``progress`` holds what each slow setup says it is doing, for the
    status line. Returns the names whose ``setup()`` had not returned when the wait ended.
    """
    t0 = time.monotonic()
    finished: queue.SimpleQueue[tuple[str, BaseException | None]] = queue.SimpleQueue()

    def setup(name: str, node: Node) -> None:
        try:
            node.setup()
        except BaseException as exc:
            finished.put((name, exc))
        else:
            finished.put((name, None))

    def done(name: str, exc: BaseException | None) -> None:
        pending.remove(name)
        returned(name, exc, time.monotonic() - t0)

    pending = list(nodes)
    for name, node in nodes.items():
        threading.Thread(target=setup, args=(name, node), name=f"setup:{name}", daemon=True).start()
    status = console.status("setting up") if console is not None else None
    if status is not None:
        status.start()
    try:
        while pending and not stopping.is_set():
            with contextlib.suppress(queue.Empty):
                done(*finished.get(timeout=0.05))
            if status is not None:
                waiting = ", ".join(f"{n}: {progress.get(n, 'loading')}" for n in pending)
                status.update(f"setting up ({time.monotonic() - t0:.1f}s) {waiting}")
    finally:
        if status is not None:
            status.stop()
        while not finished.empty():  # setups that returned as the run stopped
            done(*finished.get_nowait())
    return pending
