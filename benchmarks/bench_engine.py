"""Engine overhead: a chain of 6 pass-through nodes on s2s-flow rings vs on queue.Queue.

Run: python benchmarks/bench_engine.py [--messages 200000] [--memory 1000000]

Both chains move the same mix of 20 ms audio chunks (320 float32 samples) and small text
messages from a source thread through 6 pass-through threads to a sink, in one process,
one after the other. Reported: throughput (messages/s, saturated), per-hop latency
p50/p99 (end-to-end latency / 7 hops, with the source paced at 2 kHz so the chain is
not saturated), RSS over 1M messages, and the cost of `s2s-run dry_run=true`.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_flow.graph import build_graph  # noqa: E402
from s2s_flow.messages import AudioChunk, Message, TextDelta  # noqa: E402
from s2s_flow.node import Node  # noqa: E402
from s2s_flow.scheduler import Scheduler  # noqa: E402
from s2s_flow.validate import validate  # noqa: E402

HOPS = 7  # source -> 6 pass-through -> sink
PCM = np.zeros(320, np.float32)


def messages(n: int, pace_hz: float | None) -> Iterator[Message]:
    t0 = time.perf_counter()
    for i in range(n):
        if pace_hz:
            wait = t0 + i / pace_hz - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        yield AudioChunk(pcm=PCM, rate=16000) if i % 2 else TextDelta(text="hi")


class Source(Node):
    outputs = {"out": Message}

    def __init__(self, *, n: int, pace_hz: float = 0.0):
        self.n, self.pace_hz = n, pace_hz

    def produce(self) -> Iterator[Message]:
        return messages(self.n, self.pace_hz)


class Pass(Node):
    inputs = {"in": Message}
    outputs = {"out": Message}

    def process(self, port: str, msg: Message) -> Message:
        return msg


class Sink(Node):
    inputs = {"in": Message}

    def __init__(self, *, sample_rss_every: int = 0):
        self.latencies: list[float] = []
        self.count = 0
        self.every = sample_rss_every
        self.rss: list[float] = []

    def process(self, port: str, msg: Message) -> None:
        self.count += 1
        if self.every:
            if self.count % self.every == 0:
                self.rss.append(rss_mb())
        else:
            self.latencies.append(time.monotonic() - msg.t)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_rings(n: int, pace_hz: float = 0.0, rss_every: int = 0) -> tuple[float, Sink]:
    me = f"{__name__}."
    cfg = {"chain": ["src", *[f"p{i}" for i in range(6)], "sink"],
           "src": {"_target_": me + "Source", "n": n, "pace_hz": pace_hz},
           "sink": {"_target_": me + "Sink", "sample_rss_every": rss_every},
           **{f"p{i}": {"_target_": me + "Pass"} for i in range(6)}}
    graph = validate(build_graph(OmegaConf.create(cfg)))
    sink = graph.nodes["sink"].node
    t0 = time.perf_counter()
    Scheduler(graph, Path("/tmp")).run()
    return time.perf_counter() - t0, sink  # type: ignore[return-value]


def run_queues(n: int, pace_hz: float = 0.0) -> tuple[float, list[float]]:
    """The reference mechanism: threads joined by unbounded queue.Queue, None ends the stream."""
    qs = [queue.Queue() for _ in range(HOPS)]
    latencies: list[float] = []

    def passthrough(q_in: queue.Queue, q_out: queue.Queue) -> None:
        while True:
            m = q_in.get()
            q_out.put(m)
            if m is None:
                return

    def sink(q_in: queue.Queue) -> None:
        while (m := q_in.get()) is not None:
            latencies.append(time.monotonic() - m.t)

    threads = [threading.Thread(target=passthrough, args=(qs[i], qs[i + 1])) for i in range(HOPS - 1)]
    threads.append(threading.Thread(target=sink, args=(qs[-1],)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for m in messages(n, pace_hz):
        qs[0].put(m)
    qs[0].put(None)
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies


def per_hop(latencies: list[float]) -> tuple[float, float]:
    a = np.asarray(latencies) / HOPS * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def dry_run_cost() -> tuple[float, float]:
    exe = Path(sys.executable).with_name("s2s-run")
    t0 = time.perf_counter()
    subprocess.run([str(exe), "dry_run=true"], check=True, capture_output=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return wall, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--paced", type=int, default=4000, help="messages in the latency runs (2 kHz)")
    ap.add_argument("--memory", type=int, default=1_000_000, help="messages in the RSS run (0 = skip)")
    args = ap.parse_args()

    rows = []
    for name, fn in (("s2s-flow rings", run_rings), ("queue.Queue", run_queues)):
        run_rings(2000) if fn is run_rings else run_queues(2000)  # warm-up
        secs, _ = fn(args.messages)
        _, lat = fn(args.paced, 2000.0)
        lat = lat.latencies if isinstance(lat, Sink) else lat
        p50, p99 = per_hop(lat)
        rows.append((name, args.messages / secs, p50, p99))
    print(f"\n6 pass-through nodes, {args.messages} msgs (half 20 ms audio, half text), Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cores")
    print(f"{'chain':<16} {'msgs/s':>10} {'hop p50 ms':>11} {'hop p99 ms':>11}")
    for name, rate, p50, p99 in rows:
        print(f"{name:<16} {rate:>10.0f} {p50:>11.3f} {p99:>11.3f}")
    print(f"throughput ratio rings/queue: {rows[0][1] / rows[1][1]:.2f}x")

    if args.memory:
        secs, sink = run_rings(args.memory, rss_every=args.memory // 10)
        print(f"\nRSS over {args.memory} msgs ({secs:.1f} s): " + " ".join(f"{r:.1f}" for r in sink.rss)
              + f" MB (growth {sink.rss[-1] - sink.rss[0]:+.1f} MB)")
    wall, peak = dry_run_cost()
    print(f"s2s-run dry_run=true: {wall:.2f} s wall, {peak:.0f} MB peak RSS")


if __name__ == "__main__":
    main()
