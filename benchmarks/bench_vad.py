"""Silero VAD cost per 32 ms window (model call alone and the whole node), at 16 and 8 kHz.

    python benchmarks/bench_vad.py [--seconds 60]

Target: <= 0.3 ms per window, i.e. < 1 % of one core in real time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support for the test speech

from benchmarks._stats import percentile  # noqa: E402
from nodes.vad.silero import SileroVAD  # noqa: E402
from s2s_flow.messages import AudioChunk  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.speech import speech_with_pauses  # noqa: E402

TEXTS = ["What is the weather going to be like in Paris tomorrow?",
         "Can you remind me to call my sister at seven tonight?",
         "Why is the sky blue during the day but red at sunset?"]


def bench(rate: int, seconds: float) -> dict[str, float]:
    speech, _ = speech_with_pauses(TEXTS, rate, pause_s=1.0)
    pcm = np.tile(speech, int(np.ceil(seconds * rate / len(speech))))[: int(seconds * rate)]
    vad = SileroVAD(sample_rate=rate)
    vad.ctx = Context("vad", Path("."))
    vad.setup()
    w = vad.window
    times = []
    for i in range(0, len(pcm) - w + 1, w):
        t0 = time.perf_counter()
        vad.speech_probability(pcm[i : i + w])
        times.append(time.perf_counter() - t0)
    vad.reset()
    chunk = rate // 50  # 20 ms chunks, as a microphone delivers them
    t0 = time.perf_counter()
    turns = 0
    for i in range(0, len(pcm), chunk):
        turns += sum(1 for _ in vad.process("audio", AudioChunk(pcm=pcm[i : i + chunk], rate=rate,
                                                                  start=i / rate)))
    node_s = time.perf_counter() - t0
    windows = len(pcm) // w
    return {
        "model_min_ms": 1e3 * min(times),
        "model_mean_ms": 1e3 * statistics.fmean(times),
        "model_p50_ms": 1e3 * statistics.median(times),
        "model_p95_ms": 1e3 * percentile(times, 95),
        "node_ms": 1e3 * node_s / windows,
        "windows": windows,
        "messages": turns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="audio length per rate (default 60)")
    args = parser.parse_args()
    print(f"Silero VAD (onnxruntime, 1 thread), {args.seconds:.0f} s of speech and pauses per rate")
    print(f"{'rate':>6} {'windows':>8} {'model min':>10} {'p50':>7} {'mean':>7} {'p95':>7} "
          f"{'node/window':>12}  (ms)")
    for rate in (16000, 8000):
        r = bench(rate, args.seconds)
        print(f"{rate:>6} {r['windows']:>8} {r['model_min_ms']:>10.3f} {r['model_p50_ms']:>7.3f} "
              f"{r['model_mean_ms']:>7.3f} {r['model_p95_ms']:>7.3f} {r['node_ms']:>12.3f}")
    print("target: <= 0.3 ms per 32 ms window")


if __name__ == "__main__":
    main()
