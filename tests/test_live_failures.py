"""A live session outlives its endpoints (io=realtime, the real offline stack of
tests/test_realtime.py): the managed llama-server SIGKILLed mid-conversation is restarted, the
turn that found it gone speaks ``llm.fallback_reply`` (a completed response with that transcript
and audio), the next turn after the restart is answered; a 401 speaks the fallback too; an STT
or TTS endpoint that is gone costs its turn (an ``error`` naming the stage) and the session goes
on. A file run still fails as a whole. Every fault is a real one: a killed process, a key
refused, a port where nothing listens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from s2s_flow.model_server import managed_server
from s2s_flow.server_watch import restarts
from tests.support import tools
from tests.support.managed import processes_with, wait_until
from tests.support.servers import answers, free_port, running_llama_server
from tests.support.tts_checks import transcribe, words, words_recovered
from tests.test_realtime import RATE, _compose, appends, sdk, serving, spoken

FALLBACK = "Sorry, I couldn't answer that. Please try again."


def run(talk: Any, timeout: float = 300) -> Any:
    return asyncio.run(asyncio.wait_for(talk, timeout))


async def ask(conn, text: str, modalities: tuple[str, ...] = ("audio",)) -> tuple[list[Any], bytes]:
    """A typed user message and its response: (every event up to response.done, the reply's PCM16)."""
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(response={"output_modalities": list(modalities)})
    return await until_done(conn)


def two_texts(url: str, first: str, second: str) -> tuple[list[Any], list[Any]]:
    """Two typed questions in one session, text responses: the events of each."""
    async def talk():
        async with sdk(url) as conn:
            one, _ = await ask(conn, first, ("text",))
            two, _ = await ask(conn, second, ("text",))
            return one, two

    return run(talk(), timeout=120)


async def until_done(conn) -> tuple[list[Any], bytes]:
    events, audio = [], []
    async for event in conn:
        events.append(event)
        if event.type == "response.output_audio.delta":
            audio.append(__import__("base64").b64decode(event.delta))
        if event.type == "response.done":
            return events, b"".join(audio)
    raise AssertionError(f"the connection closed before response.done: {[e.type for e in events]}")


def said(events: list[Any]) -> str:
    done = events[-1]
    assert done.type == "response.done", done
    part = done.response.output[0].content[0]
    return part.transcript if getattr(part, "transcript", None) is not None else part.text


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url.replace("ws://", "http://").removesuffix("/v1") + "/metrics").read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _session_metrics(run_dir: Path) -> dict[str, Any]:
    (path,) = list(run_dir.glob("sessions/*/metrics.json"))
    return json.loads(path.read_text())


