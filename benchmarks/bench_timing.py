"""The engine's timing on this machine: how soon a run stops, and how late a paced source's chunks are.

Run: python benchmarks/bench_timing.py [--repeat 5] [--skip-cli] [--skip-jitter]

The tests assert what happens (the run stops, nothing more flows, the end of speech is the VAD's
estimate placed by its chunk's own stamp); the times are machine- and load-dependent, so they
are measured here and printed (p50 / max over ``--repeat`` runs):

1. a node fails: from the failure to ``Scheduler.run()`` raising it (target: well under 1 s);
2. a node is stuck inside ``process()`` when another fails: the same, closing the stuck one to
   unblock it (target: under 1 s; the scheduler gives threads 0.3 s, then closes, then 0.6 s);
3. SIGINT / SIGTERM to a running graph in a process of its own: from the signal to the exit
   (target: 1 s);
4. SIGINT to ``s2s-run`` while a ``setup()`` is stalled on a server that never answers: from the
   signal to the exit (``--skip-cli`` leaves it out: each run starts the CLI);
5. the paced WAV source (io.realtime=true, 20 ms chunks) through the VAD: how late each chunk was
   made against its schedule (the first chunk's time + 20 ms per chunk; the first one's own
   lateness is the origin), and so how much the metrics' end of speech lies past the VAD's own
   stream estimate: the lateness of the chunk it was decided in (``--skip-jitter`` leaves it out).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: the small nodes, the test speech

from omegaconf import OmegaConf  # noqa: E402

from benchmarks._stats import percentile  # noqa: E402
from s2s_flow.errors import NodeFailed  # noqa: E402
from s2s_flow.graph import build_graph  # noqa: E402
from s2s_flow.machine import cpu_label  # noqa: E402
from s2s_flow.scheduler import Scheduler  # noqa: E402
from s2s_flow.validate import validate  # noqa: E402
from tests.support.managed import start_signalled_graph  # noqa: E402

T = "tests.support.nodes."
CHUNK_S = 0.020



def ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"p50 {1000 * percentile(values, 50):8.2f} ms, max {1000 * max(values):8.2f} ms (n={len(values)})"


def scheduler(run_dir: Path, chain: dict) -> Scheduler:
    cfg = OmegaConf.create({"chain": list(chain), **chain})
    return Scheduler(validate(build_graph(cfg)), run_dir)


def failing_node(run_dir: Path) -> float:
    """Seconds from a node's failure (its trace event) to run() raising it."""
    s = scheduler(run_dir, {"src": {"_target_": T + "CountSource", "n": 10**7}, "up": {"_target_": T + "Upper"},
                            "out": {"_target_": T + "Collect", "fail_on": ":5000"}})
    try:
        s.run()
    except NodeFailed:
        done = time.monotonic()
    failed = next(e["t"] for e in s.trace.events if e["kind"] == "error")
    return done - failed


def stuck_node(run_dir: Path) -> float:
    """Seconds from another node's failure to run() raising it while one node is blocked in process()."""
    s = scheduler(run_dir, {"src": {"_target_": T + "CountSource", "n": 3}, "stuck": {"_target_": T + "Blocker"},
                            "out": {"_target_": T + "Collect"}})
    stuck, failed = s.graph.nodes["stuck"].node, []

    def fail() -> None:
        if stuck.inside.wait(30):
            failed.append(time.monotonic())
            s._fail("out", RuntimeError("disk full"))

    threading.Thread(target=fail, daemon=True).start()
    try:
        s.run()
    except NodeFailed:
        done = time.monotonic()
    return done - failed[0]


def signal_to_exit(sig: signal.Signals) -> float:
    proc = start_signalled_graph(Path(tempfile.gettempdir()))
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 130, proc.returncode
    return took


def stalled_setup_to_exit(run_dir: Path) -> float:
    """SIGINT to s2s-run while a setup() waits on a socket that never answers."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        args = ["chain=[src,stall]", f"+src={{_target_:{T}CountSource,n:3}}",
                f"+stall={{_target_:{T}SocketStall,port:{port}}}", f"hydra.run.dir={run_dir}"]
        proc = subprocess.Popen([sys.executable, "-m", "s2s_flow.cli", *args], cwd=run_dir.parent, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        server.settimeout(60)
        conn, _ = server.accept()  # the setup() is stalled now
        with conn:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
            took = time.monotonic() - t0
    assert proc.returncode == 130, proc.returncode
    return took


def paced_jitter(run_dir: Path) -> tuple[list[float], list[float]]:
    """How late each chunk of a paced WAV source was made (s), and the same for the chunks the VAD
    decided its end-of-speech estimates in (what the metrics' end of speech lies past the estimate)."""
    import soundfile as sf

    from s2s_flow import metrics
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from tests.support.speech import speech_with_pauses

    pcm, _ = speech_with_pauses(["What is the weather like today?", "Tell me a joke about cats.",
                                 "Thank you very much."], 16000, pause_s=1.6, lead_s=0.6, tail_s=0.3)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    wav = run_dir.parent / "scripted.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    cfg, choices = compose(["chain=[io.source,vad]", f"io.input={wav}", "io.realtime=true"])
    cfg.nodes = OmegaConf.create({"chunks": {"_target_": T + "ChunkTimes"}})
    cfg.edges = ["source.audio -> chunks.audio"]
    s = Scheduler(plan(cfg, choices), run_dir)
    trace = s.run()
    made = sorted(s.graph.nodes["chunks"].node.made.items())  # (start in the stream, t)
    origin = made[0][1] - CHUNK_S  # the first chunk exists once its 20 ms were "recorded"
    late = {start: t - (origin + start + CHUNK_S) for start, t in made}
    report = metrics.report(trace, s.ring_stats, s.graph)
    # the chunk each end of speech was decided in: the VAD's emission falls in it
    decided = []
    for turn in report["turns"]:
        emitted = trace.nodes["vad"][turn["turn"]].last_out
        start = max((st for st, t in made if t <= emitted), default=None)
        if start is not None:
            decided.append(late[start])
    return list(late.values()), decided


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-cli", action="store_true", help="leave out the stalled-setup run of s2s-run")
    ap.add_argument("--skip-jitter", action="store_true", help="leave out the paced source (about 12 s a run)")
    args = ap.parse_args()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            run = Path(tmp) / f"run{i}"
            run.mkdir()
            results.setdefault("a node fails -> run() raises", []).append(failing_node(run))
            results.setdefault("a stuck node closed -> run() raises", []).append(stuck_node(run))
            for sig in (signal.SIGINT, signal.SIGTERM):
                results.setdefault(f"{sig.name} to a running graph -> exit", []).append(signal_to_exit(sig))
            if not args.skip_cli:
                results.setdefault("SIGINT to s2s-run, setup() stalled -> exit", []).append(
                    stalled_setup_to_exit(Path(tmp) / f"cli{i}"))
        if not args.skip_jitter:
            every, decided = [], []
            for i in range(max(1, args.repeat // 2)):
                a, b = paced_jitter(Path(tmp) / f"paced{i}" / "run")
                every += a
                decided += b
            results["paced chunk made late (every chunk)"] = every
            results["paced chunk late where the VAD decided (metrics' share)"] = decided
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nengine timing on {cpu_label()}, load average {load:.1f}")
    for label, values in results.items():
        print(f"  {label:<58} {ms(values)}")


if __name__ == "__main__":
    main()
