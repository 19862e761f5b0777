"""io=realtime: client-measured voice-to-voice over the WebSocket, beside io=wav, and memory per session.

Run: python benchmarks/bench_realtime.py [--repeat 1] [--sessions 1 2 4] [--skip-wav] [--prompts N] [--one-session]
                                          [override ...]
     (default stack: recipe=local_cpu, its llama-server started here)
     python benchmarks/bench_realtime.py --conversations 1 2 4 8 [--server-tree OLD_TREE NEW_TREE] [--turns 4]
     (conversations paced like people, before/after side by side: see benchmarks/_conversations.py)
     python benchmarks/bench_realtime.py --memory 0 1 2 4 8 [--skip-slots]
     (MB per extra session of a real s2s-run: its Python process and its llama-server, RSS and
     PSS, idle and after a turn, and llama-server's KV cost per slot: see benchmarks/_memory.py)

1. io=wav: ``s2s-run recipe=local_cpu bench=latency bench.repeat=N``: the engine's voice-to-voice
   (first reply audio at the sink - the VAD's estimate of the end of speech), p50/p95 over the
   corpus. The VAD's estimate is not the true end, so the same turns are also measured from the
   prompts' true ends (the sink's first audio - the file's playback start - the prompt's end of
   speech), as the client measures the server: ``server_adds_p50_ms_from_true_end`` compares like
   for like. The VAD's own offset from the true ends is printed too (the VAD run over the files).
2. io=realtime, in this process: a server on a free port; clients (the raw protocol over
   ``websockets``) play the same corpus (conf/bench/latency.yaml, one connection per prompt) at
   a microphone's pace: each 20 ms append is sent once its last sample is "recorded" (``--one-session``:
   one connection per client for all its prompts, its conversation emptied with
   conversation.item.delete after each, so a turn is not also a session's first). Voice-to-voice
   is measured by the client: first ``response.output_audio.delta`` received - the prompt's true
   end of speech. With one session, each turn is split where the time goes: the server's estimate
   of the end of speech (its VAD) - the true end; the engine (that estimate to the first audio at
   the sink); and the delivery (sink to the client's receive). With 1, 2 and 4 clients at once:
   p50/p95, the process's peak RSS (sampled every 50 ms) and its RSS with the sessions open and
   idle; the RSS each session after the first adds is (peak with k - peak with 1) / (k - 1): this
   process only (not the llama-server's slots), for the target's figure see ``--memory``.

The clients run in a process of their own (as a real client would: not on the server's GIL);
both read the machine's one monotonic clock, so the client's and the server's stamps compare.
On a shared or loaded machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median, quantiles
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_flow.cli import plan  # noqa: E402
from s2s_flow.compose import compose  # noqa: E402
from s2s_flow.corpus import manifest  # noqa: E402
from s2s_flow.model_server import managed_server  # noqa: E402

RATE = 24000
STEP = RATE // 50  # 20 ms per append, like a microphone


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    value = quantiles(values, n=100, method="inclusive")[round(q) - 1] if q != 50 else median(values)
    return round(value, 1)


def corpus(overrides: list[str]) -> tuple[Path, list[dict[str, Any]]]:
    cfg, choices = compose(["recipe=local_cpu", "bench=latency", *overrides])
    source = plan(cfg, choices).nodes["source"].node
    from s2s_flow.node import Context

    source.ctx = Context("source", Path(tempfile.mkdtemp()))
    source.setup()  # finds (or synthesizes once) the corpus
    directory = source.corpus_dir
    return directory, manifest(directory)["files"]


def vad_end_offsets(prompts: list[tuple[np.ndarray, float]], overrides: list[str]) -> list[float]:
    """The VAD's estimate of each prompt's end of speech minus the true end (ms), on exact
    sample times: what io=wav's voice-to-voice leaves out (or adds)."""
    from s2s_flow.audio import resample
    from s2s_flow.messages import AudioChunk, Speech
    from s2s_flow.node import Context

    cfg, choices = compose(["recipe=local_cpu", "server=null", *overrides])
    offsets = []
    for pcm24, end_s in prompts:
        vad = plan(cfg, choices).nodes["vad"].node
        vad.ctx = Context("vad", Path(tempfile.mkdtemp()))
        vad.setup()
        pcm = resample(np.concatenate([pcm24, np.zeros(RATE, np.float32)]), RATE, 16000)
        step = 320
        for i in range(0, len(pcm), step):
            chunk = AudioChunk(pcm=pcm[i : i + step], rate=16000, start=i / 16000, t=(i + step) / 16000)
            ends = [m for m in vad.process("audio", chunk) or () if isinstance(m, Speech)
                    and not getattr(m, "speculative", False)]
            if ends:
                offsets.append((ends[0].speech_end_t - end_s) * 1000)
                break
        vad.close()
    return offsets


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class SinkClock:
    """The server's own stamps of each reply's first audio (its metrics callback): when the sink
    sent it and the VAD's estimate of the end of speech it answers."""

    def __init__(self, metrics: Any) -> None:
        self.seen: list[tuple[float, float]] = []  # (sink's first audio, estimated end of speech)
        observe = metrics.observe

        def spy(name: str, value: float) -> None:
            if name == "voice_to_voice_s":
                now = time.monotonic()
                self.seen.append((now, now - value))
            observe(name, value)

        metrics.observe = spy


