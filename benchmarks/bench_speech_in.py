"""Speech in: Silero VAD cost per 32 ms window, then Whisper tiny.en speed and accuracy per turn.

    python benchmarks/bench_speech_in.py [--cpu-threads N] [--model tiny.en] [--repeat 3]

Five spoken questions (Piper, 16 kHz) are cut by the real SileroVAD node and transcribed
by the real WhisperSTT node. RTF = transcription time / utterance duration (lower is faster).
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
from nodes.stt.whisper import WhisperSTT  # noqa: E402
from nodes.vad.silero import SileroVAD  # noqa: E402
from s2s_flow.messages import AudioChunk, Speech  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.speech import QUESTIONS, speech_with_pauses  # noqa: E402
from tests.support.wer import wer  # noqa: E402

RATE = 16000


def cut_utterances(pcm: np.ndarray) -> tuple[list[Speech], list[float]]:
    """Run the VAD node over 20 ms chunks; return the utterances and the per-window model times."""
    vad = SileroVAD(sample_rate=RATE)
    vad.ctx = Context("vad", Path("."))
    vad.setup()
    window_times = []
    for i in range(0, len(pcm) - vad.window + 1, vad.window):
        t0 = time.perf_counter()
        vad.speech_probability(pcm[i : i + vad.window])
        window_times.append(time.perf_counter() - t0)
    vad.reset()
    out = []
    for i in range(0, len(pcm), RATE // 50):
        out += vad.process("audio", AudioChunk(pcm=pcm[i : i + RATE // 50], rate=RATE, start=i / RATE))
    out += list(vad.finish() or [])
    return [m for m in out if isinstance(m, Speech)], window_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--cpu-threads", type=int, default=0)
    parser.add_argument("--compute-type", default="int8")
    parser.add_argument("--repeat", type=int, default=3, help="transcriptions per utterance (best kept)")
    args = parser.parse_args()

    pcm, _ = speech_with_pauses(QUESTIONS, RATE, pause_s=1.2)
    utterances, window_times = cut_utterances(pcm)
    ms = np.array(window_times) * 1e3
    print(f"VAD: {len(utterances)} utterances from {len(pcm) / RATE:.1f} s; per 32 ms window "
          f"p50 {np.median(ms):.3f} ms, mean {ms.mean():.3f} ms, p95 {percentile(ms, 95):.3f} ms")

    stt = WhisperSTT(model=args.model, cpu_threads=args.cpu_threads, compute_type=args.compute_type)
    stt.ctx = Context("stt", Path("."))
    t0 = time.perf_counter()
    stt.setup()
    print(f"Whisper {args.model} ({args.compute_type}): setup incl. warm-up {time.perf_counter() - t0:.2f} s")

    texts, rtfs = [], []
    print(f"{'turn':>4} {'audio s':>8} {'stt s':>7} {'RTF':>6}  transcript")
    for speech in utterances:
        duration = len(speech.pcm) / speech.rate
        best, text = float("inf"), ""
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            out = list(stt.process("audio", speech))
            best = min(best, time.perf_counter() - t0)
            text = out[0].text if out else ""
        texts.append(text)
        rtfs.append(best / duration)
        print(f"{speech.turn:>4} {duration:>8.2f} {best:>7.3f} {best / duration:>6.3f}  {text}")
    n = min(len(texts), len(QUESTIONS))
    print(f"RTF median {statistics.median(rtfs):.3f}, mean {statistics.fmean(rtfs):.3f}; "
          f"WER {100 * wer(QUESTIONS[:n], texts[:n]):.1f} % over {n} questions")


if __name__ == "__main__":
    main()
