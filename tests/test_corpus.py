"""bench=latency: the spoken corpus is synthesized once by the WAV source's setup, cached by
content, the same bytes when made again, and played N times."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from nodes.io.wav import SAMPLES, WavSource
from nodes.tts.piper import PiperTTS
from s2s_flow.compose import compose
from s2s_flow.corpus import manifest
from s2s_flow.errors import ConfigError
from s2s_flow.graph import build_graph
from s2s_flow.node import Context
from s2s_flow.validate import validate

ROOT = Path(__file__).resolve().parents[1]
# Piper without its sampled noise: the same samples on every call. (espeak-ng is no corpus voice:
# each call's audio depends on what the process spoke before.)
PIPER = {"_target_": "nodes.tts.piper.PiperTTS", "noise_scale": 0, "noise_w_scale": 0}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def files(bench: dict[str, Any], run_dir: Path) -> list[Path]:
    """What a WAV source plays for this bench block once its setup() ran."""
    source = WavSource(corpus=bench)
    source.ctx = Context("source", run_dir)
    source.setup()
    return source.files


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


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
    assert source.corpus_dir == corpus
    info = manifest(corpus)
    assert info["voice"] == PIPER
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


def test_the_corpus_is_made_once_and_a_new_text_makes_a_new_one(cache: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    setups = []
    real_setup = PiperTTS.setup
    monkeypatch.setattr(PiperTTS, "setup", lambda self: (setups.append(self), real_setup(self))[1])
    bench = {"prompts": ["Hi there.", "What time is it?"], "voice": PIPER, "repeat": 1}
    first = files(bench, tmp_path)
    stamp = first[0].stat().st_mtime_ns
    assert len(setups) == 1
    assert files(dict(bench), tmp_path) == first and first[0].stat().st_mtime_ns == stamp
    assert len(setups) == 1  # cached: the voice is not even set up
    other = files({**bench, "prompts": ["Hi there.", "What day is it?"]}, tmp_path)
    assert other[0].parent != first[0].parent and len(setups) == 2
    assert json.loads((other[0].parent / "prompts.json").read_text())["files"][1]["text"] == "What day is it?"


def test_the_bench_corpus_is_the_same_bytes_when_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The bench=latency voice (Piper, no noise) made into two empty caches: identical files."""
    cfg, _ = compose(["bench=latency"])
    bench = {**dict(cfg.bench), "voice": dict(cfg.bench.voice), "prompts": list(cfg.bench.prompts[:3])}
    made = []
    for name in ("one", "two"):
        monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / name))
        made.append(files(bench, tmp_path)[0].parent)
    assert made[0] != made[1] and made[0].name == made[1].name  # same content hash, separate caches
    assert digests(made[0]) == digests(made[1])
    assert len(digests(made[0])) == 4  # three prompts and prompts.json


def test_a_voice_that_speaks_differently_each_time_is_refused(cache: Path, tmp_path: Path):
    noisy = {"_target_": "nodes.tts.piper.PiperTTS"}  # Piper's default: noise sampled inside the model
    bench = {"prompts": ["Can you tell me a short joke?"], "voice": noisy, "repeat": 1}
    with pytest.raises(ConfigError, match=r"bench.voice \(nodes.tts.piper.PiperTTS\) spoke .* differently twice.*"
                                          r"bench.voice.noise_scale=0 bench.voice.noise_w_scale=0"):
        files(bench, tmp_path)
    assert [p.name for p in (cache / "corpus").iterdir() if not p.name.startswith(".")] == []  # nothing kept


def test_a_dry_run_of_bench_latency_synthesizes_nothing(tmp_path: Path):
    code = ("import sys; sys.argv=['s2s-run','bench=latency','dry_run=true']; from s2s_flow.cli import main; "
            "main(); print('HEAVY', [m for m in ('piper', 'onnxruntime') if m in sys.modules])")
    env = {**os.environ, "S2S_FLOW_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout and "source.audio -> vad.audio" in out.stdout
    assert not (tmp_path / "cache").exists()


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
        WavSource(corpus={"prompts": ["Hi."], "voice": PIPER, "repeat": 1, **change})


def test_bench_hesitation_pauses_each_prompt_mid_sentence_as_long_as_asked(cache: Path, tmp_path: Path):
    from nodes.tts.hesitant import _quiet_runs, pause_of

    cfg, choices = compose(["bench=hesitation"])
    graph = validate(build_graph(cfg, choices))
    source = graph.nodes["source"].node
    source.ctx = Context("source", tmp_path)
    source.setup()
    info = manifest(source.corpus_dir)
    assert cfg.io.realtime is True and len(info["files"]) == 12
    assert info["voice"]["speaker"] == "nodes.tts.piper.PiperTTS" and info["voice"]["noise_scale"] == 0
    for entry in info["files"]:
        text, pause_ms = pause_of(entry["text"])
        assert 400 <= pause_ms <= 700 and "," in text
        pcm, rate = sf.read(source.corpus_dir / entry["file"], dtype="float32")
        speech = pcm[round(entry["speech_start_s"] * rate):round(entry["speech_end_s"] * rate)]
        start, length = max(_quiet_runs(speech, rate), key=lambda r: r[1])
        assert length / rate == pytest.approx(pause_ms / 1000, abs=0.02), entry["text"]
        assert 0.15 < start / len(speech) < 0.85  # inside the sentence: words on both sides


def test_the_hesitant_voice_speaks_text_without_a_pause_as_its_speaker_does(tmp_path: Path):
    from nodes.tts.hesitant import HesitantVoice
    from s2s_flow.messages import AudioOut, TextDelta

    def speak(node, text: str) -> np.ndarray:
        node.ctx = Context("voice", tmp_path)
        node.setup()
        try:
            out = [m.pcm for m in node.process("text", TextDelta(turn=1, text=text, end=True))
                   if isinstance(m, AudioOut) and len(m.pcm)]
        finally:
            node.close()
        return np.concatenate(out)

    options = {"noise_scale": 0, "noise_w_scale": 0}
    plain = speak(PiperTTS(**options), "Set a timer for twenty minutes please.")
    assert np.array_equal(speak(HesitantVoice(**options), "Set a timer for twenty minutes please."), plain)
    longer = speak(HesitantVoice(**options), "Set a timer for, [700 ms] twenty minutes please.")
    assert len(longer) > len(plain) + 0.3 * 22050  # the pause, much longer than the comma's


def test_a_hesitant_voice_checks_its_speakers_options_and_pauses():
    from nodes.tts.hesitant import HesitantVoice, pause_of

    with pytest.raises(ConfigError, match=r"bench.voice.noise_scal is not an option of PiperTTS: did you mean "
                                          r"bench.voice.noise_scale\?"):
        HesitantVoice(noise_scal=0)
    with pytest.raises(ConfigError, match="asks for 2 pauses; a prompt hesitates once"):
        pause_of("Set a, [400 ms] timer for, [500 ms] ten minutes.")
    assert pause_of("What time is it?") == ("What time is it?", None)