async def one_prompt(ws: Any, pcm: np.ndarray, speech_end_s: float, forget: bool) -> dict[str, float] | None:
    """Play one prompt into the open session ``ws`` at a microphone's pace, until its reply is done;
    ``forget``: then delete the turn's items, so the next prompt starts a fresh conversation."""
    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    end_sample = round(speech_end_s * RATE)
    first_audio: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    items: list[str] = []

    async def reader() -> None:
        async for text in ws:
            if '"response.output_audio.delta"' in text[:200]:
                if not first_audio.done():
                    first_audio.set_result(time.monotonic())
                continue
            event = json.loads(text)
            if event["type"] == "input_audio_buffer.committed":
                items.append(event["item_id"])
            if event["type"] == "response.done":
                items.extend(item["id"] for item in event["response"]["output"])
                return

    task = asyncio.create_task(reader())
    start = time.monotonic()
    for i in range(0, len(data) // 2, STEP):
        # a microphone hands over a block once its last sample is recorded
        await asyncio.sleep(max(0.0, start + (i + STEP) / RATE - time.monotonic()))
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(data[2 * i : 2 * (i + STEP)]).decode()}))
    silence = base64.b64encode(bytes(2 * STEP)).decode()
    i = len(data) // 2
    while not task.done() and time.monotonic() - start < len(data) / 2 / RATE + 20:
        # the microphone stays open: silence until the reply is done, on the same clock
        i += STEP
        await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
    task.cancel()
    if forget and task.done() and not task.cancelled():
        for item in items:
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": item}))
        for _ in items:
            while '"conversation.item.deleted"' not in (text := await ws.recv()) and '"error"' not in text[:60]:
                pass
    if not first_audio.done():
        return None
    t_end = start + end_sample / RATE  # the true end of speech, on the microphone's clock
    return {"start": start, "t_end": t_end, "first": first_audio.result(),
            "v2v": (first_audio.result() - t_end) * 1000}


