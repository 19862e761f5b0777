"""llama-server as several replicas (``server.replicas``): recipe=local_cpu serving many sessions starts
two copies, each on half the cores and its own port, and shares the sessions out between them; each
session's requests (its replies, the prompt prepared after a reply, its end-of-turn scores) go to its
own replica; a copy that dies is restarted on its own while the other serves on; both are stopped at
the end. Real llama-server, real SmolLM2."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import threading
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

from nodes.llm._slots import SessionSlot, scorer_slot
from nodes.llm.chat import ChatCompletionsLLM
from s2s_flow.compose import compose
from s2s_flow.errors import ConfigError
from s2s_flow.model_server import ServerError, managed_server
from s2s_flow.model_server_spec import ServerSpec, on_port
from s2s_flow.server_watch import running
from tests.support.managed import processes_with, wait_until
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.servers import answers

GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 16}


def _free_pair() -> int:
    """A port whose next one is free too (the second replica's)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]
    raise RuntimeError("no two free ports in a row")


def _generated(port: int) -> int:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("llamacpp:tokens_predicted_total"))))


def test_many_sessions_get_two_replicas_on_half_the_cores_each_and_few_one():
    cores = len(os.sched_getaffinity(0))
    cfg, _ = compose(["recipe=local_cpu"])
    assert ServerSpec.from_config(cfg.server).replicas == 1
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=3"])
    assert ServerSpec.from_config(cfg.server).replicas == 1
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=8"])
    spec = ServerSpec.from_config(cfg.server)
    assert spec.replicas == (2 if cores >= 2 else 1)
    argv = spec.argv(lambda: "llama-server")
    slots = -(-8 // spec.replicas) + 1  # the sessions shared out, and each copy's slot for the scorer
    assert (argv[argv.index("-np") + 1], argv[argv.index("-c") + 1]) == (str(slots), str(1536 * slots))
    assert spec.slots == slots and spec.env["LLAMA_ARG_THREADS"] == str(max(1, cores // 2))


def test_replicas_need_a_port_each(tmp_path):
    base = {"ready_url": "http://127.0.0.1:8091/health", "replicas": 2}
    with pytest.raises(ConfigError, match=r"names no \{port\}.*--port \{port\}"):
        ServerSpec.from_config(OmegaConf.create({**base, "command": ["llama-server", "--port", "8091"]}))
    for bad in (0, "two", True):
        with pytest.raises(ConfigError, match="server.replicas"):
            ServerSpec.from_config(OmegaConf.create({**base, "replicas": bad, "command": ["x", "{port}"]}))
    spec = ServerSpec.from_config(OmegaConf.create({**base, "command": ["x", "--port", "{port}"]}))
    second = spec.replica(1)
    assert (second.port, second.log, second.argv(str)[-1]) == (8092, "server-1.log", "8092")
    assert spec.ports == [8091, 8092]
    assert on_port("http://[::1]:8091/v1/models", 8092) == "http://[::1]:8092/v1/models"


def test_each_session_keeps_to_the_replica_with_the_fewest_sessions():
    running("127.0.0.1", [9501, 9502], 3)  # two copies, 2 session slots and the scorer's each
    try:
        taken = [SessionSlot("http://127.0.0.1:9501/v1") for _ in range(5)]
        assert [(s.take(), s.port) for s in taken] == [(0, 9501), (0, 9502), (1, 9501), (1, 9502), (None, 9501)]
        assert taken[1].url("http://127.0.0.1:9501/v1") == "http://127.0.0.1:9502/v1"
        assert taken[0].url("http://127.0.0.1:9501/v1") == "http://127.0.0.1:9501/v1"
        assert scorer_slot(taken[1].url("http://127.0.0.1:9501")) == 2
        taken[1].give_back()
        again = SessionSlot("http://127.0.0.1:9501/v1")
        assert (again.take(), again.port) == (0, 9502)  # the freed place, on the copy with fewer
        for slot in [again, *taken]:
            slot.give_back()
    finally:
        running("127.0.0.1", [9501, 9502], None)


def test_two_replicas_serve_their_own_sessions_and_one_that_dies_comes_back_alone(llama_server_binary,
                                                                                  smollm2_gguf, tmp_path: Path):
    port = _free_pair()
    root = f"http://127.0.0.1:{port}"
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=4", "server.replicas=2",
                      f"llm.base_url={root}/v1", "+server.env.LLAMA_ARG_ENDPOINT_METRICS=1",
                      "server.health_interval_s=0.2", "server.restart_backoff_s=0.2"])
    with managed_server(cfg.server, tmp_path) as handle:
        assert handle is not None and handle.started and len(handle.replicas) == 1
        second = handle.replicas[0]
        assert second.url == f"http://127.0.0.1:{port + 1}/v1/models" and second.pid != handle.pid
        for p in (port, port + 1):  # each copy: the slots of half the sessions and the scorer's
            assert len(httpx.get(f"http://127.0.0.1:{p}/slots", timeout=5, trust_env=False).json()) == 3
        a = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "a", **GREEDY)
        b = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "b", **GREEDY)
        assert (a.client.base_url, b.client.base_url) == (f"{root}/v1", f"http://127.0.0.1:{port + 1}/v1")
        assert b._preparer.base_url == b.client.base_url and b._scorer.client.base_url == f"http://127.0.0.1:{port + 1}"
        first_before, second_before = _generated(port), _generated(port + 1)
        assert text_of(turn(b, "Name a fruit.", 1)).strip()
        assert _generated(port) == first_before and _generated(port + 1) > second_before  # B's copy only

        died = second.pid
        os.kill(died, signal.SIGKILL)
        assert text_of(turn(a, "What is the capital of France?", 1)).strip()  # the other serves on
        assert wait_until(lambda: second.pid != died and answers(port + 1), 120)

        def recorded() -> tuple[int, int]:  # server.json is rewritten once the new copy is ready
            info = json.loads((tmp_path / "server.json").read_text())
            return info["pid"], info["replicas"][0]["pid"]
        assert wait_until(lambda: recorded() == (handle.pid, second.pid), 30), recorded()
        assert text_of(turn(b, "Name another fruit.", 2)).strip()  # B's copy is back
        a.close()
        b.close()
    assert "$ " in (tmp_path / "server-1.log").read_text()  # each copy logs apart
    assert not processes_with(f"--port\0{port}\0") and not processes_with(f"--port\0{port + 1}\0")


def test_a_second_copys_port_taken_by_another_server_is_refused_naming_the_count(llama_server_binary, smollm2_gguf,
                                                                                 tmp_path: Path):
    port = _free_pair()
    other = http.server.ThreadingHTTPServer(("127.0.0.1", port + 1), _NotFound)  # something else's port
    threading.Thread(target=other.serve_forever, daemon=True).start()
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=4", "server.replicas=2",
                      f"llm.base_url=http://127.0.0.1:{port}/v1"])
    try:
        with pytest.raises(ServerError) as err, managed_server(cfg.server, tmp_path):
            pass
    finally:
        other.shutdown()
        other.server_close()
    said = str(err.value)
    assert f"127.0.0.1:{port + 1} is taken by something that is not the expected server" in said, said
    assert "copy 2 of server.replicas=2" in said and "server.replicas=1" in said and f"port {port + 1}" in said
    assert not answers(port), "the first copy, started before, is stopped again"


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass
