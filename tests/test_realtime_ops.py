"""io=realtime in operation: who may connect (Origin, Host), health and readiness, draining, and the
abuse a public server meets (a client that floods events, sends a 10 MB frame, a reconnect storm,
one address that takes many sessions), against the real offline stack. The signals themselves
(SIGTERM to a real ``s2s-run``) are in test_realtime_drain.py; the idle client and the one that
stops reading in test_realtime(_turns).py.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from nodes.io.realtime.guard import Guard
from tests.test_realtime import (
    _next,
    appends,
    llama,  # noqa: F401  (the module's llama-server fixture)
    serving,
    spoken,
    until,
)

websockets = pytest.importorskip("websockets")

QUESTION = "What is the capital of France?"


def _raw(url: str, *, host: str | None = None, **kwargs: Any):
    """A raw client; ``host``: reach the server's address under that name (what DNS rebinding does)."""
    from websockets.sync.client import connect

    if host is None:
        return connect(f"{url}/realtime", open_timeout=30, **kwargs)
    sock = socket.create_connection(("127.0.0.1", _port(url)))
    return connect(f"ws://{host}:{_port(url)}/v1/realtime", sock=sock, open_timeout=30, **kwargs)


def _http(url: str, path: str, **headers: str) -> tuple[int, dict]:
    base = url.replace("ws://", "http://").removesuffix("/v1")
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read() or b"{}")


def _http_text(url: str, path: str) -> str:
    with urllib.request.urlopen(url.replace("ws://", "http://").removesuffix("/v1") + path, timeout=30) as reply:
        return reply.read().decode()


def _speak(ws: Any, text: str) -> None:
    for chunk in appends(spoken(text)):
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))


def _closed_code(ws: Any) -> int | None:
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=60)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


def _port(url: str) -> int:
    return int(url.removeprefix("ws://").split("/")[0].rsplit(":", 1)[1])


# -- Origin and Host ------------------------------------------------------------------------------


def _scope(host: str | None = "127.0.0.1:8765", origin: str | None = None) -> dict:
    headers = [(b"host", host.encode())] if host is not None else []
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    return {"type": "websocket", "path": "/v1/realtime", "headers": headers}


@pytest.mark.parametrize(("origin", "allowed"), [
    (None, True),                              # an SDK, a phone gateway: the key decides
    ("http://127.0.0.1:8765", True),           # the server's own page
    ("http://localhost:3000", True),           # a page of a local dev server
    ("http://[::1]:5173", True),
    ("https://evil.example", False),
    ("http://127.0.0.1.evil.example", False),  # looks loopback, is not
    ("null", False),                           # a file, a sandboxed frame
])
def test_browsers_are_served_from_the_own_page_and_loopback_origins_only(origin, allowed):
    refusal = Guard("127.0.0.1").refusal(_scope(origin=origin))
    assert (refusal is None) is allowed, refusal
    if not allowed:
        assert refusal.code == "origin_not_allowed" and "io.allowed_origins" in refusal.message


def test_allowed_origins_add_sites_and_the_own_page_follows_the_name_it_was_reached_by():
    guard = Guard("0.0.0.0", allowed_origins=["https://app.example.com/"])
    assert guard.refusal(_scope("voice.example.com", "https://app.example.com")) is None
    assert guard.refusal(_scope("voice.example.com", "https://voice.example.com")) is None, "its own page"
    assert guard.refusal(_scope("voice.example.com", "https://other.example.com")) is not None
    assert Guard("0.0.0.0", allowed_origins=["*"]).refusal(_scope("a", "https://any.example")) is None


@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:8765", True), ("localhost:8765", True), ("[::1]:8765", True), ("app.localhost", True),
    (None, True),                   # HTTP/1.0 health checks send none
    ("evil.example:8765", False),   # DNS rebinding: a page of evil.example resolved to 127.0.0.1
    ("10.0.0.5:8765", False),
])
def test_a_loopback_bind_refuses_hosts_that_are_not_loopback(host, allowed):
    refusal = Guard("127.0.0.1").refusal(_scope(host))
    assert (refusal is None) is allowed, refusal
    if not allowed:
        assert refusal.code == "host_not_allowed" and "io.allowed_hosts" in refusal.message
    assert Guard("0.0.0.0").refusal(_scope(host)) is None, "a public bind is reached by any name (the key decides)"


