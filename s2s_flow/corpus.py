"""The latency benchmark's corpus: spoken prompts, synthesized once and cached by content.

``bench=latency`` hands the ``bench`` block to the WAV source (``io.source.corpus``). The
source checks it when the graph is built (:func:`check`: the prompts, the repeat count, the
voice's class and options) and builds the voice, a TTS node, like any node: cheaply. Its
``setup()`` asks :func:`build` for the corpus directory, and only if that is not cached yet
does the voice get set up and speak; so a dry run synthesizes nothing, and this module never
builds or runs a node itself. Each prompt becomes one file, trimmed to the speech and padded
with exact digital silence, so its true end of speech is known; ``prompts.json`` beside the
files records it. The voice must be deterministic (Piper with ``noise_scale=0`` and
``noise_w_scale=0``, as in conf/bench/latency.yaml): the first prompt is spoken twice and a
difference is an error, so a corpus made again is the same bytes. Corpora live in
``<cache>/corpus/<hash of texts + voice + FORMAT>/`` (``s2s_flow.cache``); editing a prompt or
the voice makes a new one, nothing is ever regenerated in place.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from s2s_flow.cache import cache_dir, make_once
from s2s_flow.errors import ConfigError

__all__ = ["check", "voice", "corpus_dir", "build", "files", "manifest", "speech_bounds", "Speak"]

# Bump when the way files are made changes: it is part of the hash. 2: the voice must speak
# the same audio twice (format 1 corpora were made by Piper with its default noise).
FORMAT = 2
RATE = 16000

#: the voice at work: speaks each text in order, yielding (mono PCM, sample rate) per text
Speak = Callable[[Sequence[str]], Iterable[tuple[Any, int]]]


def check(bench: Any, key: str = "bench") -> dict[str, Any]:
    """The corpus spec from a ``bench`` block, checked without making anything (compose time):
    the prompts, the repeat count, and the voice's class and options."""
    spec = _spec(bench, key)
    voice(spec, key)
    return spec


def voice(spec: Mapping[str, Any], key: str = "bench") -> tuple[type, dict[str, Any]]:
    """The voice's node class and its checked options (the class is imported, nothing is built)."""
    from s2s_flow.graph import load_class
    from s2s_flow.validate import check_params

    options = dict(spec["voice"])
    cls = load_class(str(options.pop("_target_")), f"{key}.voice")
    check_params(cls, options, f"{key}.voice")
    return cls, options


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
    speaker = bench.get("voice")
    if not isinstance(speaker, Mapping) or not speaker.get("_target_"):
        raise ConfigError(f"{key}.voice must be a TTS node config with a _target_, e.g. "
                          "{_target_: nodes.tts.piper.PiperTTS}")
    lead, tail = float(bench.get("lead_silence_s", 0.5)), float(bench.get("tail_silence_s", 0.5))
    if lead < 0 or tail < 0:
        raise ConfigError(f"{key}.lead_silence_s and {key}.tail_silence_s must be >= 0 (seconds)")
    return {"prompts": [p.strip() for p in prompts], "voice": dict(speaker), "repeat": repeat,
            "lead_silence_s": lead, "tail_silence_s": tail}


def corpus_dir(spec: Mapping[str, Any]) -> Path:
    """Where this corpus lives: its name is a hash of everything that shapes the audio."""
    shaping = {k: spec[k] for k in ("prompts", "voice", "lead_silence_s", "tail_silence_s")}
    digest = hashlib.sha256(json.dumps({**shaping, "rate": RATE, "format": FORMAT},
                                       sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "corpus" / digest


def manifest(directory: Path | str) -> dict[str, Any]:
    """``prompts.json`` of a built corpus: each file's text and its true speech start/end (s)."""
    return json.loads((Path(directory) / "prompts.json").read_text())


def build(spec: Mapping[str, Any], speak: Speak, key: str = "bench") -> Path:
    """The corpus directory; ``speak`` is called only when it is not cached yet.

    Parallel sweep jobs start together: one synthesizes, the others wait for it.
    """
    return make_once(corpus_dir(spec), lambda out: _synthesize(spec, speak, out, key), marker="prompts.json")


def files(directory: Path, repeat: int = 1) -> list[Path]:
    """A built corpus's files in playing order: every prompt once, ``repeat`` times over."""
    entries = manifest(directory)["files"]
    return [Path(directory) / e["file"] for _ in range(repeat) for e in entries]


def _slug(text: str) -> str:
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())[:4]) or "prompt"


def _synthesize(spec: Mapping[str, Any], speak: Speak, out: Path, key: str) -> None:
    import numpy as np

    prompts, target = spec["prompts"], spec["voice"]["_target_"]
    print(f"s2s-flow: synthesizing the benchmark corpus once ({len(prompts)} prompts, {target}) "
          f"into {out.parent}", file=sys.stderr)
    spoken = iter(speak([prompts[0], *prompts]))  # the first one twice: is the voice deterministic?
    entries = []
    try:
        first = next(spoken, None)
        for i, text in enumerate(prompts, 1):
            audio = next(spoken, None)
            if audio is None or not len(audio[0]):
                raise ConfigError(f"{key}.voice ({target}) produced no audio for prompt {i}: {text!r}")
            if i == 1 and (first is None or first[1] != audio[1] or not np.array_equal(first[0], audio[0])):
                raise ConfigError(
                    f"{key}.voice ({target}) spoke {text!r} differently twice, so the corpus would not be the "
                    f"same when made again: give it options that make it deterministic (Piper: {key}.voice."
                    f"noise_scale=0 {key}.voice.noise_w_scale=0, as in conf/bench/latency.yaml), or another voice")
            entries.append(_write(spec, *audio, f"{i:02d}-{_slug(text)}.wav", text, out))
    finally:
        close = getattr(spoken, "close", None)
        if close is not None:
            close()  # a generator's cleanup (the voice's close()) runs now, not at garbage collection
    (out / "prompts.json").write_text(json.dumps(
        {"format": FORMAT, "rate": RATE, "voice": spec["voice"], "files": entries}, indent=1))


def _write(spec: Mapping[str, Any], pcm: Any, rate: int, name: str, text: str, out: Path) -> dict[str, Any]:
    """One prompt's file: the speech alone at -6 dBFS peak, between stretches of digital silence."""
    import numpy as np
    import soundfile as sf

    from s2s_flow.audio import resample

    pcm = resample(np.asarray(pcm, np.float32), rate, RATE)
    start, end = speech_bounds(pcm, RATE)
    speech = pcm[start:end]
    speech = speech * (0.5 / max(float(np.abs(speech).max()), 1e-6))  # mic-like headroom
    lead = np.zeros(round(spec["lead_silence_s"] * RATE), np.float32)
    tail = np.zeros(round(spec["tail_silence_s"] * RATE), np.float32)
    sf.write(str(out / name), np.concatenate([lead, speech, tail]), RATE, subtype="PCM_16")
    return {"file": name, "text": text, "speech_start_s": len(lead) / RATE,
            "speech_end_s": (len(lead) + len(speech)) / RATE,
            "duration_s": (len(lead) + len(speech) + len(tail)) / RATE}


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
