"""CPU budget: each stage's thread count comes from config and reaches the engine that runs it;
recipe=local_cpu sets them, and the first clause, for the 2-core offline stack."""

from __future__ import annotations

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
    assert (cfg.tts.threads, cfg.tts.first_clause_words) == (1, 4)
    plan(cfg, choices)
    cfg, choices = compose(["recipe=local_cpu", "server.env.LLAMA_ARG_THREADS=1"])
    assert ServerSpec.from_config(cfg.server).env["LLAMA_ARG_THREADS"] == "1"  # llama-server -t 1
    plan(cfg, choices)


@pytest.mark.parametrize("tts", ["espeak", "piper", "openai"])
def test_the_recipes_tts_budget_is_valid_for_any_tts_chosen_over_it(tts):
    cfg, choices = compose(["recipe=local_cpu", f"tts={tts}", "tts.api_key=x"] if tts == "openai"
                           else ["recipe=local_cpu", f"tts={tts}"])
    plan(cfg, choices)  # tts.threads and tts.first_clause_words are options of every TTS backend