def test_allowed_hosts_admit_a_balancers_name():
    guard = Guard("127.0.0.1", allowed_hosts=["voice.example.com"])
    assert guard.refusal(_scope("voice.example.com:443")) is None
    assert guard.refusal(_scope("evil.example")) is not None


def test_every_route_refuses_a_foreign_origin_or_a_rebound_host(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.allowed_origins=[https://app.example.com]") as (url, server):
        port = _port(url)
        for headers, code in (({"Origin": "http://evil.example"}, "origin_not_allowed"),
                              ({"Host": f"evil.example:{port}"}, "host_not_allowed")):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                if "Host" in headers:
                    _raw(url, host="evil.example")
                else:
                    _raw(url, additional_headers=headers)
            assert refused.value.response.status_code == 403
            assert json.loads(refused.value.response.body)["error"]["code"] == code
            for path in ("/metrics", "/", "/v1/realtime/calls", "/v1/twilio"):  # routes of other helpers too
                status, body = _http(url, path, **headers)
                assert status == 403 and body["error"]["code"] == code, path
        assert server.open == 0 and server.sessions_run == 0, "no session was opened for a refused browser"
        for headers in ({}, {"Origin": f"http://127.0.0.1:{port}"}, {"Origin": "http://localhost:3000"},
                        {"Origin": "https://app.example.com"}):
            with _raw(url, additional_headers=headers) as ws:
                assert _next(ws)["type"] == "session.created", headers


def test_a_foreign_origin_is_refused_even_with_the_key(llama, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("S2S_REALTIME_API_KEY", raising=False)
    with serving(llama, tmp_path, "io.api_key=sesame") as (url, _):
        key = {"Authorization": "Bearer sesame"}
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            _raw(url, additional_headers={**key, "Origin": "https://evil.example"})
        assert refused.value.response.status_code == 403 and b"sesame" not in refused.value.response.body
        with _raw(url, additional_headers=key) as ws:
            assert _next(ws)["type"] == "session.created"


# -- health, readiness, drain ---------------------------------------------------------------------


def test_readiness_says_full_and_draining_while_health_stays_alive(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.max_sessions=1") as (url, server):
        assert _http(url, "/healthz") == (200, {"status": "alive", "sessions": 0})
        assert _http(url, "/readyz")[0] == 200
        with _raw(url) as ws:
            _next(ws, "session.created")
            assert _http(url, "/readyz") == (503, {"status": "full", "reason": "count", "sessions": 1,
                                                   "why": "full: count (1 of io.max_sessions=1)"})
            metrics = _http_text(url, "/metrics")
            assert "s2s_ready 0.0" in metrics and 's2s_not_ready{reason="count"} 1.0' in metrics, metrics
            with _raw(url) as late:  # what /readyz said: the next one is refused
                assert _next(late)["error"]["code"] == "session_limit_reached"
        until(lambda: server.open == 0, what="the session to end")
        assert _http(url, "/readyz") == (200, {"status": "ready", "sessions": 0})
        assert "s2s_ready 1.0" in _http_text(url, "/metrics")


def test_a_drain_lets_a_live_reply_finish_and_turns_new_sessions_away_with_1013(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.drain_timeout_s=120") as (url, server):
        with _raw(url) as live:
            _next(live, "session.created")
            _speak(live, QUESTION)
            _next(live, "response.created")
            server.begin_drain()
            until(lambda: server.drain.draining, what="the drain to begin")
            assert _http(url, "/readyz") == (503, {"status": "draining", "why": "draining", "sessions": 1})
            assert 's2s_not_ready{reason="draining"} 1.0' in _http_text(url, "/metrics")
            assert _http(url, "/healthz")[0] == 200
            with _raw(url) as late:
                assert _next(late)["error"]["code"] == "server_draining"
                assert _closed_code(late) == 1013
            done = _next(live, "response.done")
            assert done["response"]["status"] == "completed", "the live reply finished"
        server._thread.join(60)
        assert not server._thread.is_alive(), "the server stopped once its last session left"


def test_a_session_still_live_when_the_drain_time_is_over_is_told_and_closed(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.drain_timeout_s=0") as (url, server):
        with _raw(url) as ws:
            _next(ws, "session.created")
            server.begin_drain()
            error = _next(ws, "error")["error"]
            assert error["code"] == "server_shutting_down" and "io.drain_timeout_s" in error["message"]
            assert _closed_code(ws) == 1001
        server._thread.join(60)
        assert not server._thread.is_alive()


# -- abuse ----------------------------------------------------------------------------------------


def test_a_client_flooding_small_events_is_told_and_slowed_and_its_session_goes_on(llama, tmp_path):  # noqa: F811
    tiny = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAAAA=="})
    with serving(llama, tmp_path, "io.max_events_per_s=20") as (url, server):  # 40 at once, then 20 a second
        with _raw(url) as ws:
            _next(ws, "session.created")
            for _ in range(100):  # benchmarks/bench_abuse.py sends 1,000 a second
                ws.send(tiny)
            ws.send(json.dumps({"type": "no.such.event", "event_id": "evt_last"}))
            error = _next(ws, "error")["error"]
            assert error["code"] == "rate_limited" and "io.max_events_per_s=20" in error["message"]
            last = _next(ws, "error")["error"]
            assert last["event_id"] == "evt_last", "every event was read, in order: the session went on"
        until(lambda: server.open == 0, what="the session to end")


def test_a_client_that_keeps_flooding_is_closed_with_1008(llama, tmp_path, monkeypatch):  # noqa: F811
    from nodes.io.realtime import limits

    monkeypatch.setattr(limits, "GRACE_S", 1.0)  # 10 s as shipped
    tiny = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAAAA=="})
    with serving(llama, tmp_path, "io.max_events_per_s=20") as (url, server):
        with _raw(url) as ws:
            _next(ws, "session.created")
            for _ in range(200):  # 40 at once, then 20 a second: over the rate for longer than the grace
                ws.send(tiny)
            kinds = []
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                while True:
                    event = json.loads(ws.recv(timeout=60))
                    kinds.append(event["error"]["code"] if event["type"] == "error" else event["type"])
            assert kinds == ["rate_limited", "rate_limited"], "told as it went over, and as it was closed"
            assert closed.value.rcvd.code == 1008
        until(lambda: server.open == 0, what="the session to end")
        dropped = server.metrics.registry.get_sample_value("s2s_sessions_dropped_total", {"reason": "rate_limited"})
        assert dropped == 1


def test_a_10_mb_frame_closes_its_connection_with_1009_and_the_others_go_on(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path) as (url, server), _raw(url) as other:
        _next(other, "session.created")
        with _raw(url, max_size=None) as big:
            _next(big, "session.created")
            big.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (10 << 20)}))
            assert _closed_code(big) == 1009, "message too big"
        until(lambda: server.open == 1, what="the flooded session to end")
        _speak(other, QUESTION)
        assert _next(other, "response.done")["response"]["status"] == "completed"


def test_a_session_graph_is_built_at_its_clients_first_valid_event_never_for_one_that_sends_none(
        llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path) as (url, server):
        built: list[Any] = []
        make_graph = server.make_graph
        server.make_graph = lambda: built.append(make_graph()) or built[-1]
        with _raw(url, max_size=None) as big:
            assert _next(big, "session.created")["session"]["audio"]["output"]["voice"], "settings, no graph"
            big.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (10 << 20)}))
            assert _closed_code(big) == 1009
        with _raw(url) as junk:
            _next(junk, "session.created")
            junk.send("not json")
            assert _next(junk, "error")["error"]["code"] == "invalid_json"
            junk.send(json.dumps({"type": "no.such.event"}))
            assert _next(junk, "error")["error"]["code"] == "unknown_event"
            assert built == [], "a session that sent nothing of the protocol built a graph"
            junk.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
            assert _next(junk, "session.updated")["session"]["instructions"] == "Be brief."
            assert len(built) == 1
            _speak(junk, QUESTION)
            assert _next(junk, "response.done")["response"]["status"] == "completed"
        until(lambda: server.open == 0, what="the sessions to end")


