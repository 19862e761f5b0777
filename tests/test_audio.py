"""s2s_flow/audio.py: the streaming resamplers that live audio goes through."""

from __future__ import annotations

import numpy as np
import pytest

from s2s_flow.audio import LowLatencyResampler


@pytest.mark.parametrize("rate_in", [24000, 48000, 44100, 8000])
def test_the_low_latency_resampler_returns_each_block_at_once_and_band_limited(rate_in):
    """soxr's stream mode hands its output back in bursts 20-40 ms late: each turn's end would
    wait for that (a Realtime client's appends on their way to the VAD). This one returns every
    20 ms block's samples at once, and keeps what is above the speech band out."""
    step, out = rate_in // 50, 16000 // 50
    resample = LowLatencyResampler(rate_in, 16000)
    impulse = np.zeros(rate_in, np.float32)
    impulse[rate_in // 2] = 1.0
    pieces = [resample(impulse[i : i + step]) for i in range(0, rate_in, step)]
    assert {len(p) for p in pieces} == {out}, "every append comes out whole, none held back"
    delay_ms = (np.argmax(np.abs(np.concatenate(pieces))) / 16000 - 0.5) * 1000
    assert 0 <= delay_ms <= 3.5
    t = np.arange(rate_in) / rate_in
    for freq, lowest, highest in ((1000, 0.97, 1.03), (5000, 0.97, 1.03), (9500, 0.0, 0.001)):
        if freq >= rate_in / 2:
            continue
        tone = np.sin(2 * np.pi * freq * t).astype(np.float32)
        resample = LowLatencyResampler(rate_in, 16000)
        y = np.concatenate([resample(tone[i : i + step]) for i in range(0, rate_in, step)])[4000:]
        level = np.sqrt(2 * np.mean(y**2))
        assert lowest <= level <= highest, (freq, level)  # 9.5 kHz cannot fold back into the speech band


@pytest.mark.parametrize("rate_in", [24000, 12000, 8000, 48000])
def test_the_low_latency_resampler_computes_by_phase_what_the_gather_of_every_window_gives(rate_in, monkeypatch):
    """With few filter phases (24 kHz to 16 kHz: 2) each phase's outputs are one product over a
    strided view; the gather of every output's window (kept for 44.1 kHz's 160 phases) is the
    reference. Appends of uneven sizes, so that the phase each one starts on moves."""
    from s2s_flow import audio

    pcm = np.random.default_rng(7).standard_normal(rate_in).astype(np.float32) * 0.3
    sizes = [17, 333, rate_in // 50, 1, 0, 2 * rate_in // 50 + 5] * 40

    def run() -> np.ndarray:
        resample, out, at = LowLatencyResampler(rate_in, 16000), [], 0
        for size in sizes:
            out.append(resample(pcm[at : at + size]))
            at += size
        return np.concatenate(out)

    by_phase = run()
    monkeypatch.setattr(audio, "_FEW_PHASES", 0)
    gathered = run()
    assert len(by_phase) == len(gathered) > 16000 * 0.9
    np.testing.assert_allclose(by_phase, gathered, atol=1e-6)
