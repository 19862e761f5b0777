"""A corpus voice that hesitates: ``[600 ms]`` in a text is a pause of that length mid-sentence.

For the benchmark corpus (conf/bench/hesitation.yaml): users pause mid-sentence ("Set a
timer for, [600 ms] twenty minutes please.") and a turn detector must not take the pause for
the end of the turn. A TTS cannot hesitate, so the voice (``speaker``: any deterministic TTS
node, with its own options beside) speaks the sentence with a comma there, and the comma's
pause, Piper's longest quiet stretch inside the sentence, is stretched to the length asked
for: the prosody is Piper's at a phrase boundary, the pause the user's. Texts without a
pause are spoken as they are. benchmarks/bench_turn.py makes its hesitant speech the same way.

    bench.voice: {_target_: nodes.tts.hesitant.HesitantVoice, speaker: nodes.tts.piper.PiperTTS,
                  noise_scale: 0, noise_w_scale: 0}
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioOut, TextDelta
from s2s_flow.node import Node

__all__ = ["HesitantVoice", "pause_of", "stretch_pause"]

_PAUSE = re.compile(r"\s*\[\s*(\d+)\s*ms\s*\]\s*")


def pause_of(text: str) -> tuple[str, int | None]:
    """The text to speak (the ``[N ms]`` mark taken out) and the pause it asks for (ms), if any."""
    found = _PAUSE.findall(text)
    if len(found) > 1:
        raise ConfigError(f"bench.prompts: {text!r} asks for {len(found)} pauses; a prompt hesitates once")
    return _PAUSE.sub(" ", text).strip(), int(found[0]) if found else None


def _quiet_runs(pcm: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """(start, length) in samples of stretches 20 dB below the loudest 10 ms frame."""
    frame = rate // 100
    n = len(pcm) // frame
    energy = np.sqrt(np.mean(pcm[: n * frame].reshape(n, frame) ** 2, axis=1))
    quiet = energy < 0.1 * energy.max()
    runs, start = [], None
    for i, q in enumerate([*quiet, False]):
        if q and start is None:
            start = i
        elif not q and start is not None:
            runs.append((start * frame, (i - start) * frame))
            start = None
    return runs


def stretch_pause(pcm: np.ndarray, rate: int, pause_ms: int) -> tuple[np.ndarray, float]:
    """The speech with its longest inner pause (the comma) made ``pause_ms`` long, by digital
    silence in its middle; and where the pause ends (s)."""
    inner = [r for r in _quiet_runs(pcm, rate) if 0.15 * len(pcm) < r[0] < 0.85 * len(pcm)]
    if not inner:
        raise ConfigError("the voice made no pause inside the sentence to stretch: put a comma where the "
                          "speaker hesitates, before the [N ms] mark")
    start, length = max(inner, key=lambda r: r[1])
    extra = max(0, rate * pause_ms // 1000 - length)
    middle = start + length // 2
    out = np.concatenate([pcm[:middle], np.zeros(extra, np.float32), pcm[middle:]])
    return out, (start + length + extra) / rate


class HesitantVoice(Node):
    """Speaks with ``speaker`` (a TTS node class, options beside it); ``[N ms]`` is a pause of N ms."""

    inputs = {"text": TextDelta}
    outputs = {"audio": AudioOut}

    def __init__(self, *, speaker: str = "nodes.tts.piper.PiperTTS", **options: Any) -> None:
        from s2s_flow.graph import load_class
        from s2s_flow.validate import check_params

        cls = load_class(speaker, "bench.voice.speaker")
        check_params(cls, options, "bench.voice")
        self.speaker = cls(**options)

    def setup(self) -> None:
        self.speaker.ctx = self.ctx
        self.speaker.setup()

    def process(self, port: str, msg: TextDelta) -> Iterator[AudioOut]:
        text, pause_ms = pause_of(msg.text)
        spoken = [m for m in self.speaker.process("text", TextDelta(turn=msg.turn, text=text, end=msg.end)) or ()
                  if isinstance(m, AudioOut)]
        voiced = [m for m in spoken if len(m.pcm)]
        if pause_ms is None or not voiced:
            yield from spoken
            return
        from s2s_flow.corpus import speech_bounds

        rate = voiced[0].rate
        pcm = np.concatenate([m.pcm for m in voiced]).astype(np.float32)
        start, end = speech_bounds(pcm, rate)
        pcm, _ = stretch_pause(pcm[start:end], rate, pause_ms)
        yield AudioOut(turn=msg.turn, pcm=pcm, rate=rate, text=text, end=True)

    def close(self) -> None:
        self.speaker.close()
