"""Small audio helpers shared by nodes: resampling, mono mixdown, 16-bit WAV bytes."""

from __future__ import annotations

import io

import numpy as np

__all__ = ["resample", "to_mono", "to_float32", "wav_bytes", "StreamResampler"]


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


class StreamResampler:
    """soxr with its filter state kept across blocks, so audio resampled piece by piece
    (live input, a sentence streamed by TTS) has no clicks at the borders. Equal rates
    pass through untouched; ``flush()`` returns the filter's tail at the end."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self._soxr = None
        if rate_in != rate_out:
            import soxr

            self._soxr = soxr.ResampleStream(rate_in, rate_out, 1, dtype="float32", quality="HQ")

    def __call__(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        pcm = np.ascontiguousarray(to_float32(pcm), dtype=np.float32)
        return pcm if self._soxr is None else self._soxr.resample_chunk(pcm, last=last)

    def flush(self) -> np.ndarray:
        return self(np.zeros(0, np.float32), last=True)