def test_a_finished_reply_gives_what_it_freed_back_while_its_session_stays_open(llama, tmp_path, monkeypatch):  # noqa: F811
    # glibc keeps what a turn freed; a session open for hours between turns would keep its busiest
    # turn's worth (bench_realtime.py --memory). The trim comes a moment after the reply, not the hang-up.
    from nodes.io.realtime import limits

    trims: list[str] = []
    real = limits._malloc_trim

    def trim() -> None:
        trims.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(limits, "_malloc_trim", trim)
    with serving(llama, tmp_path) as (url, server), _raw(url) as ws:
        _next(ws, "session.created")
        _speak(ws, QUESTION)
        assert _next(ws, "response.done")["response"]["status"] == "completed"
        until(lambda: trims, timeout=10, what="the heap's trim after the reply")
        assert server.open == 1, "the session is still open: its reply, not its end, asked for the trim"
        assert trims[0] != "realtime-server", "the trim (2-8 ms) runs off the server's loop, not on it"


def test_metrics_show_the_cpu_time_of_each_stage_and_of_whispers_own_threads(llama, tmp_path):  # noqa: F811
    # where a turn's CPU goes, per stage (bench_realtime.py --conversations reports it per turn)
    def by_stage(server: Any) -> dict[str, float]:
        return {s.labels["stage"]: s.value for family in server.metrics.registry.collect()
                if family.name == "s2s_stage_cpu_seconds" for s in family.samples}

    with serving(llama, tmp_path) as (url, server):
        before = by_stage(server)
        with _raw(url) as ws:
            _next(ws, "session.created")
            _speak(ws, QUESTION)
            assert _next(ws, "response.done")["response"]["status"] == "completed"
            live = by_stage(server)  # the session's node threads still running
        until(lambda: server.open == 0, what="the session to end")
        until(lambda: not [t for t in threading.enumerate() if t.name == "node:tts"], what="its threads to end")
        ended = by_stage(server)
    spent = {stage: ended.get(stage, 0.0) - before.get(stage, 0.0) for stage in ended}
    for stage in ("vad", "stt", "llm", "tts", "source", "sink"):
        assert live.get(stage, 0.0) > before.get(stage, 0.0), f"{stage} while it runs: {before} -> {live}"
        assert ended.get(stage, 0.0) >= live[stage], f"{stage}: its threads' CPU is kept once they end: {ended}"
    # Whisper runs on CTranslate2's own thread, not the STT node's
    assert spent["native"] > 0.02, spent
    assert spent["tts"] > spent["llm"], f"Piper synthesizes on the TTS node's thread: {spent}"


