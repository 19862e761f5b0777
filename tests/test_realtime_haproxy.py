"""Scale out: HAProxy (deploy/haproxy.cfg, as shipped) in front of two real ``s2s-run io=realtime``
processes on loopback that share one llama-server with parallel slots. Six sessions spread over
both; one process drained mid-reply (SIGTERM) finishes its live reply while new sessions go to the
other; one killed (SIGKILL) closes its clients, who reconnect through HAProxy to the other, whose own
sessions lose nothing."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.realtime_process import REPO, free_port, realtime_process
from tests.support.servers import running_llama_server
from tests.test_realtime import _next, appends, spoken, until

websockets = pytest.importorskip("websockets")
HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="no haproxy: apt-get install haproxy (scripts/bootstrap.sh)")

QUESTION = "What is the capital of France?"


@contextlib.contextmanager
def haproxy(backends: list[int], tmp_path) -> Iterator[tuple[str, str]]:
    """deploy/haproxy.cfg with its addresses from the environment: (ws://.../v1, the stats CSV URL)."""
    front, stats = free_port(), free_port()
    env = {**os.environ, "S2S_LB_BIND": f"127.0.0.1:{front}", "S2S_LB_STATS": f"127.0.0.1:{stats}",
           "S2S_BACKEND_1": f"127.0.0.1:{backends[0]}", "S2S_BACKEND_2": f"127.0.0.1:{backends[1]}"}
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(REPO / "deploy" / "haproxy.cfg")], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"ws://127.0.0.1:{front}/v1", f"http://127.0.0.1:{stats}/stats;csv"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def states(stats_url: str) -> dict[str, str]:
    """HAProxy's view of its servers: {s1: UP|DOWN|..., s2: ...}."""
    try:
        with urllib.request.urlopen(stats_url, timeout=5) as reply:
            text = reply.read().decode().lstrip("# ")
    except OSError:
        return {}
    return {row["svname"]: row["status"].split()[0] for row in csv.DictReader(io.StringIO(text))
            if row["pxname"] == "s2s" and row["svname"] in ("s1", "s2")}


def connect(stack: contextlib.ExitStack, url: str) -> Any:
    """A session through the balancer, closed with ``stack``."""
    from websockets.sync.client import connect as ws_connect

    ws = stack.enter_context(ws_connect(f"{url}/realtime", open_timeout=30))
    assert _next(ws)["type"] == "session.created"
    return ws


def speak(ws: Any, text: str = QUESTION) -> None:
    for chunk in appends(spoken(text)):
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))


def reply(ws: Any) -> dict:
    """The next response.done: completed, with words."""
    done = _next(ws, "response.done")["response"]
    assert done["status"] == "completed", done
    assert any(c.get("transcript") for c in done["output"][0]["content"]), done
    return done


def sessions(process: Any) -> int:
    with urllib.request.urlopen(process.http + "/healthz", timeout=10) as answer:
        return json.loads(answer.read())["sessions"]


def test_two_processes_behind_haproxy_spread_drain_and_survive_a_kill(tmp_path, llama_server_binary, smollm2_gguf):
    ports = [free_port(), free_port()]
    with running_llama_server(smollm2_gguf, binary=llama_server_binary,
                              extra_args=("--jinja", "--parallel", "4", "--ctx-size", "4096")) as llm:
        common = ("server=null", f"llm.base_url={llm}", "llm.max_tokens=24", "io.drain_timeout_s=300",
                  "io.target_ms=null")  # admitted by count: the balancer's spread is what is tested
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(realtime_process(tmp_path / "a", *common, port=ports[0]))
            b = stack.enter_context(realtime_process(tmp_path / "b", *common, port=ports[1]))
            url, stats = stack.enter_context(haproxy(ports, tmp_path))
            until(lambda: (a.ready(), b.ready()) == (200, 200), timeout=120,
                  what=lambda: f"both processes ready: /readyz {a.ready()}, {b.ready()}")
            until(lambda: states(stats) == {"s1": "UP", "s2": "UP"}, timeout=60,
                  what=lambda: f"HAProxy to see both up: it sees {states(stats)}; its log: "
                               f"{(tmp_path / 'haproxy.log').read_text(errors='replace')[-2000:]}")

            # six sessions, spread by least connections
            clients = [connect(stack, url) for _ in range(6)]
            assert (sessions(a), sessions(b)) == (3, 3)

            # drain a mid-reply: its live reply finishes, new sessions go to b
            on_a = clients[0::2]  # leastconn alternates: 0, 2, 4 on the first server
            speak(on_a[0])
            _next(on_a[0], "response.created")
            a.proc.send_signal(signal.SIGTERM)
            until(lambda: states(stats).get("s1") not in (None, "UP"), timeout=60, what="haproxy to take a out")
            late = [connect(stack, url) for _ in range(2)]
            assert sessions(b) == 5, "new sessions went to the other process"
            reply(on_a[0])
            for ws in on_a:
                ws.close()
            assert a.proc.wait(120) == 0, a.output()[-2000:]

            # a comes back; b is killed mid-reply: its clients are closed and reconnect to a
            a2 = stack.enter_context(realtime_process(tmp_path / "a2", *common, port=ports[0]))
            until(lambda: states(stats).get("s1") == "UP", timeout=60, what="haproxy to take a back")
            on_a2 = [connect(stack, url) for _ in range(2)]
            assert sessions(a2) == 2
            on_b = [clients[1], clients[3], clients[5], *late]
            speak(on_a2[0])
            speak(on_b[0])
            _next(on_a2[0], "response.created")
            _next(on_b[0], "response.created")
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait(30)
            for ws in on_b:
                with pytest.raises(websockets.exceptions.ConnectionClosed):
                    while True:
                        ws.recv(timeout=60)
            back = [connect(stack, url) for _ in on_b]  # before haproxy's check notices
            assert sessions(a2) == 2 + len(back), "every client of b reconnected to a"
            reply(on_a2[0])  # a's own sessions lost nothing: the reply in flight completes
            speak(on_a2[1])
            speak(back[0])
            reply(on_a2[1])
            reply(back[0])
            assert a2.proc.poll() is None