async def clients(url: str, n: int, prompts: list[tuple[np.ndarray, float]], repeat: int,
                  one_session: bool = False) -> list[dict[str, float]]:
    """``n`` clients at once, each playing the corpus ``repeat`` times: one connection per prompt
    (a fresh session each, as io=wav makes each file a conversation), or ``one_session`` each,
    the conversation emptied between prompts (conversation.item.delete)."""
    from websockets.asyncio.client import connect

    async def session() -> Any:
        ws = await connect(f"{url}/realtime", max_size=None)
        while json.loads(await ws.recv())["type"] != "session.created":
            pass
        return ws

    async def client(k: int) -> list[dict[str, float]]:
        out = []
        ws = await session() if one_session else None
        for r in range(repeat):
            for j in range(len(prompts)):
                pcm, end = prompts[(j + k * 3) % len(prompts)]  # each client its own order
                if one_session:
                    turn = await one_prompt(ws, pcm, end, forget=True)
                else:
                    async with await session() as fresh:
                        turn = await one_prompt(fresh, pcm, end, forget=False)
                if turn is not None and not (r == 0 and j == 0):  # the first turn is the warm-up
                    out.append(turn)
        if ws is not None:
            await ws.close()
        return out

    results = await asyncio.gather(*(client(k) for k in range(n)))
    return [v for r in results for v in r]


