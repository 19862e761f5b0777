"""End of turn: how soon each turn detector ends a finished turn, and how often it cuts the user off.

    python benchmarks/bench_turn.py [--out FILE.json] [--pauses 400,500,600,700]

Deterministic Piper speech (tests/support/speech.py) through vad=silero, fed in 20 ms chunks
in stream time (no engine, no wall clock in the decisions), for each setting below:

- finished: the 12 prompts of conf/bench/latency.yaml, each followed by 3.5 s of silence.
  The delay from the true end of speech to the turn's end (p50/p95, audio waited for plus
  the detector's compute), how many waited for the max_silence fallback ("late"), and how
  many were cut in two ("false end").
- hesitant: the 12 requests of conf/bench/hesitation.yaml, with a mid-sentence hesitation of
  400-700 ms (its ``[N ms]`` mark; --pauses gives other lengths), made two ways, since Piper
  cannot hesitate: "comma": Piper speaks a comma there and that pause is stretched to the
  length asked for (a phrase boundary: Piper's prosody falls as at a sentence end; the
  corpus of bench=hesitation is made so, by nodes/tts/hesitant.py); "halves": the two halves
  spoken separately, joined by the pause (the first half ends with a fall too, but on words
  that cannot end a sentence). "false end": the turn ended at the pause and the user was cut off.

The fixed-silence setting of today (vad.turn=silence, 500 ms) is the reference: a detector
must not cut off more hesitant users than it does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support for the test speech

from omegaconf import OmegaConf  # noqa: E402

from benchmarks._stats import percentile  # noqa: E402
from nodes.tts.hesitant import pause_of, stretch_pause  # noqa: E402
from nodes.vad.silero import SileroVAD  # noqa: E402
from s2s_flow.messages import AudioChunk, Speech  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.speech import synthesize  # noqa: E402

RATE = 16000
CHUNK = 320  # 20 ms, as a microphone delivers it
LEAD_S, TAIL_S = 0.5, 3.5
ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "silence 500 ms (today)": {"turn": "silence", "min_silence_ms": 500},
    "silence 200 ms": {"turn": "silence", "min_silence_ms": 200},
    "smart_turn 200 ms, max 1000": {"turn": "smart_turn", "min_silence_ms": 200, "max_silence_ms": 1000},
    "smart_turn 200 ms, max 3000": {"turn": "smart_turn", "min_silence_ms": 200, "max_silence_ms": 3000},
}

def hesitant_prompts() -> list[tuple[str, int]]:
    """The hesitant requests of bench=hesitation: (the sentence, its pause in ms)."""
    prompts = OmegaConf.load(ROOT / "conf" / "bench" / "hesitation.yaml").bench.prompts
    return [(text, pause) for text, pause in map(pause_of, prompts) if pause is not None]


def hesitant(text: str, pause_ms: int) -> tuple[np.ndarray, float]:
    """The sentence with its comma pause stretched to ``pause_ms``; and where the pause ends (s)."""
    return stretch_pause(synthesize(text, RATE), RATE, pause_ms)


def halves(text: str, pause_ms: int) -> tuple[np.ndarray, float]:
    """The two halves around the comma spoken on their own, ``pause_ms`` apart; where the pause ends (s)."""
    first, second = (synthesize(part.strip(), RATE) for part in text.split(",", 1))
    pause = np.zeros(RATE * pause_ms // 1000, np.float32)
    return np.concatenate([first, pause, second]), (len(first) + len(pause)) / RATE


def turns(vad: SileroVAD, pcm: np.ndarray) -> list[tuple[Speech, float]]:
    """Each Speech with the time it came out: stream time of its chunk + the compute it took."""
    vad.reset()
    out: list[tuple[Speech, float]] = []
    for i in range(0, len(pcm), CHUNK):
        piece = pcm[i : i + CHUNK]
        end = (i + len(piece)) / RATE
        t0 = time.perf_counter()
        made = [m for m in vad.process("audio", AudioChunk(pcm=piece, rate=RATE, start=i / RATE, t=end))
                if isinstance(m, Speech) and not m.speculative]  # a speculation is no turn until confirmed
        out += [(m, end + time.perf_counter() - t0) for m in made]
    out += [(m, len(pcm) / RATE) for m in vad.finish() or [] if isinstance(m, Speech) and not m.speculative]
    return out


def run_setting(params: dict, prompts: list[str], hesitations: list[tuple[str, int]]) -> dict:
    events: list[dict] = []
    vad = SileroVAD(**params)
    vad.ctx = Context("vad", Path("."), record=lambda kind, **f: events.append({"kind": kind, **f}))
    vad.setup()
    silence = np.zeros(int(LEAD_S * RATE), np.float32), np.zeros(int(TAIL_S * RATE), np.float32)

    delays, false_finished = [], 0
    for text in prompts:
        speech = synthesize(text, RATE)
        got = turns(vad, np.concatenate([silence[0], speech, silence[1]]))
        false_finished += len(got) > 1
        if got:
            delays.append(1000 * (got[-1][1] - (LEAD_S + len(speech) / RATE)))
    late = sum(e["kind"] == "turn_end" and e["by"] == "max_silence" for e in events)

    cut: dict[str, list[str]] = {"comma": [], "halves": []}
    for text, pause_ms in hesitations:
        for kind, make in (("comma", hesitant), ("halves", halves)):
            pcm, pause_end = make(text, pause_ms)
            got = turns(vad, np.concatenate([silence[0], pcm, silence[1]]))
            if any(s.end < LEAD_S + pause_end for s, _ in got):
                cut[kind].append(f"{text!r} ({pause_ms} ms)")
    return {
        "finished": len(prompts), "end_delay_p50_ms": round(median(delays)),
        "end_delay_p95_ms": round(percentile(delays, 95)),
        "late": late, "false_end_finished": false_finished, "hesitant": len(hesitations),
        "false_end_comma": len(cut["comma"]), "false_end_halves": len(cut["halves"]), "cut": cut,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    ap.add_argument("--pauses", help="hesitation lengths (ms), cycled over the 12 (default: each prompt's own, "
                                      "400-700 as in conf/bench/hesitation.yaml)")
    args = ap.parse_args()
    prompts = list(OmegaConf.load(ROOT / "conf" / "bench" / "latency.yaml").bench.prompts)
    hesitations = hesitant_prompts()
    if args.pauses:
        pauses = [int(p) for p in args.pauses.split(",")]
        hesitations = [(text, pauses[i % len(pauses)]) for i, (text, _) in enumerate(hesitations)]

    results = {name: run_setting(params, prompts, hesitations) for name, params in SETTINGS.items()}
    print("turn end after the true end of speech (ms), turns left to the fallback (late), turns cut short")
    print(f"{'setting':30s} {'end p50':>7s} {'p95':>5s} {'late':>5s} {'cut: finished':>14s} "
          f"{'hesitant comma':>15s} {'halves':>7s}")
    for name, r in results.items():
        n, h = r["finished"], r["hesitant"]
        print(f"{name:30s} {r['end_delay_p50_ms']:7d} {r['end_delay_p95_ms']:5d} {r['late']:2d}/{n:<2d} "
              f"{r['false_end_finished']:11d}/{n:<2d} {r['false_end_comma']:12d}/{h:<2d} "
              f"{r['false_end_halves']:4d}/{h:<2d}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
