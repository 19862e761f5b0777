"""A Realtime server of its own for a test: the real graph (recipe=local_cpu) against an LLM URL.

    with serving(llama_url, tmp_path, "llm.max_tokens=32") as (url, server):   # url: ws://host:port/v1
        ...

and the bound on reply audio read back by Whisper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from s2s_flow.cli import plan
from s2s_flow.compose import compose

__all__ = ["serving", "SERVER_ARGS", "READ_BACK"]

#: Every test server's arguments before its own (which come later and win). Admitted by count only:
#: these sessions test the protocol on a machine others load too (admission by load:
#: tests/test_realtime_admission.py). Greedy replies: the recipe samples (temperature 0.2, no seed), and
#: a sampled answer to "Tell me a long story..." once came out 9 tokens long, done before a test could
#: interrupt it.
SERVER_ARGS = ("recipe=local_cpu", "server=null", "io=realtime", "io.port=0", "io.target_ms=null",
               "llm.temperature=0", "llm.seed=1")

#: Reply audio read back by Whisper: the share of the reply's words it hears, at 8 kHz G.711: 0.83-1.0 in
#: most runs, once 0.64 (0.73 with units in full): "A marathon is a 26.112 kilometers." heard as "and
#: Marathon is 26.11 km.", a short reply where each lost word costs 9 %. Not WER: tiny.en loops on a reply
#: that repeats itself, and the loop's words count as insertions (WER 2.0 on one SmolLM2 reply that said
#: "the city of the gods" over and over). Audio that is not the reply recovers few of its words.
READ_BACK = 0.6


@contextlib.contextmanager
def serving(base_url: str, tmp_path: Path, *extra: str) -> Iterator[tuple[str, Any]]:
    """(ws://host:port/v1, the RealtimeServer), on a free port, stopped afterwards."""
    from nodes.io.realtime.server import RealtimeServer

    cfg, choices = compose([*SERVER_ARGS, f"llm.base_url={base_url}", *extra])
    server = RealtimeServer(lambda: plan(cfg, choices), plan(cfg, choices).nodes["source"].node, tmp_path)
    url = server.start()
    try:
        yield url, server
    finally:
        server.stop()