def test_a_reconnect_storm_gets_sessions_or_clean_refusals_and_leaves_nothing_behind(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.max_sessions=8") as (url, server):
        with _raw(url) as warm:  # the first session's threads and pools, before counting
            _next(warm, "session.created")
        until(lambda: server.open == 0, what="the first session to end")
        before = {t.ident for t in threading.enumerate()}

        def connect(_: int) -> str:
            with _raw(url) as ws:
                first = _next(ws)
                return first["type"] if first["type"] != "error" else first["error"]["code"]

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(connect, range(200)))
        assert set(answers) <= {"session.created", "session_limit_reached"}, set(answers)
        assert answers.count("session.created") >= 8
        until(lambda: server.open == 0 and not server.sessions, what="every session to end")

        def new_threads() -> list[str]:
            return [t.name for t in threading.enumerate() if t.ident not in before]

        until(lambda: not new_threads(), what=lambda: f"the storm's threads to end: {new_threads()}")


# -- limits per client address (io.client_limits, io.trusted_proxies) ------------------------------


def _from(url: str, address: str, forwarded_for: str | None = None) -> Any:
    """A client from its own loopback address (Linux answers all of 127.0.0.0/8), optionally through a
    proxy that says whom it forwards."""
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else None
    return _raw(url, source_address=(address, 0), additional_headers=headers)


def _answer(ws: Any) -> str:
    first = _next(ws)
    return first["type"] if first["type"] != "error" else first["error"]["code"]


