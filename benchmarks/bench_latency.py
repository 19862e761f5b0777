"""Voice-to-voice latency of a stack over the benchmark corpus, and the engine's share of it.

Run: python benchmarks/bench_latency.py [--repeat 3] [--bench latency] [--out DIR] [override ...]
     (default stack: recipe=local_cpu; e.g. add tts=espeak or stt=whisper stt.model=base.en;
     --bench hesitation plays the prompts that pause mid-sentence, vad.speculate_ms=200 starts
     replies on a pause)

1. The engine: ``s2s-run recipe=local_cpu bench=latency`` -- the 12 spoken prompts of
   conf/bench/latency.yaml played in real time; metrics.json gives voice-to-voice and the
   critical path per turn (the warm-up turn of each run excluded).
2. The same stages alone, one after another on an otherwise idle process, on the same
   prompts: Silero's hangover (the audio it waits for, plus its compute), Whisper on the
   VAD's utterance, the LLM's time to its first sentence on Whisper's transcript, Piper's
   time to first audio on that sentence. The LLM runs greedy (temperature 0) in both, so
   both see the same text.
3. Engine overhead = engine voice-to-voice / sum of the stages alone - 1, paired by prompt
   and round (budget: 5 %), and the engine's own hand-over time (ring waits on the critical
   path), which is the part no stage accounts for.

4. How well the engine heard: speculative replies withdrawn (the user went on), turns that
   ended before the user had finished (false ends), and the WER of the final transcripts
   against the prompts (s2s_flow/accuracy.py).

The two alternate ``--repeat`` rounds, so both see about the same background load; the
machine's load average is printed: on a shared machine the figures include other work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._stats import percentile  # noqa: E402
from s2s_flow import accuracy, corpus  # noqa: E402
from s2s_flow.cli import plan  # noqa: E402
from s2s_flow.compose import compose  # noqa: E402
from s2s_flow.corpus import manifest  # noqa: E402
from s2s_flow.messages import AudioChunk, AudioOut, Speech, TextDelta, Transcript  # noqa: E402
from s2s_flow.model_server import managed_server  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

BUDGET = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> str:
    """The machine's load: other work on the same cores makes every latency here meaningless."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


# -- 1. the engine ---------------------------------------------------------------------------


