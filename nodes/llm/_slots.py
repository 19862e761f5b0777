"""A slot of the model server for each session: llama-server's ``id_slot``.

llama-server keeps each slot's last prompt in its KV cache and sends a request that names no slot
to the idle one whose cached prompt shares most with it. Sessions share their system prompt, so a
new session's first request often lands on an idle slot that holds another live conversation, which
must then read its whole history again, or get it back from llama-server's RAM prompt cache, which
keeps every conversation it has served (~5 MB each with SmolLM2, up to 8 GiB). With that cache off
and no slot of their own, 8 conversations at once cost llama-server 1.54 s of CPU a turn instead of
0.92 (benchmarks/bench_realtime.py --conversations). When this process started the server
(``server.slots``; s2s_flow.model_server.slots_of) no other process sends it requests, so each session
takes a slot of its own for its life and names it in every request; the recipes turn the RAM cache
off (``--cache-ram 0``).

Sessions take the lowest free slot; the highest is left for the end-of-turn scorer's short requests
(``vad.turn=text|hybrid``): the recipes start llama-server with one slot more than the sessions they
admit. More sessions than slots: the extra ones name none (the server places them, as before).
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from s2s_flow.model_server import slots_of

__all__ = ["SessionSlot", "scorer_slot"]

_LOCK = threading.Lock()
_TAKEN: dict[tuple[str, int], set[int]] = {}


def _server(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class SessionSlot:
    """One session's slot on the server at ``base_url``, or None (``id``) when it has none to take."""

    def __init__(self, base_url: str) -> None:
        self.server = _server(base_url)
        self.id: int | None = None

    def take(self) -> int | None:
        slots = slots_of(*self.server)
        if slots is None or self.id is not None:
            return self.id
        with _LOCK:
            taken = _TAKEN.setdefault(self.server, set())
            free = [k for k in range(max(1, slots - 1)) if k not in taken]
            if free:
                self.id = free[0]
                taken.add(self.id)
        return self.id

    def give_back(self) -> None:
        if self.id is None:
            return
        with _LOCK:
            _TAKEN.get(self.server, set()).discard(self.id)
        self.id = None


def scorer_slot(base_url: str) -> int | None:
    """The slot the end-of-turn scores go to: the server's last (None: the server places them)."""
    slots = slots_of(*_server(base_url))
    return None if slots is None else slots - 1
