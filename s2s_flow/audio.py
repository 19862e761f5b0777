"""Small audio helpers shared by nodes: resampling, mono mixdown, 16-bit WAV bytes."""

from __future__ import annotations

import io

import numpy as np

__all__ = ["resample", "to_mono", "to_float32", "wav_bytes"]


def to_float32(pcm: np.ndarray) -> np.ndarray:
    """Integer PCM (int16/int32) or float to float32 in [-1, 1]."""
    if pcm.dtype == np.float32:
        return pcm
    if np.issubdtype(pcm.dtype, np.integer):
        return (pcm.astype(np.float32) / float(np.iinfo(pcm.dtype).max + 1)).astype(np.float32)
    return pcm.astype(np.float32)


def to_mono(pcm: np.ndarray) -> np.ndarray:
    """(frames, channels) -> (frames,) by averaging channels."""
    return pcm.mean(axis=1, dtype=np.float32) if pcm.ndim == 2 else pcm


def resample(pcm: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling (libsoxr, high quality). A no-op when the rates match."""
    if rate_in == rate_out or len(pcm) == 0:
        return to_float32(pcm)
    import soxr

    return soxr.resample(to_float32(pcm), rate_in, rate_out, quality="HQ").astype(np.float32, copy=False)


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    """16-bit mono WAV file bytes (what OpenAI-style audio APIs expect)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(to_float32(pcm), -1.0, 1.0), rate, subtype="PCM_16", format="WAV")
    return buf.getvalue()
