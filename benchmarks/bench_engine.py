"""Engine overhead: a chain of 6 pass-through nodes on s2s-flow rings vs on queue.Queue.

Run: python benchmarks/bench_engine.py [--messages 200000] [--rounds 5] [--capacity N] [--memory 1000000]

The chains move the same mix of 20 ms audio chunks (320 float32 samples) and small text
messages from a source thread through 6 pass-through threads to a sink, in one process.
Rounds alternate between the chains, so a noisy neighbour hurts all alike; medians and
ranges over the rounds are reported. Measured:

- throughput: messages/s with the source unpaced (the chain saturated);
- per-hop latency p50/p99: end-to-end latency / 7 hops, source paced at 2 kHz;
- where the time goes: CPU time per message of each thread and voluntary context
  switches per 1000 messages (on this kind of machine a hand-over between two threads
  on different cores costs tens of microseconds; the ping-pong figure shows it);
- RSS over 1M messages, and the cost of `s2s-run dry_run=true`.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._host import host_load, host_ticks  # noqa: E402
from benchmarks._stats import percentile  # noqa: E402
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


def thread_usage() -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of the calling thread so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return time.thread_time(), switches


class Usage:
    """Per-thread usage, written by each thread when its stream ends."""

    def __init__(self) -> None:
        self.by_thread: dict[str, tuple[float, int]] = {}

    def record(self, name: str) -> None:
        self.by_thread[name] = thread_usage()


class Source(Node):
    outputs = {"out": Message}

    def __init__(self, *, n: int, pace_hz: float = 0.0):
        self.n, self.pace_hz = n, pace_hz

    def produce(self) -> Iterator[Message]:
        yield from messages(self.n, self.pace_hz)
        self.usage = thread_usage()


class Pass(Node):
    inputs = {"in": Message}
    outputs = {"out": Message}

    def process(self, port: str, msg: Message) -> Message:
        return msg

    def finish(self) -> None:
        self.usage = thread_usage()


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

    def finish(self) -> None:
        self.usage = thread_usage()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Result:
    def __init__(self, secs: float, latencies: list[float], usage: dict[str, tuple[float, int]],
                 rss: list[float] | None = None):
        self.secs, self.latencies, self.usage, self.rss = secs, latencies, usage, rss or []


def run_rings(n: int, pace_hz: float = 0.0, *, capacity: int = 0, rss_every: int = 0) -> Result:
    me = f"{__name__}."
    passes = [f"p{i}" for i in range(6)]
    cfg = {"chain": ["source", *passes, "sink"],
           "source": {"_target_": me + "Source", "n": n, "pace_hz": pace_hz},
           "sink": {"_target_": me + "Sink", "sample_rss_every": rss_every},
           **{p: {"_target_": me + "Pass"} for p in passes}}
    if capacity:
        cfg["rings"] = {dst: {"in": {"capacity": capacity}} for dst in [*passes, "sink"]}
    graph = validate(build_graph(OmegaConf.create(cfg)))
    nodes = {name: spec.node for name, spec in graph.nodes.items()}
    t0 = time.perf_counter()
    Scheduler(graph, Path("/tmp")).run()
    secs = time.perf_counter() - t0
    usage = {name: node.usage for name, node in nodes.items()}
    return Result(secs, nodes["sink"].latencies, usage, nodes["sink"].rss)


def run_queues(n: int, pace_hz: float = 0.0) -> Result:
    """The reference mechanism: threads joined by unbounded queue.Queue, None ends the stream."""
    qs = [queue.Queue() for _ in range(HOPS)]
    latencies: list[float] = []
    usage = Usage()

    def passthrough(name: str, q_in: queue.Queue, q_out: queue.Queue) -> None:
        while True:
            m = q_in.get()
            q_out.put(m)
            if m is None:
                usage.record(name)
                return

    def sink(q_in: queue.Queue) -> None:
        while (m := q_in.get()) is not None:
            latencies.append(time.monotonic() - m.t)
        usage.record("sink")

    def source() -> None:
        for m in messages(n, pace_hz):
            qs[0].put(m)
        qs[0].put(None)
        usage.record("source")

    threads = [threading.Thread(target=passthrough, args=(f"p{i}", qs[i], qs[i + 1])) for i in range(HOPS - 1)]
    threads += [threading.Thread(target=sink, args=(qs[-1],)), threading.Thread(target=source)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Result(time.perf_counter() - t0, latencies, usage.by_thread)


def per_hop(latencies: list[float]) -> tuple[float, float]:
    a = np.asarray(latencies) / HOPS * 1e3
    return percentile(a, 50), percentile(a, 99)


def handoff_us(same_core: bool) -> float:
    """One hand-over between two threads that wake each other through a lock, in microseconds."""
    n = 5000
    a, b = threading.Lock(), threading.Lock()
    a.acquire()
    b.acquire()
    mask = os.sched_getaffinity(0)
    if same_core:
        os.sched_setaffinity(0, {min(mask)})  # this thread; the helper inherits it

    def pong() -> None:
        for _ in range(n):
            a.acquire()
            b.release()

    t = threading.Thread(target=pong)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        a.release()
        b.acquire()
    secs = time.perf_counter() - t0
    t.join()
    os.sched_setaffinity(0, mask)
    return secs / n / 2 * 1e6


_DRY_RUN = """
import sys
from s2s_flow.cli import main
sys.argv = ["s2s-run", "dry_run=true"]
try:
    main()
