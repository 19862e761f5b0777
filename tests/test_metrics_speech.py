"""Metrics of real runs on real speech: a scripted conversation whose speech ends are known.

Piper speaks three utterances separated by digital silence; the file is played in real
time through Silero VAD (and, in the last test, Whisper, SmolLM2 in llama-server and
Piper). The true end of each utterance is known to the sample, and the VAD's own estimate
of it is known by running the same node on the same chunks outside the engine, so the
error of the metrics' end of speech splits into the VAD's share and the engine's. The
engine's share is checked exactly (each chunk's own time stamp places the VAD's estimate
on the run's clock), never against a bound on how late a paced chunk may be: that jitter
depends on the machine's load, and benchmarks/bench_timing.py prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from omegaconf import OmegaConf

from tests.support.speech import speech_with_pauses

VAD_WINDOW_S = 512 / 16000  # 32 ms
CHUNK_S = 0.020  # io.chunk_ms
UTTERANCES = ["What is the weather like today?", "Tell me a joke about cats.", "Thank you very much."]


@pytest.fixture(scope="module")
def conversation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The WAV file and each utterance's true end (s from the start of the file)."""
    pcm, truth = speech_with_pauses(UTTERANCES, 16000, pause_s=1.6, lead_s=0.6, tail_s=0.3)
    path = tmp_path_factory.mktemp("conversation") / "scripted.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    return path, [end for _, end in truth]


def s2s_run(run_dir: Path, *overrides: str, timeout: float = 300) -> dict:
    env = {**os.environ, "S2S_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "s2s_flow.cli", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"metrics": json.loads((run_dir / "metrics.json").read_text()),
            "trace": json.loads((run_dir / "trace.json").read_text()), "stderr": proc.stderr}


def vad_stream_ends(path: Path) -> list[tuple[float, float]]:
    """Silero's own end-of-speech estimates for the file, in stream seconds, each with the end of
    the chunk it was decided in: the same node, fed the same 20 ms chunks (stamped with stream
    time) outside the engine."""
    from nodes.vad.silero import SileroVAD
    from s2s_flow.messages import AudioChunk, Speech
    from s2s_flow.node import Context

    vad = SileroVAD()
    vad.ctx = Context("vad", path.parent)
    vad.setup()
    pcm, rate = sf.read(path, dtype="float32")
    pcm = np.concatenate([pcm, np.zeros(rate, np.float32)])  # io's tail silence
    step = round(CHUNK_S * rate)
    ends = []
    for i in range(0, len(pcm), step):
        chunk = AudioChunk(pcm=pcm[i:i + step], rate=rate, start=i / rate, t=(i + step) / rate)
        ends += [(m.speech_end_t, (i + step) / rate) for m in vad.process("audio", chunk) if isinstance(m, Speech)]
    return ends