def test_a_killed_managed_llama_server_comes_back_and_the_session_lives_through_it(
        llama_server_binary, smollm2_gguf, tmp_path):
    port = free_port()
    server_cfg = OmegaConf.create({
        "command": ["{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}", "-c", "2048",
                    "-np", "1", "--jinja"],
        "model": str(smollm2_gguf), "ready_url": f"http://127.0.0.1:{port}/health",
        # a probe every 0.2 s sees the death at once; the first try waits 3 s, long after the turn
        # that meets the dead server (one request, no retries) has had its fallback
        "max_restarts": 3, "health_interval_s": 0.2, "restart_backoff_s": 3.0})
    name = f"llama-server:{port}"

    async def talk(url: str, handle) -> tuple[Any, ...]:
        async with sdk(url) as conn:
            first, _ = await ask(conn, "What is the capital of France?", ("text",))
            killed = handle.pid
            os.kill(killed, signal.SIGKILL)
            assert wait_until(lambda: not answers(port), 10), "the server is gone"
            failed, audio = await ask(conn, "How many legs does a spider have?")
            assert wait_until(lambda: handle.pid != killed and answers(port), 120), "restarted and ready"
            again, _ = await ask(conn, "What is the capital of Italy?", ("text",))
            return first, failed, audio, again, killed

    with managed_server(server_cfg, tmp_path / "server") as handle, \
            serving(f"http://127.0.0.1:{port}/v1", tmp_path / "rt", "llm.max_retries=0") as (url, _):
        first, failed, audio, again, killed = run(talk(url, handle))
        figures = metrics(url)
    assert not processes_with(f"--port\0{port}\0"), "the restarted server went with the run"

    assert first[-1].response.status == "completed" and said(first).strip() and said(first) != FALLBACK
    assert failed[-1].response.status == "completed", "the turn that met the dead server completes"
    assert said(failed) == FALLBACK, "with the fallback as its transcript"
    pcm = np.frombuffer(audio, "<i2")
    assert len(pcm) / RATE > 1.0 and np.abs(pcm).max() > 300, "spoken"
    heard = words(transcribe(pcm.astype(np.float32) / 32768, RATE))
    assert words_recovered(FALLBACK, " ".join(heard)) >= 0.6, heard  # Whisper hears the apology
    errors = [e for e in failed if e.type == "error"]
    assert [e.error.code for e in errors] == ["llm_failed"] and "no server at" in errors[0].error.message
    # the model answered (greedy SmolLM2 may copy the apology it sees in the history: no error says it did)
    assert again[-1].response.status == "completed" and said(again).strip()
    assert not [e for e in again if e.type == "error"], "the next turn's requests were answered"

    assert restarts()[name] == 1 and figures[("s2s_model_server_restarts_total", (("server", name),))] == 1
    assert figures[("s2s_stage_failures_total", (("stage", "llm"),))] == 1
    assert figures[("s2s_turns_total", ())] == 3, "all three responses completed"
    log = (tmp_path / "server" / "server.log").read_text()
    assert log.count("$ ") == 2, "started, then restarted, into the same log"
    session = _session_metrics(tmp_path / "rt")
    assert session["stage_failures"] == 1
    (row,) = [t for t in session["turns"] if t["failures"]]
    assert row["failures"][0]["stage"] == "llm" and row["failures"][0]["fallback"] == FALLBACK


@pytest.mark.parametrize("filler", [None, "One moment."], ids=["silent", "filler"])
def test_a_server_that_dies_during_a_tool_call_speaks_the_fallback_and_the_next_turn_is_answered(
        llama_server_binary, smollm2_gguf, tmp_path, monkeypatch, filler):
    """With llm.tools the reply takes two requests: the call, then the words with its result. The
    server is SIGKILLed while the tool runs (by the tool): the second request finds it gone. Before
    any word the turn says the fallback; after the tool's filler was said, the reply is the filler
    (what was heard is kept, as for any reply cut after its first words). The managed server comes
    back for the next turn."""
    from nodes.io.realtime.server import RealtimeServer
    from s2s_flow.cli import plan

    port = free_port()
    server_cfg = OmegaConf.create({
        "command": ["{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}", "-c", "2048",
                    "-np", "1", "--jinja", "--chat-template-file", str(tools.TOOL_TEMPLATE_PATH)],
        "model": str(smollm2_gguf), "ready_url": f"http://127.0.0.1:{port}/health",
        "max_restarts": 3, "health_interval_s": 0.2, "restart_backoff_s": 1.0})
    cfg, choices = _compose(f"http://127.0.0.1:{port}/v1", "llm.max_retries=0",
                            "llm.max_tokens=60", "llm.tools=[tests.support.tools:weather_on_a_dying_server]",
                            "llm.tool_choice=required", "llm.max_tool_rounds=1",
                            *([f"llm.tool_filler='{filler}'", "llm.tool_filler_after_s=0.1"] if filler else []))
    monkeypatch.setattr(tools, "DYING_TOOL_S", 0.5 if filler else 0.0)  # the filler comes at 0.1 s

    def make_graph():
        graph = plan(cfg, choices)
        graph.nodes["llm"].node.tool_call_prefill = "<tool_call>\n"  # the model can only write the call
        return graph

    async def talk(url: str, handle) -> tuple[Any, ...]:
        async with sdk(url) as conn:
            tools.KILL_ON_CALL.append(handle.pid)
            killed = handle.pid
            failed, _ = await ask(conn, "What is the weather in Paris?", ("text",))
            called = len(tools.CALLS)
            assert wait_until(lambda: handle.pid != killed and answers(port), 120), "restarted and ready"
            again, _ = await ask(conn, "What is the weather in Rome?", ("text",))
            return failed, called, again

    tools.CALLS.clear()
    with managed_server(server_cfg, tmp_path / "server") as handle:
        server = RealtimeServer(make_graph, plan(cfg, choices).nodes["source"].node, tmp_path / "rt")
        url = server.start()
        try:
            failed, called, again = run(talk(url, handle))
        finally:
            server.stop()
            tools.KILL_ON_CALL.clear()
    assert called and len(tools.CALLS) > called, "the tool ran in both turns"
    errors = [e.error for e in failed if e.type == "error"]
    if filler:
        assert failed[-1].response.status == "completed" and said(failed).strip() == filler, "the words heard"
        assert not errors, "a reply cut after its first words is no failed turn"
    else:
        assert failed[-1].response.status == "completed" and said(failed) == FALLBACK, "the fallback, after the call"
        assert [e.code for e in errors] == ["llm_failed"] and f"127.0.0.1:{port}" in errors[0].message
    # the model answered (greedy SmolLM2 may copy the apology it sees in the history: no error says it did)
    assert again[-1].response.status == "completed" and said(again).strip()
    assert not [e for e in again if e.type == "error"], "the next turn's requests were answered"


