"""Small audio helpers shared by nodes: resampling (whole, streamed, low-latency), mono mixdown, WAV bytes."""

from __future__ import annotations

import io
import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["resample", "to_mono", "to_float32", "wav_bytes", "StreamResampler", "LowLatencyResampler"]


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


_FEW_PHASES = 8  # up to this many filter phases, a product per phase beats a gather (24 kHz: 2 phases)


class LowLatencyResampler:
    """Streaming polyphase resampler (Kaiser-windowed sinc) for live audio on its way to a VAD (a
    Realtime client's appends): about 1 ms of delay, where soxr's stream mode holds back 20-40 ms per block (its
    output comes in bursts), which the end of every turn would wait for. Flat to 0.375 x the
    lower rate (6 kHz at 16 kHz), -6 dB at 0.45 x: made for speech going to a VAD and STT."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        g = math.gcd(rate_in, rate_out)
        self.up, self.down = rate_out // g, rate_in // g
        self.taps = k = round(32 * max(1.5, rate_in / rate_out))  # input samples per output sample
        cutoff = 0.45 * min(rate_in, rate_out) / (rate_in * self.up)  # -6 dB, cycles per upsampled sample
        n = np.arange(k * self.up) - (k * self.up - 1) / 2
        h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(k * self.up, 8.0) * self.up
        self._bank = np.ascontiguousarray(h.reshape(k, self.up).T[:, ::-1], np.float32)  # [phase, oldest tap first]
        self._history = np.zeros(k - 1, np.float32)
        self._next = 0  # index of the next output sample
        self._seen = 0  # input samples so far

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, pcm.astype(np.float32, copy=False)])
        self._seen += len(pcm)
        self._history = x[len(x) - (self.taps - 1):]
        last = (self._seen * self.up - 1) // self.down  # the newest output whose inputs are all here
        if last < self._next:
            return np.zeros(0, np.float32)
        first, count, base = self._next, last + 1 - self._next, self._seen - len(x)  # base: x[0]'s stream index
        self._next = last + 1
        if self.up > _FEW_PHASES:  # (44.1 kHz: 160) a gather of every output's window, then one product
            pos = np.arange(first, last + 1) * self.down
            newest = pos // self.up - base  # each output's newest input, as an index in x
            window = x[newest[:, None] + np.arange(1 - self.taps, 1)]
            return np.einsum("ij,ij->i", window, self._bank[pos % self.up]).astype(np.float32, copy=False)
        # Outputs ``up`` apart share a phase, and their windows start ``down`` inputs apart: per phase,
        # one matrix-vector product over a strided view of the windows (no copy of them)
        rows, out = sliding_window_view(x, self.taps), np.empty(count, np.float32)
        for k in range(min(self.up, count)):
            pos = (first + k) * self.down
            start, n = pos // self.up - base - (self.taps - 1), len(range(k, count, self.up))
            out[k :: self.up] = rows[start : start + (n - 1) * self.down + 1 : self.down] @ self._bank[pos % self.up]
        return out