def run_engine(overrides: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "s2s_flow.cli", *overrides, f"hydra.run.dir={out}"]
    print(f"engine: {' '.join(cmd[2:])}", file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, "S2S_LOG_LEVEL": "WARNING"})
    if proc.returncode != 0:
        sys.exit(f"engine run failed:\n{proc.stderr[-4000:]}")
    print(f"engine: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return json.loads((out / "metrics.json").read_text())


# -- 2. the stages alone -------------------------------------------------------------------


def chunks(path: Path, rate: int, chunk_s: float, tail_s: float = 1.0):
    import soundfile as sf

    pcm, file_rate = sf.read(str(path), dtype="float32")
    assert file_rate == rate, (file_rate, rate)
    pcm = np.concatenate([pcm, np.zeros(int(tail_s * rate), np.float32)])
    step = round(chunk_s * rate)
    for i in range(0, len(pcm), step):
        yield AudioChunk(pcm=pcm[i:i + step], rate=rate, start=i / rate, t=(i + step) / rate)


def vad_alone(vad: Any, path: Path, rate: int) -> tuple[float, Speech]:
    """The VAD's stage time as in real time: the audio it waits for after the end of speech
    (stream time) plus its compute on the chunk that decided."""
    vad.reset()
    for chunk in chunks(path, rate, 0.020):
        t = time.perf_counter()
        out = list(vad.process("audio", chunk))
        compute = time.perf_counter() - t
        speech = next((m for m in out if isinstance(m, Speech) and not m.speculative), None)
        if speech is not None:
            return (chunk.t - speech.speech_end_t) + compute, speech
    raise RuntimeError(f"the VAD found no utterance in {path}")


def stt_alone(stt: Any, speech: Speech) -> tuple[float, Transcript]:
    t = time.perf_counter()
    out = [m for m in stt.process("audio", speech) if isinstance(m, Transcript) and m.final]
    return time.perf_counter() - t, out[-1]


def llm_alone(llm: Any, heard: Transcript | Speech) -> tuple[float, list[TextDelta]]:
    """Time to the first sentence; the rest of the reply is drained (the server must be idle
    before the next measurement), and the first sentence's deltas are returned for TTS."""
    llm.reset()
    port = "text" if isinstance(heard, Transcript) else "audio"
    t = time.perf_counter()
    first: list[TextDelta] = []
    elapsed = None
    for msg in llm.process(port, heard):
        if elapsed is None:
            first.append(msg)
            if msg.sentence_end or msg.end:
                elapsed = time.perf_counter() - t
    if elapsed is None:
        raise RuntimeError("the LLM gave no sentence")
    return elapsed, first


def tts_alone(tts: Any, first: list[TextDelta]) -> float:
    """Time from the sentence's last delta to the first audio (the TTS speaks whole sentences)."""
    for msg in first[:-1]:
        for _ in tts.process("text", msg) or ():
            pass
    t = time.perf_counter()
    elapsed = None
    for out in tts.process("text", first[-1]):
        if elapsed is None and isinstance(out, AudioOut) and len(out.pcm):
            elapsed = time.perf_counter() - t
    if not first[-1].end:
        for _ in tts.process("text", TextDelta(turn=first[-1].turn, text="", end=True)):
            pass
    if elapsed is None:
        raise RuntimeError(f"the TTS gave no audio for {''.join(m.text for m in first)!r}")
    return elapsed


def run_alone(overrides: list[str], out: Path, repeat: int) -> dict[str, list[dict[str, Any]]]:
    cfg, choices = compose(overrides)
    graph = plan(cfg, choices)
    nodes = {name: spec.node for name, spec in graph.nodes.items()}
    for name, node in nodes.items():
        node.ctx = Context(name, out)
    nodes["source"].setup()  # the WAV source finds (or synthesizes once) the corpus
    corpus = nodes["source"].corpus_dir
    entries = manifest(corpus)["files"]
    rate, results = int(cfg.io.rate), {}
    out.mkdir(parents=True, exist_ok=True)
    with managed_server(cfg.get("server"), out):
        for name in ("vad", "stt", "llm", "tts"):
            if name in nodes:
                print(f"alone: setting up {name}", file=sys.stderr)
                nodes[name].setup()
        try:
            vad, stt, llm, tts = (nodes.get(n) for n in ("vad", "stt", "llm", "tts"))
            for rep in range(repeat):
                for e in entries:
                    stem = Path(e["file"]).stem
                    t_vad, speech = vad_alone(vad, corpus / e["file"], rate)
                    t_stt, heard = stt_alone(stt, speech) if stt is not None else (0.0, speech)
                    t_llm, first = llm_alone(llm, heard)
                    t_tts = tts_alone(tts, first)
                    row = {"vad": t_vad * 1000, "stt": t_stt * 1000, "llm": t_llm * 1000, "tts": t_tts * 1000,
                           "warmup": rep == 0 and e is entries[0]}
                    row["sum"] = row["vad"] + row["stt"] + row["llm"] + row["tts"]
                    results.setdefault(stem, []).append(row)
                    print(f"alone: {stem:<32} vad {row['vad']:5.0f}  stt {row['stt']:5.0f}  llm {row['llm']:5.0f}"
                          f"  tts {row['tts']:5.0f}  sum {row['sum']:5.0f} ms", file=sys.stderr)
        finally:
            for node in nodes.values():
                node.close()
    return results


# -- 3. the comparison ---------------------------------------------------------------------

ENGINE_KEYS = ("voice_to_voice_ms", "stage_vad_ms", "stage_stt_ms", "stage_llm_ms", "stage_tts_ms", "ring_wait_ms",
               "llm_first_token_ms")


def prompt_of(conversation: str) -> str:
    return re.sub(r"_\d+$", "", conversation)  # WavSource names repeats p, p_2, p_3


def compare(engine: list[dict[str, Any]], alone: list[dict[str, Any]]) -> dict[str, Any]:
    """Pairs each measured engine turn with the same prompt alone in the same round (close in
    time: the same background load, as far as possible)."""
    solo = {(r["round"], r["prompt"]): r for r in alone if not r["warmup"]}
    pairs = [(t, solo[(t["round"], prompt_of(t["conversation"]))]) for t in engine
             if (t["round"], prompt_of(t["conversation"])) in solo]
    ratios = [t["voice_to_voice_ms"] / a["sum"] - 1 for t, a in pairs]
    rows = []
    for prompt in sorted({prompt_of(t["conversation"]) for t, _ in pairs}):
        mine = [(t, a) for t, a in pairs if prompt_of(t["conversation"]) == prompt]
        e = {k: median(t[k] for t, _ in mine) for k in ENGINE_KEYS}
        a = {k: median(x[k] for _, x in mine) for k in ("vad", "stt", "llm", "tts", "sum")}
        rows.append({"prompt": prompt, "engine": e, "alone": a,
                     "overhead": median(t["voice_to_voice_ms"] / x["sum"] - 1 for t, x in mine)})
    total_e = sum(t["voice_to_voice_ms"] for t, _ in pairs)
    total_a = sum(a["sum"] for _, a in pairs)
    return {"pairs": len(pairs), "rows": rows, "overhead_total": total_e / total_a - 1 if total_a else float("nan"),
            "overhead_median": median(ratios) if ratios else float("nan")}


def report(engine: list[dict[str, Any]], warmups: list[dict[str, Any]], drops: int,
           alone: list[dict[str, Any]], cmp: dict[str, Any]) -> None:
    print("\n== engine (real-time playback of the corpus) ==")
    print(f"turns measured: {len(engine)} (warm-up turns apart, voice-to-voice "
          f"{', '.join(str(w.get('voice_to_voice_ms')) for w in warmups)} ms); drops: {drops}")
    for key, label in (("voice_to_voice_ms", "voice-to-voice"), ("stage_vad_ms", "  VAD hangover"),
                       ("stage_stt_ms", "  STT"), ("stage_llm_ms", "  LLM to first words spoken"),
                       ("stage_tts_ms", "  TTS first audio"), ("ring_wait_ms", "  ring waits (engine)"),
                       ("llm_first_token_ms", "LLM first token (from end of speech)")):
        xs = [t[key] for t in engine if t[key] is not None]
        p50, p95 = percentile(xs, 50), percentile(xs, 95)
        print(f"{label:<38} p50 {p50:8.1f} ms   p95 {p95:8.1f} ms   max {max(xs):8.1f} ms")
    solo = [r for r in alone if not r["warmup"]]
    print("\n== the same stages alone (same prompts, same rounds) ==")
    for key, label in (("sum", "sum of stages"), ("vad", "  VAD hangover"), ("stt", "  STT"),
                       ("llm", "  LLM first sentence"), ("tts", "  TTS first audio")):
        xs = [r[key] for r in solo]
        print(f"{label:<38} p50 {percentile(xs, 50):8.1f} ms   p95 {percentile(xs, 95):8.1f} ms")
    print("\n== per prompt (medians over rounds, ms) ==")
    print(f"{'prompt':<32} {'engine v2v':>10} {'alone sum':>10} {'overhead':>9} {'rings':>6}"
          f"   engine stt/llm/tts vs alone")
    for r in cmp["rows"]:
        e, a = r["engine"], r["alone"]
        print(f"{r['prompt']:<32} {e['voice_to_voice_ms']:10.0f} {a['sum']:10.0f} {r['overhead'] * 100:8.1f}% "
              f"{e['ring_wait_ms']:6.1f}   {e['stage_stt_ms']:.0f}/{e['stage_llm_ms']:.0f}/{e['stage_tts_ms']:.0f}"
              f" vs {a['stt']:.0f}/{a['llm']:.0f}/{a['tts']:.0f}")
    ok = cmp["overhead_median"] <= BUDGET
    print(f"\nengine voice-to-voice over the sum of the stages alone ({cmp['pairs']} pairs): "
          f"{cmp['overhead_median'] * 100:.1f} % median, {cmp['overhead_total'] * 100:.1f} % in total "
          f"(budget {BUDGET * 100:.0f} %: {'within' if ok else 'OVER'})")
    rings = [t["ring_wait_ms"] for t in engine if t["ring_wait_ms"] is not None]
    v2v = [t["voice_to_voice_ms"] for t in engine]
    print(f"engine hand-overs on the critical path (ring waits): p50 {percentile(rings, 50):.1f} ms, "
          f"p95 {percentile(rings, 95):.1f} ms; {sum(rings) / sum(v2v) * 100:.2f} % of all voice-to-voice time")


def report_heard(rounds: list[dict[str, Any]]) -> None:
    """Speculation, false ends and WER over the engine rounds."""
    def total(key: str) -> int | None:
        values = [r[key] for r in rounds if r.get(key) is not None]
        return sum(values) if values else None

    print("\n== how the engine heard (all rounds) ==")
    made, wasted = total("speculations"), total("speculation_wasted")
    print(f"speculative replies: {made or 0}" + (f", {wasted} withdrawn ({100 * wasted / made:.0f} %: the user went"
                                                 f" on; never played), {total('speculation_confirmed')} confirmed"
                                                 if made else " (vad.speculate_ms=0)"))
    ends, prompts, hesitant = total("false_ends"), total("prompts"), total("hesitant_prompts")
    print(f"false ends (turns ended before the user had finished): {ends} of {prompts} prompts played"
          + (f", {total('false_ends_hesitant')} of {hesitant} with a hesitation" if hesitant else ""))
    errors = [(r["wer"], r["words"]) for r in rounds if r.get("wer") is not None]
    if errors:
        wer = sum(w * n for w, n in errors) / sum(n for _, n in errors)
        print(f"WER of the final transcripts against the prompts: {100 * wer:.1f} %")
    cut = sorted({c for r in rounds for c in r["cut"]})
    for line in cut:
        print(f"  cut off: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds: corpus played in the engine, then alone")
    ap.add_argument("--bench", default="latency", help="the corpus: latency (conf/bench/latency.yaml) or hesitation")
    ap.add_argument("--out", type=Path, default=Path("outputs") / "bench_latency" / time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the defaults below")
    args = ap.parse_args()
    port = free_port()  # our own llama-server: never one another process is loading
    overrides = ["recipe=local_cpu", f"bench={args.bench}", "bench.repeat=1", "llm.temperature=0",
                 f"llm.base_url=http://127.0.0.1:{port}/v1", "metrics.timeline=true", *args.overrides]
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy ({load()}): the figures will include other work", file=sys.stderr)
    cfg, _ = compose(overrides)
    corpus_dir = corpus.corpus_dir(corpus.check(cfg.bench))
    engine: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []
    alone: list[dict[str, Any]] = []
    heard: list[dict[str, Any]] = []
    drops, loads = 0, [f"before: {load()}"]
    for r in range(args.repeat):  # rounds alternate, so both sides see about the same background load
        metrics = run_engine(overrides, args.out / f"engine_{r}")
        engine += [{**t, "round": r} for t in metrics["turns"]
                   if not t["warmup"] and t.get("reply", True) and t["voice_to_voice_ms"]]
        warmups.append(metrics["warmup"] or {})
        drops += metrics["drops_total"]
        score = accuracy.score_run(args.out / f"engine_{r}", corpus_dir, realtime=bool(cfg.io.realtime))
        heard.append({**{k: metrics.get(k) for k in ("speculations", "speculation_wasted", "speculation_confirmed")},
                      **{k: score[k] for k, _ in accuracy.FIGURES},
                      "words": sum(d["words"] for d in score["conversations"]),
                      "cut": [f"{d['conversation']}: {d['prompt']}" for d in score["conversations"]
                              if d["cut_off_turns"]]})
        loads.append(f"round {r}, after the engine: {load()}")
        for prompt, rows in run_alone(overrides, args.out / f"alone_{r}", 1).items():
            alone += [{**row, "prompt": prompt, "round": r} for row in rows]
        loads.append(f"round {r}, after the stages alone: {load()}")
    cmp = compare(engine, alone)
    (args.out / "bench_latency.json").write_text(json.dumps(
        {"overrides": overrides, "engine": engine, "alone": alone, "comparison": cmp, "heard": heard, "load": loads},
        indent=1))
    report(engine, warmups, drops, alone, cmp)
    report_heard(heard)
    print("\n" + "\n".join(loads))
    print(f"\nresults: {args.out} (engine_*/metrics.json and timeline.png, bench_latency.json)")


if __name__ == "__main__":
    main()
