"""The latency benchmark's corpus: spoken prompts, synthesized once and cached by content.

``bench=latency`` hands the ``bench`` block to the WAV source (``io.source.corpus``), which
checks it when the graph is built and, in its ``setup()``, asks for the WAV files of the
prompts listed under ``bench.prompts``: one conversation each, the whole list played
``bench.repeat`` times. So a dry run synthesizes nothing. The files are made on first use
with the TTS node configured in ``bench.voice`` (Piper's en_US joe voice by default),
trimmed to the speech and padded with exact digital silence, so every file's true end of
speech is known; ``prompts.json`` beside them records it. They live in
``<cache>/corpus/<hash of texts + voice>/`` (cache: ``$S2S_FLOW_CACHE`` or
``~/.cache/s2s-flow``): editing a prompt or the voice makes a new corpus, nothing is ever
regenerated in place.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from s2s_flow.errors import ConfigError

__all__ = ["check", "corpus_dir", "build", "files", "manifest", "speech_bounds"]

FORMAT = 1  # bump when the way files are made changes: it is part of the hash
RATE = 16000


def check(bench: Any, key: str = "bench") -> dict[str, Any]:
    """The corpus spec from a ``bench`` block, checked without making anything (compose time):
    the prompts, the repeat count, and the voice's class and options."""
    spec = _spec(bench, key)
    _voice(spec, key)
    return spec


def _voice(spec: Mapping[str, Any], key: str) -> tuple[type, dict[str, Any]]:
    """The voice's node class and its checked options (the class is imported, nothing is built)."""
    from s2s_flow.graph import load_class
    from s2s_flow.validate import check_params

    voice = dict(spec["voice"])
    cls = load_class(str(voice.pop("_target_")), f"{key}.voice")
    check_params(cls, voice, f"{key}.voice")
    return cls, voice


def _spec(bench: Any, key: str) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(bench, DictConfig):
        bench = OmegaConf.to_container(bench, resolve=True)
    if not isinstance(bench, Mapping):
        raise ConfigError(f"{key} must be a mapping with prompts, voice and repeat "
                          f"(see conf/bench/latency.yaml), got {bench!r}")
    prompts = bench.get("prompts")
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ConfigError(f"{key}.prompts must be a non-empty list of sentences to speak, e.g. "
                          f"{key}.prompts='[What time is it?,Tell me a joke.]'")
    repeat = bench.get("repeat", 1)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ConfigError(f"{key}.repeat={repeat!r} must be a whole number >= 1 (times the corpus is played)")
    voice = bench.get("voice")
    if not isinstance(voice, Mapping) or not voice.get("_target_"):
        raise ConfigError(f"{key}.voice must be a TTS node config with a _target_, e.g. "
                          "{_target_: nodes.tts.piper.PiperTTS}")
    lead, tail = float(bench.get("lead_silence_s", 0.5)), float(bench.get("tail_silence_s", 0.5))
    if lead < 0 or tail < 0:
        raise ConfigError(f"{key}.lead_silence_s and {key}.tail_silence_s must be >= 0 (seconds)")
    return {"prompts": [p.strip() for p in prompts], "voice": dict(voice), "repeat": repeat,
            "lead_silence_s": lead, "tail_silence_s": tail}


def corpus_dir(spec: Mapping[str, Any]) -> Path:
    """Where this corpus lives: its name is a hash of everything that shapes the audio."""
    from s2s_flow.llama_server import cache_dir  # the cache root shared with the llama-server build

    shaping = {k: spec[k] for k in ("prompts", "voice", "lead_silence_s", "tail_silence_s")}
    digest = hashlib.sha256(json.dumps({**shaping, "rate": RATE, "format": FORMAT},
                                       sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "corpus" / digest


def manifest(directory: Path | str) -> dict[str, Any]:
    """``prompts.json`` of a built corpus: each file's text and its true speech start/end (s)."""
    return json.loads((Path(directory) / "prompts.json").read_text())


def build(bench: Any, key: str = "bench") -> Path:
    """The corpus directory, synthesized first if it is not in the cache yet."""
    spec = _spec(bench, key)
    target = corpus_dir(spec)
    if (target / "prompts.json").is_file():
        return target
    from s2s_flow.llama_server import _file_lock

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_suffix(".lock")):  # parallel sweep jobs start together: one builds
        if not (target / "prompts.json").is_file():  # another process may have made it meanwhile
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                _synthesize(spec, tmp, key)
                tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by others
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def files(bench: Any, key: str = "bench") -> list[str]:
    """The corpus's files in playing order: every prompt once, ``repeat`` times over."""
    spec = _spec(bench, key)
    directory = build(spec, key)  # a stat when it is cached
    entries = manifest(directory)["files"]
    return [str(directory / e["file"]) for _ in range(spec["repeat"]) for e in entries]


def _slug(text: str) -> str:
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())[:4]) or "prompt"


def _synthesize(spec: Mapping[str, Any], out: Path, key: str) -> None:
    import numpy as np
    import soundfile as sf

    from s2s_flow.audio import resample
    from s2s_flow.messages import TextDelta
    from s2s_flow.node import Context

    cls, voice = _voice(spec, key)
    node = cls(**voice)
    node.ctx = Context("corpus", out)
    print(f"s2s-flow: synthesizing the benchmark corpus once ({len(spec['prompts'])} prompts, "
          f"{cls.__name__}) into {out.parent}", file=sys.stderr)
    node.setup()
    entries = []
    try:
        for i, text in enumerate(spec["prompts"], 1):
            pieces = [(m.pcm, m.rate) for m in node.process("text", TextDelta(turn=1, text=text, end=True))
                      if len(m.pcm)]
            if not pieces:
                raise ConfigError(f"{key}.voice ({cls.__name__}) produced no audio for prompt {i}: {text!r}")
            pcm = resample(np.concatenate([p for p, _ in pieces]).astype(np.float32), pieces[0][1], RATE)
            start, end = speech_bounds(pcm, RATE)
            speech = pcm[start:end]
            speech = speech * (0.5 / max(float(np.abs(speech).max()), 1e-6))  # -6 dBFS peak: mic-like headroom
            lead = np.zeros(round(spec["lead_silence_s"] * RATE), np.float32)
            tail = np.zeros(round(spec["tail_silence_s"] * RATE), np.float32)
            name = f"{i:02d}-{_slug(text)}.wav"
            sf.write(str(out / name), np.concatenate([lead, speech, tail]), RATE, subtype="PCM_16")
            entries.append({"file": name, "text": text, "speech_start_s": len(lead) / RATE,
                            "speech_end_s": (len(lead) + len(speech)) / RATE,
                            "duration_s": (len(lead) + len(speech) + len(tail)) / RATE})
    finally:
        node.close()
    (out / "prompts.json").write_text(json.dumps(
        {"format": FORMAT, "rate": RATE, "voice": spec["voice"], "files": entries}, indent=1))


def speech_bounds(pcm: Any, rate: int, floor_db: float = -40.0) -> tuple[int, int]:
    """First and last sample of audible speech: 10 ms frames louder than ``floor_db`` below the peak."""
    import numpy as np

    frame = rate // 100
    n = len(pcm) // frame
    if n == 0:
        return 0, len(pcm)
    rms = np.sqrt(np.mean(pcm[: n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    loud = np.flatnonzero(20 * np.log10(rms / rms.max()) > floor_db)
    if not len(loud):
        return 0, len(pcm)
    return int(loud[0] * frame), int(min(len(pcm), (loud[-1] + 1) * frame))
