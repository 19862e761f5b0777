"""STT while the user speaks: the final transcript decoded at the pauses vs the whole utterance at once.

    python benchmarks/bench_stt_incremental.py [--speculate-ms 200] [--window-s 30] [--beam-size 1] [--out FILE.json]
    python benchmarks/bench_stt_incremental.py --stream-ms 100 --window-s 10 --beam-size 3 --speculate-ms 64

Deterministic Piper speech (tests/support/speech.py) through vad=silero with speculation on
(``vad.speculate_ms``), fed in 20 ms chunks in stream time, then stt=whisper (tiny.en) two ways
on the very same utterances:

- incremental (the engine's way, nodes/stt/_base.py): every Speech the VAD sends, speculative
  ones included, in order; a confirmation is answered from memory and a longer utterance has
  only its tail after the last pause decoded, with the words so far as Whisper's prompt;
- whole: each final utterance decoded at once, as without speculation.

With ``--stream-ms`` (stt.stream_ms, the decode while the user speaks) the audio is played in real
time (the schedule reads the wall clock, as live): the STT decodes the growing utterance on its own
thread as it comes, the turn's Speech leaves only the tail after the stable words, and "left after
the end" is the wait for that last decode, with a decode of the growing utterance possibly running
beside it on the other core; "whole" decodes the same Speech at once on an idle STT.

Three sets: the 12 prompts of conf/bench/latency.yaml; the 12 hesitant requests of
bench=hesitation (conf/bench/hesitation.yaml) spoken in two halves 400-700 ms apart; 6 passages of 3-4 sentences with
250-450 ms between sentences (longer, multi-sentence speech). Printed per set: WER both ways (scored as
s2s_flow/accuracy.py does: case, punctuation, small numbers), the decode time at each pause (speculative
messages: it runs while the VAD still waits for the turn's end) and the decode time left
after the turn's end (the final message's), p50/p95.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from benchmarks._stats import percentile  # noqa: E402
from benchmarks.bench_turn import hesitant_prompts  # noqa: E402
from nodes.stt.whisper import WhisperSTT  # noqa: E402
from nodes.vad.silero import SileroVAD  # noqa: E402
from s2s_flow.accuracy import word_errors  # noqa: E402
from s2s_flow.messages import AudioChunk, Speech, SpeechSoFar  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.speech import synthesize  # noqa: E402

RATE, CHUNK = 16000, 320
ROOT = Path(__file__).resolve().parents[1]

PASSAGES = [
    ["I am planning a trip to Japan next spring.", "I would like to see Kyoto and Osaka.",
     "What should I book first?"],
    ["My laptop has become very slow.", "It takes minutes to start up.",
     "Sometimes the fan is loud for no reason.", "What can I do about it?"],
    ["We are having friends over for dinner on Saturday.", "One of them does not eat meat.",
     "Can you suggest a main course that everyone will like?"],
    ["I started running three weeks ago.", "My knees hurt a little after each run.",
     "Should I stop for a while, or keep going slowly?"],
    ["The weather report said it would be sunny today.", "Instead it has rained all afternoon.",
     "How accurate are weather forecasts, really?"],
    ["I need to write a short speech for my brother's wedding.", "He is a teacher and loves hiking.",
     "Give me an opening line."],
]


def streamed(vad: SileroVAD, stt: WhisperSTT, pcm: np.ndarray) -> tuple[list[str], list[float], int]:
    """Play ``pcm`` in real time through the VAD and the streaming STT, as a microphone would: the
    final transcripts, the wait for the transcript that starts each reply (ms from the Speech that
    ends the pause, speculative or not; a confirmation is answered from memory), and how many
    decodes of the growing utterance ran (on the STT's own thread, beside this one)."""
    vad.reset()
    stt.reset()
    stt._growing, stt._schedule = None, type(stt._schedule)(stt.stream_duty)
    finals: list[str] = []
    waits: list[float] = []
    speculated = -1
    t0 = time.perf_counter()
    for i in range(0, len(pcm), CHUNK):
        now = (i + CHUNK) / RATE
        time.sleep(max(0.0, t0 + now - time.perf_counter()))
        chunk = AudioChunk(pcm=pcm[i : i + CHUNK], rate=RATE, start=i / RATE, t=now)
        for m in [*vad.process("audio", chunk), *(vad.finish() or () if i + CHUNK >= len(pcm) else ())]:
            if isinstance(m, SpeechSoFar):
                list(stt.process("growing", m))
            elif isinstance(m, Speech):
                started = time.perf_counter()
                out = [t for t in stt.process("audio", m) if t.final]
                if m.speculative or speculated != m.turn:
                    waits.append(1000 * (time.perf_counter() - started))
                if m.speculative:
                    speculated = m.turn
                else:
                    finals.extend(t.text for t in out)
    list(stt._collect(0, wait=True))  # the decode still running: done before the next item starts
    return finals, waits, stt._schedule.decodes


def utterances(vad: SileroVAD, pcm: np.ndarray) -> list[Speech]:
    vad.reset()
    out: list[Speech] = []
    for i in range(0, len(pcm), CHUNK):
        piece = pcm[i : i + CHUNK]
        out += [m for m in vad.process("audio", AudioChunk(pcm=piece, rate=RATE, start=i / RATE, t=i / RATE))
                if isinstance(m, Speech)]  # (SpeechSoFar: the streaming run's, see streamed())
    return out + [m for m in vad.finish() or [] if isinstance(m, Speech)]


def join(parts: list[np.ndarray], pauses_ms: list[int]) -> np.ndarray:
    out = [np.zeros(RATE // 2, np.float32)]
    for i, p in enumerate(parts):
        out.append(p)
        out.append(np.zeros(RATE * (pauses_ms[i] if i < len(pauses_ms) else 2000) // 1000, np.float32))
    return np.concatenate(out)


def pct(xs: list[float], q: float) -> float:
    return round(percentile(xs, q), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speculate-ms", type=int, default=200)
    ap.add_argument("--window-s", type=float, default=30.0, help="stt.window_s (Whisper's encoder window)")
    ap.add_argument("--beam-size", type=int, default=1, help="stt.beam_size")
    ap.add_argument("--stream-ms", type=int, default=0, help="stt.stream_ms: decode while the user speaks")
    ap.add_argument("--stream-duty", type=float, default=0.5, help="stt.stream_duty")
    ap.add_argument("--threads", type=int, default=1, help="stt.cpu_threads (recipe=local_cpu: 1)")
    ap.add_argument("--sets", default="prompts,hesitant halves,passages")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    turns = {"n": 0}

    def new_turn() -> int:
        turns["n"] += 1
        return turns["n"]

    ctx = Context("vad", Path("."), record=lambda kind, **f: None)
    ctx.new_turn = new_turn  # type: ignore[method-assign]
    vad = SileroVAD(speculate_ms=args.speculate_ms, stream_ms=args.stream_ms)
    vad.ctx = ctx
    vad.setup()
    stt = WhisperSTT(window_s=args.window_s, beam_size=args.beam_size, stream_ms=args.stream_ms,
                     stream_duty=args.stream_duty, cpu_threads=args.threads)
    stt.ctx = Context("stt", Path("."))
    stt.setup()

    prompts = list(OmegaConf.load(ROOT / "conf" / "bench" / "latency.yaml").bench.prompts)
    every = {
        "prompts": [(t, join([synthesize(t, RATE)], [])) for t in prompts],
        "hesitant halves": [(t.replace(",", ""), join([synthesize(p.strip(), RATE) for p in t.split(",", 1)],
                                                      [pause])) for t, pause in hesitant_prompts()],
        "passages": [(" ".join(p), join([synthesize(s, RATE) for s in p], [250 + 100 * (i % 3)] * (len(p) - 1)))
                     for i, p in enumerate(PASSAGES)],
    }
    sets = {name: every[name] for name in (n.strip() for n in args.sets.split(","))}
    report = {}
    for name, items in sets.items():
        ref_n = err_inc = err_whole = 0
        left_inc: list[float] = []
        left_whole: list[float] = []
        at_pause: list[float] = []
        spec = 0
        decodes = 0
        for truth, pcm in items:
            if args.stream_ms:
                got, waits, n = streamed(vad, stt, pcm)
                left_inc += waits
                decodes += n
                e_inc, _ = word_errors(truth, " ".join(got))
                err_inc += e_inc
            msgs = utterances(vad, pcm)
            spec += sum(m.speculative for m in msgs)
            stt.reset()
            inc, whole = [], []
            for m in msgs:
                if args.stream_ms:  # the same Speech decoded whole, as without the stream
                    if m.speculative or not any(x.speculative and x.turn == m.turn for x in msgs):
                        t0 = time.perf_counter()
                        text, _ = stt.transcribe(m.pcm)
                        left_whole.append(1000 * (time.perf_counter() - t0))
                    if not m.speculative:
                        whole.append(stt.transcribe(m.pcm)[0])
                    continue
                t0 = time.perf_counter()
                out = list(stt.process("audio", m))
                dt = 1000 * (time.perf_counter() - t0)
                if m.speculative:
                    at_pause.append(dt)
                else:
                    left_inc.append(dt)
                    inc += [t.text for t in out]
                    t0 = time.perf_counter()
                    text, _ = stt.transcribe(m.pcm)
                    left_whole.append(1000 * (time.perf_counter() - t0))
                    whole.append(text)
            e_whole, n = word_errors(truth, " ".join(whole))
            if not args.stream_ms:
                err_inc += word_errors(truth, " ".join(inc))[0]
            ref_n, err_whole = ref_n + n, err_whole + e_whole
        report[name] = {
            "items": len(items), "words": ref_n, "speculative_messages": spec,
            "wer_incremental_pct": round(100 * err_inc / ref_n, 2), "wer_whole_pct": round(100 * err_whole / ref_n, 2),
            "decode_at_pause_ms": [pct(at_pause, 50), pct(at_pause, 95)],
            "decode_after_end_incremental_ms": [pct(left_inc, 50), pct(left_inc, 95)],
            "decode_after_end_whole_ms": [pct(left_whole, 50), pct(left_whole, 95)],
        }
        if args.stream_ms:
            report[name]["decodes_while_speaking"] = decodes
        print(f"{name}: {report[name]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