@pytest.fixture(scope="module")
def vad_only_run(conversation, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The file through the engine in real time (source -> VAD), with a node beside the VAD that
    keeps the time stamp of every chunk the source made: the metrics, and those stamps on the
    run's clock (seconds since its start)."""
    from s2s_flow import metrics
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from s2s_flow.scheduler import Scheduler

    path, _ = conversation
    cfg, choices = compose(["chain=[io.source,vad]", f"io.input={path}", "io.realtime=true"])
    cfg.nodes = OmegaConf.create({"chunks": {"_target_": "tests.support.nodes.ChunkTimes"}})
    cfg.edges = ["source.audio -> chunks.audio"]
    scheduler = Scheduler(plan(cfg, choices), tmp_path_factory.mktemp("vad-run"))
    trace = scheduler.run()
    made = scheduler.graph.nodes["chunks"].node.made
    return {"metrics": metrics.report(trace, scheduler.ring_stats, scheduler.graph),
            "chunk_t": {start: t - trace.t0 for start, t in made.items()}}


def stream_time_of(run: dict, decided_at: float) -> float:
    """Where the run's clock stood at stream time 0, as the chunk that ends at ``decided_at``
    (stream s) tells it: that chunk's time stamp minus its end in the stream."""
    return run["chunk_t"][round(decided_at - CHUNK_S, 6)] - decided_at


def test_metrics_end_of_speech_is_the_vads_estimate_placed_on_the_run_clock(conversation, vad_only_run):
    """What the engine and the metrics add to the VAD's own estimate: only the time stamp of the
    chunk the VAD decided in, which places its stream estimate on the run's clock."""
    path, _ = conversation
    turns = vad_only_run["metrics"]["turns"]
    expected = vad_stream_ends(path)
    assert len(turns) == len(expected) == len(UTTERANCES)
    for t, (end, decided_at) in zip(turns, expected, strict=True):
        # the same estimate, decided in the same chunk as outside the engine; the trace rounds to 1 us
        assert t["speech_end_s"] == pytest.approx(stream_time_of(vad_only_run, decided_at) + end, abs=2e-6)
    for t in turns:  # the VAD lets go after its 500 ms hangover, counted from the first silent window
        # (1-3 windows after the true end: Silero's lag and decay), rounded up to whole windows
        assert 500 <= t["vad_ms"] <= 500 + 4 * VAD_WINDOW_S * 1000


def test_speech_end_is_within_one_vad_window_of_the_truth(conversation, vad_only_run):
    path, ends = conversation
    # Silero's own estimate, from the audio alone: measured 10, 10 and 22 ms late on this
    # speech (deterministic audio: tests/support/speech.py); at most 30 ms over 8 draws
    # of Piper's noise. Within one window, as its decisions are made window by window.
    estimates = vad_stream_ends(path)
    own = [e - end for (e, _), end in zip(estimates, ends, strict=True)]
    assert all(abs(e) <= VAD_WINDOW_S for e in own), f"Silero's errors (s): {own}"
    turns = vad_only_run["metrics"]["turns"]
    assert len(turns) == len(ends)
    # the metrics' end of speech, back in stream time by the chunk that decided it, is as close
    errors = [t["speech_end_s"] - stream_time_of(vad_only_run, decided_at) - end
              for t, (_, decided_at), end in zip(turns, estimates, ends, strict=True)]
    assert all(abs(e) <= VAD_WINDOW_S for e in errors), f"errors (s): {errors}"


def test_latencies_of_the_offline_stack_are_measured_from_the_end_of_speech(conversation, tmp_path: Path,
                                                                          smollm2_server: str):
    path, _ = conversation
    run = s2s_run(tmp_path / "run", "llm=chat", f"llm.base_url={smollm2_server}/v1", "llm.max_tokens=40",
                  "llm.temperature=0", "stt=whisper", "tts=piper", "server=null",
                  "io.sink._target_=tests.support.nodes.StampedWavSink", f"io.input={path}", "io.realtime=true")
    rep, trace = run["metrics"], run["trace"]
    turns = rep["turns"]
    assert len(turns) == len(UTTERANCES)
    # the sink's own stamp of each reply's first audio, taken as it handled it
    heard = {e["turn"]: e["t"] for e in trace["events"] if e["kind"] == "sink_first_audio"}
    for t in turns:
        # voice-to-voice ends when the first reply audio reached the sink: the engine notes its arrival
        # just before the sink handles it (the same batch: within a few ms, 50 on a busy machine;
        # the report rounds voice-to-voice to 0.1 ms)
        reached = t["speech_end_s"] + t["voice_to_voice_ms"] / 1000
        assert reached <= heard[t["turn"]] + 1e-4 and heard[t["turn"]] - reached < 0.05, (t, heard)
        chain = [t[k] for k in ("vad_ms", "stt_ms", "llm_first_token_ms", "llm_first_sentence_ms",
                                "tts_first_audio_ms", "voice_to_voice_ms")]
        assert chain == sorted(chain) and chain[0] >= 500, chain
        parts = sum(t[k] for k in ("stage_vad_ms", "stage_stt_ms", "stage_llm_ms", "stage_tts_ms", "ring_wait_ms"))
        assert parts == pytest.approx(t["voice_to_voice_ms"], abs=0.5)
    assert rep["warmup_turn"] == turns[0]["turn"] and rep["summary"]["voice_to_voice_ms"]["n"] == 2
    assert "voice-to-voice" in run["stderr"] and "warm-up" in run["stderr"]
