"""SIGTERM to a real ``s2s-run recipe=local_cpu io=realtime``: it stops accepting (``/readyz`` 503, new
sessions closed with 1013), lets the live reply finish, stops its managed llama-server and exits 0;
a second SIGTERM ends it at once. The in-process parts of draining are in test_realtime_ops.py."""

from __future__ import annotations

import json
import signal
import socket

import pytest

from tests.support.realtime_process import free_port, get, realtime_process
from tests.test_realtime import _next, appends, llama, spoken, until  # noqa: F401

websockets = pytest.importorskip("websockets")


def _raw(url: str):
    from websockets.sync.client import connect

    return connect(f"{url}/realtime", open_timeout=30)


def _closed_code(ws) -> int | None:
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=60)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_drains_finishes_the_live_reply_stops_the_model_server_and_exits_0(
        tmp_path, llama_server_binary, smollm2_gguf):
    llm_port = free_port()  # the recipe's managed llama-server, on a port of its own
    with realtime_process(tmp_path, f"llm.base_url=http://127.0.0.1:{llm_port}/v1", "llm.max_tokens=32",
                          "io.drain_timeout_s=120") as served:
        assert get(served.http + "/readyz")[0] == 200 and _listening(llm_port)
        with _raw(served.url) as live:
            _next(live, "session.created")
            for chunk in appends(spoken("What is the capital of France?")):
                live.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            _next(live, "response.created")
            served.proc.send_signal(signal.SIGTERM)
            until(lambda: served.ready() == 503, what="readiness to say draining")
            assert get(served.http + "/readyz")[1]["status"] == "draining"
            assert get(served.http + "/healthz")[0] == 200, "alive while draining"
            with _raw(served.url) as late:
                assert _next(late)["error"]["code"] == "server_draining"
                assert _closed_code(late) == 1013
            done = _next(live, "response.done")
            assert done["response"]["status"] == "completed", "the live reply finished"
            transcript = [c.get("transcript") for c in done["response"]["output"][0]["content"]]
            assert any(transcript), done
        assert served.proc.wait(120) == 0, served.output()[-3000:]
        assert not _listening(llm_port), "the managed llama-server was stopped"


def test_a_second_sigterm_ends_the_drain_at_once(tmp_path, llama):  # noqa: F811
    with realtime_process(tmp_path, "server=null", f"llm.base_url={llama}", "io.drain_timeout_s=3600") as served, \
            _raw(served.url) as live:
        _next(live, "session.created")
        served.proc.send_signal(signal.SIGTERM)
        until(lambda: served.ready() == 503, what="the drain to begin")
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)  # not the hour of io.drain_timeout_s
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            while True:
                live.recv(timeout=60)
