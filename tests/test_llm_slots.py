"""The LLM server serves sessions in parallel: recipe=local_cpu with io=realtime starts llama-server
with a slot per session (continuous batching), so a second session's request streams while the
first session's reply is still being generated, where one slot makes it wait for that whole reply.
Real llama-server, real SmolLM2; the order of events is asserted, not their times."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from s2s_flow.compose import compose
from s2s_flow.model_server import managed_server
from s2s_flow.model_server_spec import ServerSpec
from tests.support.servers import free_port, running_llama_server

REPLY_TOKENS = 256  # long enough that the second request is sent while the first still streams


def _stream(base_url: str, name: str, events: list[str], lock: threading.Lock, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": REPLY_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=120, trust_env=False) as client, client.stream(
            "POST", f"{base_url}/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line and f"{name} first" not in events:
                with lock:
                    events.append(f"{name} first")
                started.set()
    with lock:
        events.append(f"{name} done")


def two_sessions(base_url: str) -> list[str]:
    """A's request streams; once its first token is in, B's is sent. The order their first tokens
    and their ends arrived in."""
    events: list[str] = []
    lock, a_started, b_started = threading.Lock(), threading.Event(), threading.Event()
    a = threading.Thread(target=_stream, args=(base_url, "A", events, lock, a_started))
    a.start()
    assert a_started.wait(120), "A never streamed"
    b = threading.Thread(target=_stream, args=(base_url, "B", events, lock, b_started))
    b.start()
    a.join(180)
    b.join(180)
    assert sorted(events) == ["A done", "A first", "B done", "B first"], events
    return events


def test_the_realtime_recipe_starts_llama_server_with_a_slot_per_session(llama_server_binary, smollm2_gguf,
                                                                          tmp_path: Path):
    port = free_port()
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=2", f"llm.base_url=http://127.0.0.1:{port}/v1"])
    argv = ServerSpec.from_config(cfg.server).argv(lambda: str(llama_server_binary))
    assert argv[argv.index("-np") + 1] == "3"  # two sessions and the text turn scorer
    with managed_server(cfg.server, tmp_path) as handle:
        assert handle is not None and handle.started
        slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=5, trust_env=False).json()
        assert len(slots) == 3 and {s["n_ctx"] for s in slots} == {1536}  # each keeps a one-session slot's context
        events = two_sessions(f"http://127.0.0.1:{port}/v1")
    # both in flight at once: B streamed before A's reply was done
    assert events.index("B first") < events.index("A done"), events


def test_with_one_slot_the_second_request_waits_for_the_whole_first_reply(llama_server_binary, smollm2_gguf):
    with running_llama_server(smollm2_gguf, binary=llama_server_binary) as root:  # --parallel 1
        events = two_sessions(root + "/v1")
    assert events.index("A done") < events.index("B first"), events


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
