"""What an open io=realtime session costs while nobody speaks: CPU and thread switches per second.

Run: python benchmarks/bench_idle.py [--sessions 8] [--seconds 30] [--repeat 3]
                                     [--server-tree OLD_TREE NEW_TREE] [override ...]

A client streams its microphone all the time, silence included (20 ms appends at 24 kHz, sent in
real time), and every such session costs the server CPU each second: the source, the VAD, the
event loop. At 8 sessions on 2 cores that is a share of the machine gone before anyone speaks, and
the turns of the ones who do speak compete with it. This opens ``--sessions`` sessions that stream
silence, waits 5 s for them to settle, then measures ``--seconds``: the server's Python process CPU
(ms per session-second) and by stage (``s2s_stage_cpu_seconds_total`` from ``/metrics``: each node's
threads, ``other`` for the event loop and the rest), llama-server's CPU (none expected), and the
Python process's context switches per session-second (voluntary and not, summed over its threads
from ``/proc``: thread wake-ups and waits for the GIL).

``--server-tree A B``: the same clients against the server started from each source tree (as in
``bench_realtime.py --conversations``), alternating A, B, A, B ... ``--repeat`` times. One run moves
by 20-30 % on a shared 2-core machine: compare the means of several alternated runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._conversations import ROOT, Mic, TreeServer, cpu_by_stage, scrape  # noqa: E402
from s2s_flow.machine import cpu_label  # noqa: E402


def switches(pid: int) -> int:
    """Context switches of every thread of ``pid`` so far (threads that ended are not counted)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            pass
    return total


async def stream_silence(port: int, stop: asyncio.Event) -> None:
    """One session whose microphone is open and hears nothing (the conversations benchmark's Mic)."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        async def read() -> None:
            async for _ in ws:
                pass

        tasks = [asyncio.create_task(read()), asyncio.create_task(Mic(ws).run())]
        await stop.wait()
        for task in tasks:
            task.cancel()


async def measure(server: TreeServer, sessions: int, seconds: float) -> dict[str, Any]:
    stop = asyncio.Event()
    clients = [asyncio.create_task(stream_silence(server.port, stop)) for _ in range(sessions)]
    await asyncio.sleep(5.0)
    metrics, cpu, ctx, t = scrape(server.port), server.cpu_s(), switches(server.proc.pid), time.monotonic()
    await asyncio.sleep(seconds)
    metrics2, cpu2, ctx2 = scrape(server.port), server.cpu_s(), switches(server.proc.pid)
    span = sessions * (time.monotonic() - t)
    stop.set()
    await asyncio.gather(*clients, return_exceptions=True)
    stages = cpu_by_stage(metrics, metrics2, span / 1000)  # CPU s per ms of a session: ms per session-second
    return {"python_ms": round(1000 * (cpu2[0] - cpu[0]) / span, 2),
            "llama_server_ms": round(1000 * (cpu2[1] - cpu[1]) / span, 2),
            "switches": round((ctx2 - ctx) / span, 1),
            "stages_ms": {k: v for k, v in stages.items() if v}}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree, alternating the trees")
    ap.add_argument("--server-tree", nargs="+", default=[str(ROOT)], metavar="PATH")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-idle-")))
    ap.add_argument("overrides", nargs="*", help="s2s-run overrides for every tree's server")
    args = ap.parse_args(argv)
    trees = [Path(t).expanduser().resolve() for t in args.server_tree]
    names = [f"{i}-{t.name}" for i, t in enumerate(trees)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    print(f"{cpu_label()}: {args.sessions} sessions streaming silence, {args.seconds:g} s a run")
    for r in range(args.repeat):
        for tree, name in zip(trees, names, strict=True):
            server = TreeServer(tree, args.sessions, ["llm.temperature=0", *args.overrides],
                                args.out / f"{name}-{r}", False)
            try:
                got = asyncio.run(measure(server, args.sessions, args.seconds))
            finally:
                server.stop()
            runs[name].append(got)
            stages = ", ".join(f"{k} {v}" for k, v in got["stages_ms"].items())
            print(f"  {name} run {r + 1}: {got['python_ms']} ms CPU per session-second ({stages}); "
                  f"llama-server {got['llama_server_ms']}; {got['switches']} context switches")
    print("\n| tree | runs | Python ms CPU / session-s: mean (min-max) | context switches / session-s |")
    print("|---|--:|--:|--:|")
    for name, got in runs.items():
        cpu = [g["python_ms"] for g in got]
        print(f"| {name} | {len(got)} | {mean(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) | "
              f"{mean(g['switches'] for g in got):.0f} |")
    (args.out / "idle.json").write_text(json.dumps({"cpu": cpu_label(), "sessions": args.sessions,
                                                    "seconds": args.seconds, "runs": runs}, indent=1))
    print(f"(results: {args.out / 'idle.json'})")


if __name__ == "__main__":
    main(sys.argv[1:])