def _refused(ws: Any) -> tuple[dict, int | None]:
    """The error a refused client is told, and the close code that follows it."""
    error = _next(ws, "error")["error"]
    return error, _closed_code(ws)


def test_one_address_holds_at_most_its_sessions_and_a_trusted_proxy_names_its_clients(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.client_limits.max_sessions=1", "io.client_limits.connects_per_s=0",
                 "io.client_limits.exempt=[]", "io.trusted_proxies=[127.0.0.1]") as (url, server):
        refused = server.metrics.registry.get_sample_value
        with _from(url, "127.0.0.2") as first, _from(url, "127.0.0.3") as other:
            assert _answer(first) == "session.created" and _answer(other) == "session.created"
            with _from(url, "127.0.0.2") as second:
                error, code = _refused(second)
                assert error["code"] == "client_session_limit" and code == 1008
                assert "127.0.0.2" in error["message"] and "io.client_limits.max_sessions=1" in error["message"]
            with _from(url, "127.0.0.2", forwarded_for="203.0.113.7") as spoofed:  # not a trusted proxy
                assert _refused(spoofed)[0]["code"] == "client_session_limit", "its X-Forwarded-For is ignored"
            with _from(url, "127.0.0.1", forwarded_for="203.0.113.7") as proxied:
                assert _answer(proxied) == "session.created", "the proxy's client counts, not the proxy"
                with _from(url, "127.0.0.1", forwarded_for="198.51.100.1, 203.0.113.7") as again:
                    error, code = _refused(again)
                    assert "203.0.113.7" in error["message"] and code == 1008, "the last hop the proxy names"
                with _from(url, "127.0.0.1", forwarded_for="203.0.113.8") as third:
                    assert _answer(third) == "session.created"
            assert server.sessions_run == 4, "the refused connections built no session"
            assert refused("s2s_sessions_refused_total", {"reason": "client_session_limit"}) == 3
        until(lambda: server.open == 0, what="the sessions to end")
        with _from(url, "127.0.0.2") as later:
            assert _answer(later) == "session.created", "a session closed frees its address's place"


def test_a_reconnect_storm_from_one_address_is_refused_before_any_session_is_built(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.client_limits.connects_per_s=0.001", "io.client_limits.exempt=[]",
                 "io.max_sessions=8") as (url, server):  # one at once, then one per 1,000 s
        with _from(url, "127.0.0.2") as warm:  # the first session's threads and pools, before counting
            assert _answer(warm) == "session.created"
        until(lambda: server.open == 0, what="the first session to end")
        before = {t.ident for t in threading.enumerate()}
        with _from(url, "127.0.0.2") as next_one:
            error, code = _refused(next_one)
            assert error["code"] == "client_rate_limited" and code == 1013, "try again later"
            assert "io.client_limits.connects_per_s=0.001" in error["message"]

        def connect(_: int) -> str:
            with _from(url, "127.0.0.2") as ws:
                return _answer(ws)

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(connect, range(100)))
        assert set(answers) == {"client_rate_limited"}, set(answers)
        with _from(url, "127.0.0.3") as other:
            assert _answer(other) == "session.created", "another address is not limited by the first's storm"
        assert server.sessions_run == 2, "the storm built no session"
        refused = server.metrics.registry.get_sample_value
        assert refused("s2s_sessions_refused_total", {"reason": "client_rate_limited"}) == 101
        assert 's2s_sessions_refused_total{reason="client_rate_limited"} 101.0' in server.metrics.text().decode()
        until(lambda: server.open == 0 and not server.sessions, what="every session to end")

        def new_threads() -> list[str]:
            return [t.name for t in threading.enumerate() if t.ident not in before]

        until(lambda: not new_threads(), what=lambda: f"the storm's threads to end: {new_threads()}")


def test_loopback_clients_are_exempt_as_shipped(llama, tmp_path):  # noqa: F811
    with serving(llama, tmp_path, "io.client_limits.max_sessions=1") as (url, _), \
            _from(url, "127.0.0.2") as first, _from(url, "127.0.0.2") as second:
        assert _answer(first) == "session.created" and _answer(second) == "session.created"
