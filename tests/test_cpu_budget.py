"""CPU budget: each stage's thread count comes from config and reaches the engine that runs it;
recipe=local_cpu sets them, and the first clause, for the 2-core offline stack."""

from __future__ import annotations

import os

import pytest

from s2s_flow.cli import plan
from s2s_flow.compose import compose
from s2s_flow.model_server_spec import ServerSpec
from s2s_flow.node import Context


def test_piper_runs_on_the_threads_it_is_given(tmp_path):
    pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
    from nodes.tts.piper import PiperTTS

    node = PiperTTS(threads=1)
    node.ctx = Context("tts", tmp_path)
    node.setup()
    options = node._voice.session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert next(iter(node.synthesize("One thread is enough."))).size > 0


def test_the_turn_model_runs_on_the_threads_it_is_given():
    from nodes.vad.smart_turn import SmartTurn, smart_turn_model_path
    from s2s_flow.errors import MissingDependency

    try:
        smart_turn_model_path()
    except MissingDependency as exc:
        pytest.skip(str(exc))
    assert SmartTurn(threads=2)._session.get_session_options().intra_op_num_threads == 2


def test_local_cpu_sets_piper_threads_and_llama_server_threads_come_from_config():
    cfg, choices = compose(["recipe=local_cpu"])
    assert ServerSpec.from_config(cfg.server).env["LLAMA_ARG_THREADS"] == "-1"  # llama-server's default
    for sessions, threads in ((2, "-1"), (4, str(max(1, len(os.sched_getaffinity(0)) // 2)))):
        cfg, _ = compose(["recipe=local_cpu", "io=realtime", f"io.max_sessions={sessions}"])
        assert ServerSpec.from_config(cfg.server).env["LLAMA_ARG_THREADS"] == threads, sessions  # many: half the cores
    cfg, choices = compose(["recipe=local_cpu"])
    assert (cfg.tts.threads, cfg.stt.cpu_threads, cfg.tts.first_clause_words) == ("auto", "auto", 4)
    plan(cfg, choices)
    cfg, choices = compose(["recipe=local_cpu", "server.env.LLAMA_ARG_THREADS=1"])
    assert ServerSpec.from_config(cfg.server).env["LLAMA_ARG_THREADS"] == "1"  # llama-server -t 1
    plan(cfg, choices)


@pytest.mark.parametrize("tts", ["espeak", "piper", "openai"])
def test_the_recipes_tts_budget_is_valid_for_any_tts_chosen_over_it(tts):
    cfg, choices = compose(["recipe=local_cpu", f"tts={tts}", "tts.api_key=x"] if tts == "openai"
                           else ["recipe=local_cpu", f"tts={tts}"])
    plan(cfg, choices)  # tts.threads and tts.first_clause_words are options of every TTS backend


def test_a_stage_budget_is_half_the_cores_and_auto_keeps_the_fewest_threads_that_are_as_fast():
    from nodes._calibrate import budget, calibrate

    assert budget(1) == budget(2) == budget(3) == [1]  # the LLM server and the other stage need the rest
    assert budget(4) == [1, 2] and budget(8) == [1, 2, 4] and budget(64) == [1, 2, 4, 8, 16]
    built: list[int] = []
    chosen, record = calibrate([1, 2], lambda n: built.append(n) or n, lambda n: sum(range(200_000)))
    assert built == [1, 2] and set(record["ms"]) == {"1", "2"}
    # the same work at both counts: within 10 % of each other, so the fewer threads win
    fastest = min(record["ms"].values())
    assert chosen == record["threads"] == next(n for n in (1, 2) if record["ms"][str(n)] <= fastest * 1.1)


def test_piper_times_its_threads_on_this_machine_and_the_trace_says_what_it_chose(tmp_path, monkeypatch):
    pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
    import nodes.tts.piper as piper_module
    from nodes.tts.piper import PiperTTS

    monkeypatch.setattr(piper_module, "budget", lambda: [1, 2])  # both counts timed, whatever the cores
    events: list[dict] = []
    node = PiperTTS(threads="auto", noise_scale=0.0, noise_w_scale=0.0)
    node.ctx = Context("tts", tmp_path, record=lambda kind, **f: events.append({"kind": kind, **f}))
    node.setup()
    [event] = [e for e in events if e["kind"] == "calibration"]
    assert event["stage"] == "tts" and event["option"] == "tts.threads" and set(event["ms"]) == {"1", "2"}
    assert node._voice.session.get_session_options().intra_op_num_threads == event["threads"]
    assert next(iter(node.synthesize("As fast as it can."))).size > 0


def test_whisper_auto_threads_come_from_the_budget_and_show_in_the_run_table(tmp_path):
    import io

    from rich.console import Console

    from nodes._calibrate import budget
    from nodes.stt.whisper import WhisperSTT
    from s2s_flow import metrics

    events: list[dict] = []
    node = WhisperSTT(cpu_threads="auto", window_s=10)
    node.ctx = Context("stt", tmp_path, record=lambda kind, **f: events.append({"kind": kind, "t": 0.0, **f}))
    node.setup()
    [event] = [e for e in events if e["kind"] == "calibration"]
    assert event["option"] == "stt.cpu_threads" and event["threads"] in budget()
    rep = {"events": events, "nodes": {}}
    report = metrics.report(rep)
    assert metrics.calibrated(report) == f"stt.cpu_threads={event['threads']}"
    assert report["calibration"]["stt"]["threads"] == event["threads"]
    assert metrics.figures(report)["calibration"] == f"stt.cpu_threads={event['threads']}"
    node.close()
    out = io.StringIO()
    metrics.show({**report, "turns": [{"turn": 1, "reply": True, "interrupted": False, "voice_to_voice_ms": 1.0}],
                  "warmup_excluded": False, "roles": {}}, Console(file=out, width=200))
    assert f"stt.cpu_threads={event['threads']}" in out.getvalue()
