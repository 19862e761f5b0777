"""The turn-taking corpus (benchmarks/turn_corpus.py): its shape, and voices that speak the same
samples every time although Piper's noise is on and espeak-ng keeps state between utterances."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import turn_corpus  # noqa: E402
from nodes.tts.hesitant import pause_of  # noqa: E402


def test_the_corpus_has_64_utterances_over_five_voices_half_of_them_hesitant():
    by_voice = turn_corpus.prompts_by_voice()
    prompts = [p for ps in by_voice.values() for p in ps]
    marked = [pause_of(p) for p in prompts]
    pauses = [ms for _, ms in marked if ms is not None]
    assert len(prompts) == 64 and len(by_voice) == 5 and all(len(ps) >= 12 for ps in by_voice.values())
    assert len(pauses) == 32 and min(pauses) == 400 and max(pauses) == 900
    assert {t for t, ms in marked if ms is None} == set(turn_corpus.FINISHED)
    assert {"piper", "espeak"} == {v["backend"] for v in turn_corpus.VOICES.values()}


def test_piper_with_its_noise_on_speaks_a_prompt_the_same_twice():
    pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
    speak = turn_corpus._speaker("piper")
    prompt = "Set a timer for, [600 ms] twenty minutes please."
    (a, rate), (b, _) = speak([prompt, prompt])
    assert np.array_equal(a, b)
    (other, _), = turn_corpus._speaker("piper-fast")([prompt])  # another speed: other samples
    assert not np.array_equal(a[: len(other)], other[: len(a)])
    gap = np.flatnonzero(np.abs(a) < 1e-6)
    assert len(gap) >= 0.6 * rate * 0.9  # the pause is there, as digital silence


def test_espeak_speaks_each_prompt_as_a_fresh_engine_would():
    pytest.importorskip("espeakng_loader", reason="needs the espeak extra: pip install 's2s-flow[espeak]'")
    speak = turn_corpus._speaker("espeak-us")
    (a, _), (b, _), (c, _) = speak(["Call my mother.", "Stop the music.", "Call my mother."])
    assert np.array_equal(a, c)  # the utterance between them left nothing behind
    assert not np.array_equal(a[: len(b)], b[: len(a)])
