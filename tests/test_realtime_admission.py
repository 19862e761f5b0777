"""Admission by capacity (nodes/io/realtime/admission.py): the realtime server refuses (or holds)
a new connection when its sessions are already slower than io.target_ms, not only past
io.max_sessions, and /metrics shows the refusals and the shared models' queues. /readyz says
503 whenever admission would refuse (drain.py), so a balancer stops sending what would be refused.

The decision is tested on given figures (voice-to-voice, the inference snapshot's shape); the
refusal by load end to end with the real offline stack: a session's spoken turns make the load
(their voice-to-voice is always above a 1 ms target), /readyz and /metrics say full by load, and
the next connection is refused."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from nodes.io.realtime.admission import Admission, InferenceCollector
from nodes.io.realtime.drain import Drain
from s2s_flow.cli import plan
from s2s_flow.compose import compose
from s2s_flow.errors import ConfigError
from tests.test_realtime import until


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def snapshot_of(first_wait_s: float) -> dict:
    return {"whisper": {"queued": {"first": 2, "speculative": 1}, "running": 1,
                        "wait_s": {"first": first_wait_s, "speculative": 0.9}, "shed": {"speculative": 3}}}


def admission(open_now: list[int], **kw) -> Admission:
    return Admission(sessions=lambda: open_now[0], **{"max_sessions": 4, "target_ms": 1000, **kw})


def test_full_by_count_by_recent_voice_to_voice_and_by_the_queue_wait_of_confirmed_work():
    open_now, clock, first_wait = [1], Clock(), [0.0]
    gate = admission(open_now, clock=clock, snapshot=lambda: snapshot_of(first_wait[0]))
    assert gate.full() is None
    gate.voice_to_voice(1.4)
    assert gate.full() is None, "one slow reply says nothing yet"
    gate.voice_to_voice(1.3)
    assert gate.full() == "load"
    assert "io.target_ms=1000" in gate.explain("load") and "1350 ms" in gate.explain("load")
    clock.t += 61  # those figures have aged out: the load has passed
    assert gate.full() is None
    first_wait[0] = 0.6  # confirmed turns queued for over half the target...
    assert gate.full() is None, "... but nothing was answered for a minute: those waits are stale"
    gate.voice_to_voice(0.5)
    assert gate.full() == "load" and "queue 600 ms" in gate.explain("load")
    first_wait[0] = 0.0
    for _ in range(16):
        gate.voice_to_voice(0.7)  # fast replies now
    assert gate.full() is None
    open_now[0] = 4
    assert gate.full() == "count" and "io.max_sessions" in gate.explain("count")


def test_full_by_load_holds_until_the_load_is_back_under_80_percent_of_the_target():
    open_now, clock = [1], Clock()
    gate = admission(open_now, clock=clock, snapshot=lambda: {})
    for _ in range(3):
        gate.voice_to_voice(0.9)
    assert gate.full() is None, "under the target: a new session is taken"
    for _ in range(4):
        gate.voice_to_voice(1.5)
    assert gate.full() == "load"
    for _ in range(4):
        gate.voice_to_voice(0.9)  # the median is 900 ms now: under the target, not under 80 % of it
    assert gate.full() == "load", "it was full: ready again only under 80 % of the target (no flapping)"
    assert gate.why("load").startswith("full: load: ") and "not yet back under 80%" in gate.why("load")
    for _ in range(16):
        gate.voice_to_voice(0.7)
    assert gate.full() is None
    for _ in range(16):
        gate.voice_to_voice(0.9)
    assert gate.full() is None, "ready: full again only over the target itself"
    open_now[0] = 0
    gate.voice_to_voice(5.0)
    assert gate.full() is None, "an empty server takes one, whatever the figures"


def test_readiness_is_admissions_verdict_and_names_why():
    open_now, first_wait = [1], [0.0]
    gate = admission(open_now, snapshot=lambda: snapshot_of(first_wait[0]))
    drain = Drain(10.0)
    assert drain.readiness(gate) == {"status": "ready", "sessions": 1}
    gate.voice_to_voice(0.3)
    first_wait[0] = 0.7
    state = drain.readiness(gate)
    assert (state["status"], state["reason"]) == ("full", "load") and state["why"].startswith("full: load: "), state
    assert "queue 700 ms" in state["why"] and "io.target_ms=1000" in state["why"]
    first_wait[0] = 0.0
    open_now[0] = 4
    assert drain.readiness(gate) == {"status": "full", "reason": "count", "sessions": 4,
                                     "why": "full: count (4 of io.max_sessions=4)"}
    drain.draining = True
    assert drain.readiness(gate) == {"status": "draining", "why": "draining", "sessions": 4}


def test_target_null_admits_by_count_alone_and_an_empty_server_always_takes_one():
    open_now = [0]
    gate = admission(open_now, snapshot=lambda: snapshot_of(5.0))
    assert gate.full() is None  # nobody to slow down
    open_now[0] = 1
    gate.voice_to_voice(0.5)
    assert gate.full() == "load"
    assert admission(open_now, target_ms=None, snapshot=lambda: snapshot_of(5.0)).full() is None


def test_target_auto_is_this_machines_voice_to_voice_for_a_lone_caller_times_1_5():
    open_now, clock = [2], Clock()
    gate = admission(open_now, target_ms="auto", clock=clock, snapshot=lambda: {})
    for _ in range(4):
        gate.voice_to_voice(3.0)  # two sessions from the start: nothing says what one caller gets
    assert gate.target_s() is None and gate.full() is None, "not known yet: admitted by count"
    open_now[0] = 1
    for v2v in (1.2, 1.4, 1.3):  # what a 2-core AMD EPYC gives one caller alone
        gate.voice_to_voice(v2v)
    assert gate.target_s() == pytest.approx(1.5 * 1.3)
    assert gate.full() == "load", "the two-session replies of 3 s are still the recent median"
    open_now[0] = 2
    for _ in range(16):
        gate.voice_to_voice(1.5)  # back under 80 % of the target: ready again
    assert gate.full() is None
    for _ in range(16):
        gate.voice_to_voice(1.8)  # two callers, each 1.4x slower than one alone: within the target
    assert gate.full() is None, "a fixed 1000 ms target would refuse the second caller here"
    for _ in range(16):
        gate.voice_to_voice(2.1)
    assert gate.full() == "load"
    assert "io.target_ms=auto (1950 ms: 1.5 x the 1300 ms this machine gives one caller alone)" in \
        gate.explain("load"), gate.explain("load")
    assert gate.target_s() == pytest.approx(1.95), "replies to two sessions never move the lone-caller figure"
    pytest.importorskip("prometheus_client", reason="pip install 's2s-flow[serve]'")
    from nodes.io.realtime.prometheus import ServerMetrics

    metrics, known = ServerMetrics(), [None]
    metrics.admission_target(lambda: known[0])
    assert "s2s_admission_target_seconds NaN" in metrics.text().decode()
    known[0] = gate.target_s()
    assert "s2s_admission_target_seconds 1.95" in metrics.text().decode()


def test_a_burst_of_newcomers_is_taken_in_a_few_at_a_time_until_their_load_shows():
    open_now, clock = [0], Clock()
    gate = admission(open_now, max_sessions=16, clock=clock, snapshot=lambda: {})
    taken: list[str] = []

    def arrive() -> str | None:
        reason = gate.full()
        if reason is None:
            taken.append(f"s{len(taken)}")
            gate.joined(taken[-1])
            open_now[0] += 1
        return reason

    for _ in range(2):
        gate.voice_to_voice(0.5)  # the replies so far are fast: nothing in the figures says full
    assert [arrive() for _ in range(3)] == [None, None, "load"], "an idle server takes in 2 at once"
    assert "2 session(s) joined in the last 20 s and have had no reply yet" in gate.explain("load")
    assert "taken in 2 at a time" in gate.why("load"), gate.why("load")
    for session in taken:
        gate.voice_to_voice(0.6, session)  # their first replies: their load shows, and it is fine
    assert [arrive() for _ in range(3)] == [None, None, "load"]
    for session in taken[2:]:
        gate.voice_to_voice(0.6, session)
    assert [arrive() for _ in range(3)] == [None, None, "load"], "4 settled: max(2, half of 4)"
    for session in taken[4:]:
        gate.voice_to_voice(0.6, session)
    assert [arrive() for _ in range(4)] == [None, None, None, "load"], "6 settled: 3 at a time"
    clock.t += 21  # silent newcomers: after NEW_S as settled as they get
    assert arrive() is None
    gate.closed(taken[-1])
    open_now[0] -= 1
    assert not gate.newcomers
    by_count = admission([3], max_sessions=16, target_ms=None)
    for session in ("a", "b", "c"):
        by_count.joined(session)
    assert by_count.full() is None, "admission by count only: no ramp either"
    auto = admission([3], max_sessions=16, target_ms="auto", clock=clock, snapshot=lambda: {})
    for session in ("a", "b", "c"):
        auto.joined(session)
    assert auto.full() is None, "auto before a target is known: by count, as every other load verdict"


def test_wait_holds_a_connection_until_a_session_ends_and_is_bounded():
    async def scenario() -> tuple[str | None, str | None]:
        open_now = [2]
        gate = admission(open_now, max_sessions=2, policy="wait", wait_s=30)
        waiting = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0)
        assert not waiting.done()
        open_now[0] = 1
        gate.closed()
        admitted = await asyncio.wait_for(waiting, 10)
        open_now[0] = 2
        bounded = await admission(open_now, max_sessions=2, policy="wait", wait_s=0.05).admit()
        return admitted, bounded

    assert asyncio.run(scenario()) == (None, "count")


def test_bad_admission_settings_are_compose_time_errors():
    for override, words in (("io.admission=later", "io.admission=refuse"), ("io.target_ms=0", "io.target_ms"),
                            ("io.target_ms=soon", "io.target_ms=soon must be > 0"),
                            ("io.admission_wait_s=-1", "io.admission_wait_s")):
        cfg, choices = compose(["recipe=local_cpu", "server=null", "io=realtime", override])
        with pytest.raises(ConfigError, match=words):
            plan(cfg, choices)


def test_metrics_expose_the_shared_models_queues_waits_and_shed_work_by_kind():
    prom = pytest.importorskip("prometheus_client", reason="pip install 's2s-flow[serve]'")
    registry = prom.CollectorRegistry()
    registry.register(InferenceCollector(lambda: snapshot_of(0.25)))
    text = prom.generate_latest(registry).decode()
    for line in ('s2s_inference_queued{kind="first",model="whisper"} 2.0',
                 's2s_inference_running{model="whisper"} 1.0',
                 's2s_inference_wait_seconds{kind="first",model="whisper"} 0.25',
                 's2s_inference_shed_total{kind="speculative",model="whisper"} 3.0'):
        assert line in text, text


# -- end to end: a real server on the offline stack ---------------------------------------------

RATE = 24000


@pytest.fixture(scope="module")
def llama(smollm2_gguf, llama_server_binary) -> Iterator[str]:
    from tests.support.servers import running_llama_server

    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=("--jinja",)) as base_url:
        yield base_url


def _spoken(text: str) -> list[str]:
    from tests.support.speech import synthesize

    pcm = np.concatenate([np.zeros(RATE // 5, np.float32), synthesize(text, rate=RATE), np.zeros(RATE, np.float32)])
    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    return [base64.b64encode(data[i : i + 9600]).decode() for i in range(0, len(data), 9600)]


def _metrics(url: str) -> str:
    http = url.replace("ws://", "http://").removesuffix("/v1")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{http}/metrics", timeout=10) as r:
        return r.read().decode()


def _readyz(url: str) -> tuple[int, dict]:
    http = url.replace("ws://", "http://").removesuffix("/v1")
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{http}/readyz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _server(llama: str, tmp_path, *overrides: str):
    """A realtime server on the offline stack, started: (server, its ws:// URL)."""
    for module in ("starlette", "uvicorn", "websockets", "faster_whisper", "piper", "onnxruntime"):
        pytest.importorskip(module, reason="io=realtime on the offline stack: pip install 's2s-flow[serve,offline]'")
    from nodes.io.realtime.server import RealtimeServer

    cfg, choices = compose(["recipe=local_cpu", "server=null", "io=realtime", "io.port=0", "llm.max_tokens=16",
                            f"llm.base_url={llama}", *overrides])
    server = RealtimeServer(lambda: plan(cfg, choices), plan(cfg, choices).nodes["source"].node, tmp_path)
    return server, server.start()


def test_a_connection_beyond_what_the_live_sessions_allow_is_refused_by_load(llama, tmp_path):
    server, url = _server(llama, tmp_path, "io.max_sessions=4", "io.target_ms=1")
    from websockets.sync.client import connect

    try:
        with connect(f"{url}/realtime", open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
            assert _readyz(url) == (200, {"status": "ready", "sessions": 1}), "no figures yet: ready"
            assert "s2s_ready 1.0" in _metrics(url)
            for question in ("What is the capital of France?", "How many legs does a spider have?"):
                for chunk in _spoken(question):
                    ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                while json.loads(ws.recv(timeout=120))["type"] != "response.done":
                    pass
            status, ready = _readyz(url)  # what a balancer's health check sees: the refusal to come
            assert (status, ready["status"], ready["reason"]) == (503, "full", "load"), ready
            assert ready["why"].startswith("full: load: its sessions' replies start"), ready
            assert "io.target_ms=1)" in ready["why"], ready
            metrics = _metrics(url)
            assert "s2s_ready 0.0" in metrics and 's2s_not_ready{reason="load"} 1.0' in metrics, metrics
            assert 's2s_not_ready{reason="count"} 0.0' in metrics
            with connect(f"{url}/realtime", open_timeout=10) as late:
                refused = json.loads(late.recv(timeout=60))
            assert refused["type"] == "error" and refused["error"]["code"] == "session_limit_reached", refused
            assert "io.target_ms=1" in refused["error"]["message"]
            metrics = _metrics(url)
            assert 's2s_sessions_refused_total{reason="load"} 1.0' in metrics, metrics
            assert 's2s_sessions_refused_total{reason="count"} 0.0' in metrics
            # the conversations benchmark's late joiner (--late-joiner) reads the refusal as such
            from benchmarks._conversations import late_joiner

            joined = asyncio.run(late_joiner(url, 0.0))
            assert (joined["admitted"], joined["code"]) == (False, "session_limit_reached"), joined
            assert "io.target_ms=1" in joined["message"]
        until(lambda: server.open == 0, what="the session to end")
        assert _readyz(url) == (200, {"status": "ready", "sessions": 0}), "an empty server takes one"
    finally:
        server.stop()


def test_a_burst_of_callers_is_taken_in_two_at_a_time_until_their_replies_show_the_load(llama, tmp_path):
    # a target no reply misses: only the ramp can refuse anyone here
    server, url = _server(llama, tmp_path, "io.max_sessions=8", "io.target_ms=60000")
    from websockets.sync.client import connect

    try:
        with connect(f"{url}/realtime", open_timeout=10) as first, \
                connect(f"{url}/realtime", open_timeout=10) as second:
            ids = [json.loads(ws.recv(timeout=60))["session"]["id"] for ws in (first, second)]
            assert sorted(server.admission.newcomers) == sorted(ids), "admitted, no reply yet: newcomers"
            with connect(f"{url}/realtime", open_timeout=10) as third:
                refused = json.loads(third.recv(timeout=60))
            assert refused["type"] == "error" and refused["error"]["code"] == "session_limit_reached", refused
            assert "2 session(s) joined in the last 20 s and have had no reply yet" in refused["error"]["message"]
            status, ready = _readyz(url)
            assert (status, ready["reason"]) == (503, "load") and "taken in 2 at a time" in ready["why"], ready
            for chunk in _spoken("What is the capital of France?"):
                first.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            while json.loads(first.recv(timeout=120))["type"] != "response.done":
                pass
            assert list(server.admission.newcomers) == [ids[1]], "the first session's reply showed its load"
            with connect(f"{url}/realtime", open_timeout=10) as third:
                assert json.loads(third.recv(timeout=60))["type"] == "session.created", "the next step is taken in"
            assert 's2s_sessions_refused_total{reason="load"} 1.0' in _metrics(url)
        until(lambda: server.open == 0, what="the sessions to end")
        assert not server.admission.newcomers, "sessions that left are no newcomers"
    finally:
        server.stop()
