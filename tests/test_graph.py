"""Graph wiring by port type, explicit edges, and validation before any model loads."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from s2s_flow.compose import compose
from s2s_flow.errors import ConfigError
from s2s_flow.graph import build_graph
from s2s_flow.scheduler import Scheduler
from s2s_flow.validate import check_params, validate

T = "tests.support.nodes."


def edges(graph) -> set[str]:
    return {e.key for e in graph.edges}


def test_the_default_chain_is_wired_by_port_types_with_taps_into_the_sink():
    cfg, choices = compose([])
    g = validate(build_graph(cfg, choices))
    assert edges(g) == {"source.audio -> vad.audio", "vad.speech -> stt.audio", "stt.text -> llm.text",
                        "llm.text -> tts.text", "tts.audio -> sink.audio", "stt.text -> sink.user",
                        "llm.text -> sink.agent",
                        # STT's optional input for the utterance while it grows: wired by type, it
                        # carries nothing unless stt.stream_ms > 0
                        "vad.growing -> stt.growing",
                        # the LLM hears that the user speaks again (a full history's trim, sent then)
                        "vad.started -> llm.started"}
    assert g.nodes["llm"].label == "llm=chat"


def test_ring_capacity_and_policy_default_by_type_and_can_be_set_per_edge():
    cfg, choices = compose(["+rings.tts.text.capacity=3", "+rings.tts.text.policy=drop_newest"])
    g = validate(build_graph(cfg, choices))
    by_key = {e.key: e for e in g.edges}
    assert (by_key["llm.text -> tts.text"].capacity, by_key["llm.text -> tts.text"].policy) == (3, "drop_newest")
    assert by_key["llm.text -> sink.agent"].policy == "block"  # only the named input changed
    assert by_key["vad.speech -> stt.audio"].capacity == 8


def test_explicit_edges_tee_transcripts_into_a_jsonl_sink_and_it_records_them(tmp_path):
    cfg = OmegaConf.create({
        "chain": ["src", "up", "out"],
        "src": {"_target_": T + "CountSource", "n": 3}, "up": {"_target_": T + "Upper"},
        "out": {"_target_": T + "Collect"},
        "nodes": {"log": {"_target_": "nodes.io.jsonl.JsonlSink", "path": "t.jsonl"}},
        "edges": ["src.text -> log.in"],
    })
    g = validate(build_graph(cfg))
    assert "src.text -> log.in" in edges(g) and "src.text -> up.text" in edges(g)
    Scheduler(g, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == [":0", ":1", ":2"] and rows[0]["type"] == "Transcript"


def test_an_explicit_edge_replaces_the_chain_edge_into_the_same_input():
    cfg = OmegaConf.create({
        "chain": ["src", "up", "out"],
        "src": {"_target_": T + "CountSource"}, "up": {"_target_": T + "Upper"},
        "out": {"_target_": T + "Collect"},
        "nodes": {"up2": {"_target_": T + "Upper"}},
        "edges": ["src.text -> up2.text", "up2.text -> out.text"],
    })
    g = validate(build_graph(cfg))
    assert "up.text -> out.text" not in edges(g) and "up2.text -> out.text" in edges(g)


def test_explicit_edges_with_incompatible_types_are_rejected():
    cfg = OmegaConf.create({
        "chain": ["src", "up", "out"],
        "src": {"_target_": T + "CountSource"}, "up": {"_target_": T + "Upper"},
        "out": {"_target_": T + "Collect"}, "edges": ["up.text -> up.text"],
    })
    with pytest.raises(ConfigError, match="produces TextDelta but up.text takes Transcript"):
        build_graph(cfg)


def test_unknown_node_parameters_get_a_did_you_mean():
    from nodes.io.wav import WavSink

    with pytest.raises(ConfigError, match=r"io.sink.outptu_dir is not an option of WavSink: did you mean "
                                          r"io.sink.output_dir\?"):
        check_params(WavSink, {"outptu_dir": "x"}, "io.sink")


def test_options_a_backend_forwards_to_its_base_class_are_checked_like_its_own():
    from nodes.llm.chat import ChatCompletionsLLM
    from nodes.llm.mlx import MLXLLM
    from nodes.llm.transformers import TransformersLLM

    check_params(ChatCompletionsLLM, {"base_url": "http://127.0.0.1:8080/v1", "keep_audio_turns": 2}, "llm")
    with pytest.raises(ConfigError, match=r"llm.base_ulr is not an option of ChatCompletionsLLM: did you mean "
                                          r"llm.base_url\?.*audio_content_type.*max_retries"):
        check_params(ChatCompletionsLLM, {"base_ulr": "x"}, "llm")
    with pytest.raises(ConfigError, match=r"llm.temperature='hot' has the wrong type: MLXLLM expects float"):
        check_params(MLXLLM, {"temperature": "hot"}, "llm")
    with pytest.raises(ConfigError, match=r"llm.max_token is not an option of TransformersLLM: did you mean "
                                          r"llm.max_tokens\?"):
        check_params(TransformersLLM, {"max_token": 3}, "llm")


def test_a_node_without_an_init_takes_no_options():
    from s2s_flow.node import Node

    class Bare(Node):  # no __init__ anywhere but object's
        pass

    with pytest.raises(ConfigError, match=r"x.size is not an option of Bare: it takes none"):
        check_params(Bare, {"size": 3}, "x")


def test_a_target_that_is_not_a_node_class_is_rejected():
    cfg = OmegaConf.create({"chain": ["x"], "x": {"_target_": "collections.OrderedDict"}})
    with pytest.raises(ConfigError, match="is not a s2s_flow Node subclass"):
        build_graph(cfg)
    cfg = OmegaConf.create({"chain": ["x"], "x": {"_target_": "nodes.llm.nope.Nope"}})
    with pytest.raises(ConfigError, match="names no importable node class"):
        build_graph(cfg)


def test_a_side_node_without_its_edges_names_the_edge_to_add_and_why_it_went_missing():
    """edges=[...] on the command line replaces the list io=mic adds for its partial transcriber."""
    cfg, choices = compose(["io=mic", "+nodes.log={_target_:nodes.io.jsonl.JsonlSink,path:t.jsonl}",
                            'edges=["stt.text -> log.in"]'])
    with pytest.raises(ConfigError) as err:
        validate(build_graph(cfg, choices))
    text = str(err.value)
    assert "nodes.partials is outside the chain" in text and "'source.audio -> partials.audio'" in text
    assert "replaces the whole list" in text
    cfg, choices = compose(["+nodes.log={_target_:nodes.io.jsonl.JsonlSink,path:t.jsonl}"])
    with pytest.raises(ConfigError) as err:
        validate(build_graph(cfg, choices))
    assert "nodes.log is outside the chain" in str(err.value) and "stt.text" in str(err.value)
    assert "replaces the whole list" not in str(err.value)  # no edges were given
