"""Metrics of real runs on real speech: a scripted conversation whose speech ends are known.

Piper speaks three utterances separated by digital silence; the file is played in real
time through Silero VAD (and, in the last test, Whisper, SmolLM2 in llama-server and
Piper). The true end of each utterance is known to the sample, and the VAD's own estimate
of it is known by running the same node on the same chunks outside the engine, so the
error of the metrics' end of speech splits into the VAD's share and the engine's.
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

from tests.support.speech import speech_with_pauses

VAD_WINDOW_S = 512 / 16000  # 32 ms
CHUNK_S = 0.020  # io.chunk_ms
JITTER_S = 0.016  # the paced source's wake-up jitter (about 2 ms on an idle machine)
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


def playback_start(trace: dict) -> float:
    """When the file started to play (s since the run start): in real time the first 20 ms
    chunk leaves the source once it has been 'recorded', 20 ms after the start."""
    return trace["nodes"]["source"]["0"]["first_out"] - CHUNK_S


def vad_stream_ends(path: Path) -> list[float]:
    """Silero's own end-of-speech estimates for the file, in stream seconds: the same node,
    fed the same 20 ms chunks (stamped with stream time) outside the engine."""
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
        ends += [m.speech_end_t for m in vad.process("audio", chunk) if isinstance(m, Speech)]
    return ends


@pytest.fixture(scope="module")
def vad_only_run(conversation, tmp_path_factory: pytest.TempPathFactory) -> dict:
    path, _ = conversation
    return s2s_run(tmp_path_factory.mktemp("vad-run"), "chain=[io.source,vad]", f"io.input={path}",
                   "io.realtime=true")


def test_metrics_end_of_speech_is_the_vads_estimate_on_the_wall_clock(conversation, vad_only_run):
    """What the engine and the metrics add to the VAD's own estimate: scheduling jitter only."""
    path, _ = conversation
    turns = vad_only_run["metrics"]["turns"]
    expected = vad_stream_ends(path)
    assert len(turns) == len(expected) == len(UTTERANCES)
    start = playback_start(vad_only_run["trace"])
    errors = [t["speech_end_s"] - (start + e) for t, e in zip(turns, expected, strict=True)]
    assert all(abs(e) <= JITTER_S for e in errors), f"errors (s): {errors}"
    for t in turns:  # the VAD lets go after its 500 ms hangover, counted from the first silent window
        # (1-3 windows after the true end: Silero's lag and decay), rounded up to whole windows
        assert 500 <= t["vad_ms"] <= 500 + 4 * VAD_WINDOW_S * 1000


def test_speech_end_is_within_one_vad_window_of_the_truth(conversation, vad_only_run):
    path, ends = conversation
    # Silero's own estimate, from the audio alone: measured 10, 10 and 22 ms late on this
    # speech (deterministic audio: tests/support/speech.py); at most 30 ms over 8 draws
    # of Piper's noise. Within one window, as its decisions are made window by window.
    own = [e - end for e, end in zip(vad_stream_ends(path), ends, strict=True)]
    assert all(abs(e) <= VAD_WINDOW_S for e in own), f"Silero's errors (s): {own}"
    turns = vad_only_run["metrics"]["turns"]
    assert len(turns) == len(ends)
    start = playback_start(vad_only_run["trace"])
    errors = [t["speech_end_s"] - (start + end) for t, end in zip(turns, ends, strict=True)]
    # the engine adds the paced source's wake-up jitter (the test above bounds it)
    assert all(abs(e) <= VAD_WINDOW_S + JITTER_S for e in errors), f"errors (s): {errors}"


def test_latencies_of_the_offline_stack_are_measured_from_the_end_of_speech(conversation, tmp_path: Path,
                                                                          smollm2_server: str):
    path, _ = conversation
    run = s2s_run(tmp_path / "run", "llm=chat", f"llm.base_url={smollm2_server}/v1", "llm.max_tokens=40",
                  "llm.temperature=0", "stt=whisper", "tts=piper", "server=null",
                  f"io.input={path}", "io.realtime=true")
    rep, trace = run["metrics"], run["trace"]
    turns = rep["turns"]
    expected = vad_stream_ends(path)
    assert len(turns) == len(expected) == len(UTTERANCES)
    start = playback_start(trace)
    sink = trace["nodes"]["sink"]
    for t, end in zip(turns, expected, strict=True):
        # a loaded CPU (all stages on 2 cores) delays the paced source's wake-ups a little more
        assert abs(t["speech_end_s"] - (start + end)) <= VAD_WINDOW_S
        # voice-to-voice: the first reply audio at the sink minus the end of speech
        first_audio = sink[str(t["turn"])]["marks"]["in:audio"]
        assert t["voice_to_voice_ms"] == pytest.approx((first_audio - t["speech_end_s"]) * 1000, abs=0.2)
        chain = [t[k] for k in ("vad_ms", "stt_ms", "llm_first_token_ms", "llm_first_sentence_ms",
                                "tts_first_audio_ms", "voice_to_voice_ms")]
        assert chain == sorted(chain) and chain[0] >= 500, chain
        parts = sum(t[k] for k in ("stage_vad_ms", "stage_stt_ms", "stage_llm_ms", "stage_tts_ms", "ring_wait_ms"))
        assert parts == pytest.approx(t["voice_to_voice_ms"], abs=0.5)
    assert rep["warmup_turn"] == turns[0]["turn"] and rep["summary"]["voice_to_voice_ms"]["n"] == 2
    assert "voice-to-voice" in run["stderr"] and "warm-up" in run["stderr"]
