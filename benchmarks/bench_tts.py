"""TTS latency and speed: time to first audio for a typical first sentence, and real-time
factor (synthesis time / audio duration) over a paragraph, through the real TTS nodes.

    python benchmarks/bench_tts.py                       # piper and espeak, 5 runs each
    python benchmarks/bench_tts.py --backends espeak --runs 20 --sample-rate 16000
    python benchmarks/bench_tts.py --first-clause --runs 7   # Piper's first clause: threads x length

``--first-clause``: the first words of a reply are the critical path (tts.first_clause_words sends
a clause ahead of its sentence); this times Piper from the clause's text to its first audio for
clauses of 2 to 12 words (the reply's first words, cut there) and tts.threads from 1 to every core,
each on an otherwise idle synthesizer: the figures behind the recipe's first-clause settings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._stats import percentile  # noqa: E402
from s2s_flow.machine import cpu_label  # noqa: E402
from s2s_flow.messages import TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

FIRST_SENTENCE = "Sure, I can help you with that."
#: a reply's opening, cut after N words for the first-clause sweep
REPLY = "The capital of Australia is Canberra, a planned city that was chosen as a compromise between Sydney"
CLAUSE_WORDS = (2, 4, 6, 8, 12)
PARAGRAPH = (
    "The museum opens at nine in the morning and closes at six in the evening. "
    "Tickets cost twelve dollars for adults, and children under ten get in for free. "
    "On the first Sunday of each month, entry is free for everyone. "
    "The café on the second floor serves lunch until three o'clock. "
    "If you plan to see the whole collection, allow at least three hours."
)


def make(backend: str, sample_rate: int | None, **options):
    if backend == "piper":
        from nodes.tts.piper import PiperTTS as cls
    elif backend == "espeak":
        from nodes.tts.espeak import EspeakTTS as cls
    else:
        raise SystemExit(f"unknown backend {backend!r}: choose piper or espeak")
    node = cls(sample_rate=sample_rate, **options)
    node.ctx = Context("tts", Path(tempfile.mkdtemp()))
    start = time.perf_counter()
    node.setup()
    return node, time.perf_counter() - start


def first_audio_s(node) -> float:
    """Time from the delta that closes the sentence to the first AudioOut chunk."""
    start = time.perf_counter()
    for out in node.process("text", TextDelta(text=FIRST_SENTENCE, sentence_end=True, end=True)):
        if len(out.pcm):
            elapsed = time.perf_counter() - start
            for _ in node.process("text", TextDelta(text="", end=True)):
                pass
            return elapsed
    raise RuntimeError("no audio")


def paragraph_rtf(node) -> tuple[float, float]:
    """(synthesis seconds, audio seconds) for the paragraph fed one sentence at a time."""
    sentences = [s.strip() + "." for s in PARAGRAPH.split(".") if s.strip()]
    audio_s, busy = 0.0, 0.0
    for i, sentence in enumerate(sentences):
        delta = TextDelta(text=" " + sentence, sentence_end=True, end=i == len(sentences) - 1)
        start = time.perf_counter()
        outs = list(node.process("text", delta))
        busy += time.perf_counter() - start
        audio_s += sum(len(o.pcm) / o.rate for o in outs)
    return busy, audio_s


def first_clause_sweep(runs: int) -> None:
    """Piper's time to the first audio of a clause, by clause length and tts.threads (p50/p95 ms)."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = sorted({1, 2, cores} & set(range(1, cores + 1)))
    words = REPLY.split()
    print(f"Piper (joe, noise off) first audio of a clause, ms p50/p95 over {runs} runs; {cpu_label()}")
    print(f"{'words':>5} " + " ".join(f"{f'threads={t}':>16}" for t in threads))
    nodes = {t: make("piper", None, threads=t, noise_scale=0.0, noise_w_scale=0.0)[0] for t in threads}
    for n in CLAUSE_WORDS:
        clause = " ".join(words[:n]).rstrip(",")
        cells = []
        for t in threads:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                next(iter(nodes[t].synthesize(clause)))
                times.append(1000 * (time.perf_counter() - start))
            cells.append(f"{statistics.median(times):7.0f} /{percentile(times, 95):6.0f}")
        print(f"{n:5d} " + " ".join(f"{c:>16}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["piper", "espeak"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sample-rate", type=int, default=None, help="output rate (default: native)")
    parser.add_argument("--first-clause", action="store_true", help="Piper's first clause: threads x length")
    args = parser.parse_args()
    if args.first_clause:
        first_clause_sweep(args.runs)
        return

    print(f"first sentence: {FIRST_SENTENCE!r}; paragraph: {len(PARAGRAPH.split())} words, "
          f"{args.runs} runs, output rate {args.sample_rate or 'native'}")
    header = f"{'backend':8} {'setup s':>8} {'first audio p50 ms':>19} {'p95 ms':>8} {'RTF p50':>8} {'audio s':>8}"
    print(header)
    print("-" * len(header))
    for backend in args.backends:
        node, setup_s = make(backend, args.sample_rate)
        firsts = [first_audio_s(node) for _ in range(args.runs)]
        rtfs, audio = [], 0.0
        for _ in range(args.runs):
            busy, audio = paragraph_rtf(node)
            rtfs.append(busy / audio)
        p95 = percentile(firsts, 95)
        print(f"{backend:8} {setup_s:8.2f} {1000 * statistics.median(firsts):19.1f} {1000 * p95:8.1f} "
              f"{statistics.median(rtfs):8.3f} {audio:8.1f}")


if __name__ == "__main__":
    main()