finally:
    peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(int(peak.split()[1]) / 1024, file=sys.stderr)
"""


def dry_run_cost() -> tuple[float, float]:
    """Wall time and peak RSS of `s2s-run dry_run=true`, the peak read by the child itself
    (a fork of this big process would count this process's pages as the child's)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _DRY_RUN], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    return wall, float(proc.stderr.strip().splitlines()[-1])


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--paced", type=int, default=4000, help="messages in each latency run (2 kHz)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=0, help="ring capacity of every edge (0 = engine default)")
    ap.add_argument("--memory", type=int, default=1_000_000, help="messages in the RSS run (0 = skip)")
    args = ap.parse_args()

    chains = {"s2s-flow rings": lambda n, hz=0.0: run_rings(n, hz, capacity=args.capacity),
              "queue.Queue": run_queues}
    rate: dict[str, list[float]] = {c: [] for c in chains}
    p50: dict[str, list[float]] = {c: [] for c in chains}
    p99: dict[str, list[float]] = {c: [] for c in chains}
    usage: dict[str, list[dict[str, tuple[float, int]]]] = {c: [] for c in chains}
    for chain in chains.values():
        chain(2000)  # warm-up
    ticks0 = host_ticks()
    for _ in range(args.rounds):
        for name, chain in chains.items():
            r = chain(args.messages)
            rate[name].append(args.messages / r.secs)
            usage[name].append(r.usage)
            lat = chain(args.paced, 2000.0).latencies
            hop50, hop99 = per_hop(lat)
            p50[name].append(hop50)
            p99[name].append(hop99)
    # on a VM the hypervisor's steal time shows as stalls of milliseconds that no thread hand-over
    # explains (the p99 tail)
    stolen = host_load(ticks0, host_ticks()).get("stolen_pct", 0.0)

    cap = f"capacity {args.capacity}" if args.capacity else f"default ring capacity ({Message.ring[0]})"
    print(f"\n6 pass-through nodes, {args.messages} msgs per round (half 20 ms audio, half text), {args.rounds} "
          f"rounds, {cap}; Python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}, {stolen:.1f} % of CPU time stolen by the hypervisor")
    print("median (min-max) over rounds")
    print(f"{'chain':<16} {'msgs/s':>22} {'hop p50 ms':>22} {'hop p99 ms':>22}")
    for name in chains:
        print(f"{name:<16} {spread(rate[name], '.0f'):>22} {spread(p50[name], '.3f'):>22} "
              f"{spread(p99[name], '.3f'):>22}")
    for name in list(chains)[:-1]:
        ratios = [a / b for a, b in zip(rate[name], rate["queue.Queue"], strict=True)]
        hops = [a / b for a, b in zip(p50[name], p50["queue.Queue"], strict=True)]
        print(f"{name} / queue.Queue per round: throughput {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}x); hop p50 {' '.join(f'{r:.2f}' for r in hops)} "
              f"(median {statistics.median(hops):.2f}x)")

    print("\nwhere the time goes (saturated, median over rounds): CPU us per message / voluntary switches "
          "per 1000 messages")
    threads = ["source", *[f"p{i}" for i in range(6)], "sink"]
    print(f"{'chain':<16} " + " ".join(f"{t:>10}" for t in threads) + f" {'total':>10}")
    for name in chains:
        cells, total_cpu, total_sw = [], 0.0, 0.0
        for t in threads:
            cpu = statistics.median(u[t][0] for u in usage[name]) / args.messages * 1e6
            sw = statistics.median(u[t][1] for u in usage[name]) / args.messages * 1e3
            total_cpu += cpu
            total_sw += sw
            cells.append(f"{cpu:4.1f}/{sw:<5.1f}")
        print(f"{name:<16} " + " ".join(f"{c:>10}" for c in cells) + f" {total_cpu:4.1f}/{total_sw:<5.1f}")
    print(f"thread hand-over through a lock: {handoff_us(False):.1f} us across cores, "
          f"{handoff_us(True):.1f} us on one core")

    if args.memory:
        r = run_rings(args.memory, rss_every=args.memory // 10, capacity=args.capacity)
        print(f"\nRSS over {args.memory} msgs ({r.secs:.1f} s): " + " ".join(f"{x:.1f}" for x in r.rss)
              + f" MB (growth {r.rss[-1] - r.rss[0]:+.1f} MB)")
    wall, peak = dry_run_cost()
    print(f"s2s-run dry_run=true: {wall:.2f} s wall, {peak:.0f} MB peak RSS")


if __name__ == "__main__":
    main()
