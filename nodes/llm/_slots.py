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
admit. More sessions than slots: the extra ones name none (the server places them, as before). A
server started as several replicas (``server.replicas``; s2s_flow.model_server.replicas_of): each
session keeps to the replica with the fewest sessions, and all its requests (the reply, the prompt
prepared after it, the end-of-turn scores) go to that replica's port.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from s2s_flow.model_server import replicas_of, slots_of
from s2s_flow.model_server_spec import on_port

__all__ = ["SessionSlot", "scorer_slot"]

_LOCK = threading.Lock()
_TAKEN: dict[tuple[str, int], set[int]] = {}


def _server(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class SessionSlot:
    """One session's slot on the server at ``base_url``, or None (``id``) when it has none to take;
    on a server of several replicas, on the one with the fewest sessions (``port``)."""

    def __init__(self, base_url: str) -> None:
        self.server = _server(base_url)
        self.port = self.server[1]
        self.id: int | None = None

    def take(self) -> int | None:
        if self.id is not None:
            return self.id
        host, first = self.server
        with _LOCK:
            best: tuple[int, int, int] | None = None  # (sessions on it, port, its lowest free slot)
            for port in replicas_of(host, first):
                slots = slots_of(host, port)
                if slots is None:
                    continue
                taken = _TAKEN.setdefault((host, port), set())
                free = [k for k in range(max(1, slots - 1)) if k not in taken]
                if free and (best is None or len(taken) < best[0]):
                    best = (len(taken), port, free[0])
            if best is not None:
                _, self.port, self.id = best
                _TAKEN[(host, self.port)].add(self.id)
        return self.id

    def url(self, base_url: str) -> str:
        """``base_url`` (the server's first replica) on the port of the replica this session keeps to."""
        return base_url if _server(base_url)[1] == self.port else on_port(base_url, self.port)

    def give_back(self) -> None:
        if self.id is None:
            return
        with _LOCK:
            _TAKEN.get((self.server[0], self.port), set()).discard(self.id)
        self.id, self.port = None, self.server[1]


def scorer_slot(base_url: str) -> int | None:
    """The slot the end-of-turn scores go to: the last of the server (replica) at ``base_url``
    (None: the server places them)."""
    slots = slots_of(*_server(base_url))
    return None if slots is None else slots - 1
