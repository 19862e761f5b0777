"""io=realtime: client-measured voice-to-voice over the WebSocket, beside io=wav, and memory per session.

Run: python benchmarks/bench_realtime.py [--repeat 1] [--sessions 1 2 4] [--skip-wav] [override ...]
     (default stack: recipe=local_cpu, its llama-server started here)

1. io=wav: ``s2s-run recipe=local_cpu bench=latency bench.repeat=N``: the engine's voice-to-voice
   (first reply audio at the sink - true end of speech), p50/p95 over the corpus.
2. io=realtime, in this process: a server on a free port; clients (the raw protocol over
   ``websockets``) play the same corpus (conf/bench/latency.yaml, one connection per prompt) at
   real-time pace in 20 ms appends. Voice-to-voice is measured by the client: the first
   ``response.output_audio.delta`` received - the moment the prompt's true end of speech was sent.
   With 1, 2 and 4 clients at once: p50/p95 and the process's peak RSS (sampled every 50 ms); the
   RSS each session after the first adds is (peak with k - peak with 1) / (k - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
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
from s2s_flow.server import managed_server  # noqa: E402

RATE = 24000
STEP = RATE // 50  # 20 ms per append, like a microphone


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return quantiles(values, n=100, method="inclusive")[round(q) - 1] if q != 50 else median(values)


def corpus(overrides: list[str]) -> tuple[Path, list[dict[str, Any]]]:
    cfg, choices = compose(["recipe=local_cpu", "bench=latency", *overrides])
    source = plan(cfg, choices).nodes["source"].node
    from s2s_flow.node import Context

    source.ctx = Context("source", Path(tempfile.mkdtemp()))
    source.setup()  # finds (or synthesizes once) the corpus
    directory = source.corpus_dir
    return directory, manifest(directory)["files"]


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def one_prompt(url: str, pcm: np.ndarray, speech_end_s: float) -> float | None:
    from websockets.asyncio.client import connect

    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    end_sample = round(speech_end_s * RATE)
    async with connect(f"{url}/realtime", max_size=None) as ws:
        first_audio: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def reader() -> None:
            async for text in ws:
                event = json.loads(text)
                if event["type"] == "response.output_audio.delta" and not first_audio.done():
                    first_audio.set_result(time.monotonic())
                if event["type"] == "response.done":
                    return

        task = asyncio.create_task(reader())
        start, t_end = time.monotonic(), None
        for i in range(0, len(data) // 2, STEP):
            await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))  # a microphone's pace
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(data[2 * i : 2 * (i + STEP)]).decode()}))
            if t_end is None and i + STEP >= end_sample:
                t_end = start + end_sample / RATE  # the true end of speech went out now (at the latest)
        silence = base64.b64encode(bytes(2 * STEP)).decode()
        while not task.done() and time.monotonic() - start < len(data) / 2 / RATE + 20:
            await asyncio.sleep(0.02)  # the microphone stays open: silence until the reply is done
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
        task.cancel()
        return (first_audio.result() - t_end) * 1000 if first_audio.done() and t_end else None


async def clients(url: str, n: int, prompts: list[tuple[np.ndarray, float]], repeat: int) -> list[float]:
    async def client(k: int) -> list[float]:
        out = []
        for r in range(repeat):
            for j in range(len(prompts)):
                pcm, end = prompts[(j + k * 3) % len(prompts)]  # each client its own order
                v2v = await one_prompt(url, pcm, end)
                if v2v is not None and not (r == 0 and j == 0):  # the first turn is the warm-up
                    out.append(v2v)
        return out

    results = await asyncio.gather(*(client(k) for k in range(n)))
    return [v for r in results for v in r]


def wav_side(repeat: int, overrides: list[str], out: Path) -> dict[str, Any]:
    run_dir = out / "wav"
    cmd = [sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", "bench=latency", f"bench.repeat={repeat}",
           f"hydra.run.dir={run_dir}", "metrics.timeline=false", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "metrics.json").read_text())["summary"]["voice_to_voice_ms"]
    return {"p50": summary.get("p50"), "p95": summary.get("p95"), "n": summary.get("n")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--skip-wav", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-realtime-")))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from nodes.io._realtime_app import RealtimeServer
    from s2s_flow.audio import resample

    directory, entries = corpus(args.overrides)
    import soundfile as sf

    prompts = []
    for e in entries:
        pcm, rate = sf.read(directory / e["file"], dtype="float32")
        prompts.append((resample(pcm, rate, RATE), float(e["speech_end_s"])))
    report: dict[str, Any] = {}
    if not args.skip_wav:
        print("io=wav ...", file=sys.stderr)
        report["wav"] = wav_side(args.repeat, args.overrides, args.out)
    cfg, choices = compose(["recipe=local_cpu", "io=realtime", "io.port=0", *args.overrides])
    graph = plan(cfg, choices)
    with managed_server(cfg.get("server"), args.out):
        server = RealtimeServer(lambda: plan(cfg, choices), graph.nodes["source"].node, args.out / "realtime")
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
                values = asyncio.run(clients(url, n, prompts, args.repeat))
                stop.set()
                sampler.join()
                report[f"realtime_{n}"] = {"p50": p(values, 50), "p95": p(values, 95), "n": len(values),
                                           "peak_rss_mb": round(max(peak), 1)}
        finally:
            server.stop()
    one = report.get("realtime_1", {}).get("peak_rss_mb")
    for n in args.sessions:
        row = report[f"realtime_{n}"]
        if n > 1 and one is not None:
            row["rss_per_extra_session_mb"] = round((row["peak_rss_mb"] - one) / (n - 1), 1)
    if "wav" in report and report.get("realtime_1", {}).get("p50") is not None and report["wav"]["p50"]:
        report["server_adds_p50_ms"] = round(report["realtime_1"]["p50"] - report["wav"]["p50"], 1)
    print(json.dumps(report, indent=1))
    (args.out / "bench_realtime.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