def test_a_refused_key_speaks_the_fallback_and_the_session_goes_on(llama_server_binary, smollm2_gguf, tmp_path):
    key = ("--api-key", "right-key")
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=key) as base, \
            serving(f"{base}/v1", tmp_path, "llm.api_key=wrong-key", "llm.fallback_reply='One moment, try again.'") \
            as (url, _):
        one, two = two_texts(url, "What is the capital of France?", "And of Spain?")
    for events in (one, two):
        assert events[-1].response.status == "completed" and said(events) == "One moment, try again."
        (error,) = [e.error for e in events if e.type == "error"]
        assert error.code == "llm_failed" and "401" in error.message and "wrong-key" not in error.message


def test_without_a_fallback_the_turn_fails_and_the_session_goes_on(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: the server is gone
    with serving(dead, tmp_path, "llm.fallback_reply=''", "llm.max_retries=0") as (url, _):
        one, two = two_texts(url, "Hello?", "Anyone there?")
    for events in (one, two):
        assert events[-1].response.status == "failed" and "no server at" in json.dumps(
            events[-1].response.status_details.error.model_dump())


def test_an_stt_endpoint_that_is_gone_costs_the_turn_not_the_session(tmp_path, smollm2_server):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with serving(f"{smollm2_server}/v1", tmp_path, "stt=openai", f"stt.base_url={dead}", "stt.max_retries=0",
                 "~stt.window_s", "~stt.beam_size", "~stt.cpu_threads") \
            as (url, _):
        async def talk():
            async with sdk(url) as conn:
                for chunk in appends(spoken("How many kilometers are there in a marathon?")):
                    await conn.input_audio_buffer.append(audio=chunk)
                events = []
                async for event in conn:
                    events.append(event)
                    if event.type == "error":
                        break
                typed, _ = await ask(conn, "What is the capital of France?", ("text",))
                return events, typed

        events, typed = run(talk())
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" in kinds
    assert kinds.count("conversation.item.input_audio_transcription.failed") == 1
    assert events[-1].error.code == "stt_failed" and "no server at" in events[-1].error.message
    assert "response.created" not in kinds, "no reply to a turn without words"
    assert typed[-1].response.status == "completed" and said(typed).strip(), "the session went on"


def test_a_tts_endpoint_that_is_gone_leaves_the_words_and_the_session(tmp_path, smollm2_server):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with serving(f"{smollm2_server}/v1", tmp_path, "tts=openai", f"tts.base_url={dead}", "tts.max_retries=0") \
            as (url, _):
        async def talk():
            async with sdk(url) as conn:
                spoken_reply, audio = await ask(conn, "What is the capital of France?")
                typed, _ = await ask(conn, "And of Italy?", ("text",))
                return spoken_reply, audio, typed

        spoken_reply, audio, typed = run(talk())
    assert spoken_reply[-1].response.status == "completed" and said(spoken_reply).strip(), "the words, without audio"
    assert audio == b""
    errors = [e.error for e in spoken_reply if e.type == "error"]
    assert [e.code for e in errors] == ["tts_failed"], "once per reply, not per sentence"
    assert typed[-1].response.status == "completed" and said(typed).strip()


def test_a_file_run_still_fails_as_a_whole(tmp_path):
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from s2s_flow.errors import NodeFailed
    from s2s_flow.scheduler import Scheduler
    from tests.support.managed import question_wav

    wav = question_wav(tmp_path / "q.wav")
    cfg, choices = compose(["recipe=local_cpu", "server=null", f"io.input={wav}",
                            f"llm.base_url=http://127.0.0.1:{free_port()}/v1", "llm.max_retries=0"])
    with pytest.raises(NodeFailed, match="node 'llm' failed: .*no server at"):
        Scheduler(plan(cfg, choices), tmp_path / "run").run()


@pytest.mark.parametrize("fault", ["5xx after the retries", "a timeout"])
def test_a_server_error_or_timeout_before_the_first_token_speaks_the_fallback(tmp_path, fault):
    """Faults a real llama-server does not make on demand (a fake server scripts them): 503 on
    every try, or no first byte within llm.read_timeout; then the server answers again."""
    from tests.support.fault_server import FaultServer, Reply, chat_chunks

    if fault == "a timeout":
        replies, extra = [Reply.sse(chat_chunks("late"), delay_s=3.0)], ["llm.read_timeout=1", "llm.max_retries=0"]
    else:
        replies, extra = [Reply.status(503)] * 3, ["llm.max_retries=2"]
    with FaultServer() as srv:
        srv.script(*replies, Reply.sse(chat_chunks("Paris.")))
        with serving(srv.base_url, tmp_path, *extra) as (url, _):
            one, two = two_texts(url, "What is the capital of France?", "Again?")
    assert one[-1].response.status == "completed" and said(one) == FALLBACK
    (error,) = [e.error for e in one if e.type == "error"]
    assert error.code == "llm_failed" and ("503" in error.message or "llm.read_timeout" in error.message), error.message
    assert two[-1].response.status == "completed" and said(two) == "Paris."


def test_s2s_run_io_realtime_lives_through_its_llama_server_being_killed(llama_server_binary, tmp_path):
    """The issue's own run, end to end: `s2s-run recipe=local_cpu io=realtime`, the llama-server it
    started SIGKILLed between two turns of one conversation."""
    from tests.support.managed import start_cli, stop

    rt_port, llm_port = free_port(), free_port()
    run_dir = tmp_path / "run"
    proc = start_cli(["recipe=local_cpu", "io=realtime", f"io.port={rt_port}", "llm.max_tokens=24",
                      f"llm.base_url=http://127.0.0.1:{llm_port}/v1", "llm.max_retries=0",
                      "server.health_interval_s=0.2", "server.restart_backoff_s=3"], run_dir)
    url = f"ws://127.0.0.1:{rt_port}/v1"

    def server_pid() -> int:
        return json.loads((run_dir / "server.json").read_text())["pid"]

    async def talk() -> tuple[Any, ...]:
        async with sdk(url) as conn:
            first, _ = await ask(conn, "What is the capital of France?", ("text",))
            killed = server_pid()
            os.kill(killed, signal.SIGKILL)
            assert wait_until(lambda: not answers(llm_port), 10)
            failed, _ = await ask(conn, "How many legs does a spider have?", ("text",))
            assert wait_until(lambda: server_pid() != killed and answers(llm_port), 120), "restarted"
            again, _ = await ask(conn, "What is the capital of Italy?", ("text",))
            return first, failed, again

    try:
        assert wait_until(lambda: answers(rt_port, "/") or proc.poll() is not None, 300), "serving"
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        first, failed, again = run(talk())
        figures = metrics(url)
    finally:
        stop(proc)
    assert said(first) != FALLBACK and said(failed) == FALLBACK and said(again) != FALLBACK
    assert all(e[-1].response.status == "completed" for e in (first, failed, again))
    assert figures[("s2s_model_server_restarts_total", (("server", f"llama-server:{llm_port}"),))] == 1
    assert not processes_with(f"--port\0{llm_port}\0"), "s2s-run took the restarted server down with it"
