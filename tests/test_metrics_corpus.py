"""bench=latency: the spoken corpus is synthesized once, cached by content, played N times."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from nodes.io.wav import SAMPLES
from s2s_flow.compose import compose
from s2s_flow.corpus import files, manifest
from s2s_flow.errors import ConfigError
from s2s_flow.graph import build_graph
from s2s_flow.node import Context
from s2s_flow.validate import validate

ESPEAK = {"_target_": "nodes.tts.espeak.EspeakTTS"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_bench_latency_plays_the_piper_corpus_in_real_time(cache: Path, tmp_path: Path):
    cfg, choices = compose(["bench=latency", "bench.repeat=2"])
    graph = validate(build_graph(cfg, choices))
    assert not cache.exists()  # building and checking the graph (a dry run) synthesizes nothing
    source = graph.nodes["source"].node
    source.ctx = Context("source", tmp_path)
    source.setup()
    inputs = [str(f) for f in source.files]
    prompts = list(cfg.bench.prompts)
    assert len(prompts) >= 10 and any("in detail" in p for p in prompts)  # one invites a long answer
    assert len(inputs) == 2 * len(prompts) and inputs[: len(prompts)] == inputs[len(prompts):]
    assert len(set(source.sessions())) == len(inputs)  # each playing is its own conversation
    assert cfg.io.realtime is True and cfg.metrics.timeline is True
    corpus = Path(inputs[0]).parent
    assert corpus.parent == cache / "corpus"
    info = manifest(corpus)
    assert info["voice"] == {"_target_": "nodes.tts.piper.PiperTTS"}
    assert [e["text"] for e in info["files"]] == prompts
    durations = [e["speech_end_s"] - e["speech_start_s"] for e in info["files"]]
    assert min(durations) < 1.0 < 4.0 < max(durations)  # from "Hello!" to a long question
    for entry in info["files"]:
        pcm, rate = sf.read(corpus / entry["file"], dtype="float32")
        assert rate == 16000 and len(pcm) / rate == pytest.approx(entry["duration_s"])
        loud = np.flatnonzero(np.abs(pcm) > 1e-3)
        # digital silence around the speech: its true start and end are known to 10 ms
        assert loud[0] / rate == pytest.approx(entry["speech_start_s"], abs=0.011)
        assert loud[-1] / rate == pytest.approx(entry["speech_end_s"], abs=0.011)


def test_the_corpus_is_made_once_and_a_new_text_makes_a_new_one(cache: Path):
    bench = {"prompts": ["Hi there.", "What time is it?"], "voice": ESPEAK, "repeat": 1}
    first = files(bench)
    stamp = Path(first[0]).stat().st_mtime_ns
    assert files(dict(bench)) == first and Path(first[0]).stat().st_mtime_ns == stamp
    other = files({**bench, "prompts": ["Hi there.", "What day is it?"]})
    assert Path(other[0]).parent != Path(first[0]).parent
    assert json.loads((Path(other[0]).parent / "prompts.json").read_text())["files"][1]["text"] == "What day is it?"


def test_a_corpus_and_an_input_file_together_are_an_answer():
    cfg, choices = compose(["bench=latency", f"io.input={SAMPLES / 'italy.wav'}"])
    with pytest.raises(ConfigError, match="io.input=.* and bench=latency both name the audio to play"):
        validate(build_graph(cfg, choices))


def test_a_typo_in_the_corpus_voice_is_caught_before_anything_is_synthesized(cache: Path):
    cfg, choices = compose(["bench=latency", "+bench.voice.speker=3"])
    with pytest.raises(ConfigError, match=r"bench.voice.speker is not an option of PiperTTS: did you mean "
                                          r"bench.voice.speaker\?"):
        validate(build_graph(cfg, choices))
    assert not cache.exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"repeat": 0}, "bench.repeat=0 must be a whole number >= 1"),
    ({"prompts": []}, "bench.prompts must be a non-empty list"),
    ({"voice": None}, "bench.voice must be a TTS node config"),
])
def test_a_bad_bench_block_is_an_answer(cache: Path, change: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        files({"prompts": ["Hi."], "voice": ESPEAK, "repeat": 1, **change})