def client_process(url: str, n: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """Run ``n`` clients in a process of their own; their turns, as one_prompt() measures them."""
    cmd = [sys.executable, __file__, "--client", url, "--sessions", str(n), "--repeat", str(args.repeat),
           "--prompts", str(args.prompts), *(["--one-session"] if args.one_session else []), *args.overrides]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def split(turns: list[dict[str, float]], clock: SinkClock) -> dict[str, Any]:
    """One session's turns, split at the server's stamps (each turn's are the ones it got)."""
    parts: dict[str, list[float]] = {"end_estimate_minus_true_ms": [], "engine_ms": [], "delivery_ms": []}
    for turn in turns:
        stamps = [s for s in clock.seen if turn["start"] <= s[0] <= turn["first"]]
        if not stamps:
            continue
        sink, end_est = stamps[0]
        parts["end_estimate_minus_true_ms"].append((end_est - turn["t_end"]) * 1000)
        parts["engine_ms"].append((sink - end_est) * 1000)
        parts["delivery_ms"].append((turn["first"] - sink) * 1000)
    return {k: {"p50": p(v, 50), "p95": p(v, 95)} for k, v in parts.items()}


def wav_side(repeat: int, overrides: list[str], out: Path, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's figure (from the VAD's estimate), and the same turns from the true end of
    speech: the first reply audio at the sink minus (the file's playback start + the prompt's
    true end), on the clock the client reads too."""
    run_dir = out / "wav"
    cmd = [sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", "bench=latency", f"bench.repeat={repeat}",
           f"hydra.run.dir={run_dir}", "metrics.timeline=false", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    summary = metrics["summary"]["voice_to_voice_ms"]
    true_end = {Path(e["file"]).stem: float(e["speech_end_s"]) for e in entries}
    from_true_end = []
    for t in metrics["turns"]:
        prompt = true_end.get(re.sub(r"_\d+$", "", t["conversation"]))
        if (t["turn"] == metrics["warmup_turn"] or not t.get("reply", True) or t.get("voice_to_voice_ms") is None
                or prompt is None or t["conversation"] not in metrics["sessions"]):
            continue
        first_audio = t["speech_end_s"] + t["voice_to_voice_ms"] / 1000
        from_true_end.append((first_audio - metrics["sessions"][t["conversation"]] - prompt) * 1000)
    return {"p50": summary.get("p50"), "p95": summary.get("p95"), "n": summary.get("n"),
            "from_true_end": {"p50": p(from_true_end, 50), "p95": p(from_true_end, 95), "n": len(from_true_end)}}


def main() -> None:
    if "--memory" in sys.argv[1:]:
        from benchmarks._memory import main as memory

        memory(sys.argv[1:])
        return
    if "--conversations" in sys.argv[1:]:
        from benchmarks._conversations import main as conversations

        conversations(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=0, help="play only the first N prompts of the corpus")
    ap.add_argument("--skip-wav", action="store_true")
    ap.add_argument("--one-session", action="store_true",
                    help="each client plays all its prompts in one session (emptied between prompts)")
    ap.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the client process: play to URL
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-realtime-")))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from s2s_flow.audio import resample

    directory, entries = corpus(args.overrides)
    import soundfile as sf

    prompts = []
    for e in entries[: args.prompts or None]:
        pcm, rate = sf.read(directory / e["file"], dtype="float32")
        prompts.append((resample(pcm, rate, RATE), float(e["speech_end_s"])))
    if args.client:
        print(json.dumps(asyncio.run(clients(args.client, args.sessions[0], prompts, args.repeat, args.one_session))))
        return
    report: dict[str, Any] = {}
    offsets = vad_end_offsets(prompts, args.overrides)
    report["vad_end_estimate_minus_true_ms"] = {"p50": p(offsets, 50), "min": round(min(offsets), 1),
                                                "max": round(max(offsets), 1)}
    if not args.skip_wav:
        print("io=wav ...", file=sys.stderr)
        report["wav"] = wav_side(args.repeat, args.overrides, args.out, entries)
    from nodes.io.realtime.server import RealtimeServer

    cfg, choices = compose(["recipe=local_cpu", "io=realtime", "io.port=0", *args.overrides])
    graph = plan(cfg, choices)
    with managed_server(cfg.get("server"), args.out):
        server = RealtimeServer(lambda: plan(cfg, choices), graph.nodes["source"].node, args.out / "realtime")
        clock = SinkClock(server.metrics)
        url = server.start()
        try:
            for n in args.sessions:
                peak, stop = [rss_mb()], threading.Event()

                def sample(peak: list[float] = peak, stop: threading.Event = stop) -> None:
                    while not stop.wait(0.05):
                        peak.append(rss_mb())

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                print(f"io=realtime, {n} session(s) ...", file=sys.stderr)
                clock.seen.clear()
                turns = client_process(url, n, args)
                stop.set()
                sampler.join()
                values = [t["v2v"] for t in turns]
                row = report[f"realtime_{n}"] = {"p50": p(values, 50), "p95": p(values, 95), "n": len(values),
                                                 "peak_rss_mb": round(max(peak), 1),
                                                 "idle_rss_mb": round(asyncio.run(idle_rss(url, n)), 1)}
                if n == 1:
                    row["split"] = split(turns, clock)
        finally:
            server.stop()
    one = report.get("realtime_1", {})
    for n in args.sessions:
        row = report[f"realtime_{n}"]
        if n > 1 and one:
            row["rss_per_extra_session_mb"] = round((row["peak_rss_mb"] - one["peak_rss_mb"]) / (n - 1), 1)
            row["idle_rss_per_extra_session_mb"] = round((row["idle_rss_mb"] - one["idle_rss_mb"]) / (n - 1), 1)
    if "wav" in report and one.get("p50") is not None and report["wav"]["p50"]:
        report["server_adds_p50_ms"] = round(one["p50"] - report["wav"]["p50"], 1)
        wav_true = report["wav"]["from_true_end"]["p50"]
        if wav_true is not None:  # like for like: both from the prompts' true ends, on one clock
            report["server_adds_p50_ms_from_true_end"] = round(one["p50"] - wav_true, 1)
    print(json.dumps(report, indent=1))
    (args.out / "bench_realtime.json").write_text(json.dumps(report, indent=1))


async def idle_rss(url: str, n: int) -> float:
    """RSS with ``n`` sessions open and idle (their graphs built and set up, nothing said)."""
    from websockets.asyncio.client import connect

    sockets = [await connect(f"{url}/realtime", max_size=None) for _ in range(n)]
    try:
        for ws in sockets:
            while json.loads(await ws.recv())["type"] != "session.created":
                pass
        await asyncio.sleep(3.0)  # setup() of every node (warm-ups) runs on the sessions' threads
        return rss_mb()
    finally:
        for ws in sockets:
            await ws.close()


if __name__ == "__main__":
    main()
