"""io=realtime under abuse: a normal session's voice-to-voice with and without each abuse beside it,
and the server's RSS and thread count before and after.

Run: python benchmarks/bench_abuse.py [--prompts 6] [--abuse none idle flood frames storm stall none] [override ...]
     (a real `s2s-run recipe=local_cpu io=realtime` process with its managed llama-server; ~10 min on 2 cores)

The server is its own process (its RSS and threads are read with psutil); the normal client plays
the bench=latency corpus at a microphone's pace (benchmarks/bench_realtime.py's client) and measures
voice-to-voice (first reply audio received - the prompt's true end of speech); refused for want of a
slot (the abuser's connections hold them), it retries, and the refusals are counted. Each abuser runs in a
process of its own meanwhile, for as long as the normal client plays, from loopback addresses of its
own (127.0.0.2, the idle connections 127.0.0.10-29; the normal client is 127.0.0.1), so that the
per-address limits (io.client_limits, exempt=[] here) judge it as a client of its own:

- idle:   20 connections that never send anything (closed by io.idle_timeout_s, set to 5 s here)
- flood:  one client sending 1,000 small events a second (read at io.max_events_per_s, told once)
- frames: 10 MB frames, one after another, reconnecting after each close (1009: message too big)
- storm:  200 connections in 10 s from one address (up to 32 at once), each opened, its first event
          read, closed (sessions, or client_rate_limited / client_session_limit past io.client_limits,
          or session_limit_reached past io.max_sessions, 24 here)
- stall:  a client that asks for a long reply every 2 s and never reads: once its socket takes no
          more (the server bounds what the kernel holds per client to 256 KiB) and over
          io.max_queued_bytes (256 KiB here) wait, it is closed send_queue_full (1008); a reply
          that fits stays active (further asks are answered conversation_already_has_active_response)
          and the client is closed by io.idle_timeout_s once it stops sending. The normal client,
          which reads, is never judged by a burst of its own reply's audio (tested in
          tests/test_realtime_turns.py, with send_queue_full's 1008)

After each phase the bench waits for the server's sessions to end and prints RSS and threads, and
the CPU seconds the phase cost the server (with its llama-server) and the abuser: on a machine
of few cores the abuser's own work (a 10 MB frame built and masked, 200 handshakes) would compete
with the server's, so it runs at nice 19, as if on a machine of its own. Each abuser prints what
it was answered. The phases "none" (by default the first and the last) measure the noise: the
spread of their medians is what an abuse may move the normal session's voice-to-voice by without
it meaning anything. On a shared machine the figures are indicative only: run it in a quiet window.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_realtime import RATE, corpus, one_prompt, p  # noqa: E402
from tests.support.realtime_process import free_port, get, realtime_process  # noqa: E402

ABUSES = ("idle", "flood", "frames", "storm", "stall")
ABUSER = "127.0.0.2"  # the abusers' own loopback address (Linux answers all of 127.0.0.0/8)
STORY = "Tell me a long story about a dragon who learns to cook, with every step of every recipe."


def _sync(url: str, source: str = ABUSER, **kwargs: Any) -> Any:
    from websockets.sync.client import connect

    if "sock" not in kwargs:
        kwargs["source_address"] = (source, 0)
    return connect(f"{url}/realtime", open_timeout=30, **kwargs)


def _first(ws: Any) -> str:
    event = json.loads(ws.recv(timeout=60))
    return event["error"]["code"] if event["type"] == "error" else event["type"]


def _until_closed(ws: Any, timeout: float = 60) -> tuple[list[str], int | None]:
    """The events' kinds (error codes for errors) and the close code, until the server closes."""
    from websockets.exceptions import ConnectionClosed

    kinds: list[str] = []
    try:
        while True:
            event = json.loads(ws.recv(timeout=timeout))
            kinds.append(event["error"]["code"] if event["type"] == "error" else event["type"])
    except ConnectionClosed as closed:
        return kinds, closed.rcvd.code if closed.rcvd is not None else None
    except TimeoutError:
        return kinds, None


def _stalled(url: str, ask: list[str], end: float) -> tuple[list[str], int | None]:
    """A client that asks for a long reply every 2 s and never reads (sans-I/O websockets on a raw
    socket: a client library's reader would read, or stop its sends with its reads). Then what it
    had been sent: the events' kinds (error codes) and the close code."""
    from websockets.client import ClientProtocol
    from websockets.frames import Opcode
    from websockets.uri import parse_uri

    proto = ClientProtocol(parse_uri(f"{url}/realtime"), max_size=None)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((ABUSER, 0))
    host, port = url.removeprefix("ws://").split("/")[0].rsplit(":", 1)
    sock.connect((host, int(port)))
    proto.send_request(proto.connect())
    sock.sendall(b"".join(proto.data_to_send()))
    events: list[Any] = []
    while not any(getattr(e, "opcode", None) is Opcode.TEXT for e in events):  # the handshake, session.created
        proto.receive_data(sock.recv(65536))
        events += proto.events_received()
    try:
        while time.monotonic() < end:  # nothing read: the kernel's buffers fill, then the server's queue
            for text in ask:
                proto.send_text(text.encode())
            sock.sendall(b"".join(proto.data_to_send()))
            time.sleep(2.0)
    except OSError:  # dropped by the server
        pass
    sock.settimeout(30)
    with contextlib.suppress(OSError):
        while data := sock.recv(1 << 20):
            proto.receive_data(data)
            events += proto.events_received()
    sock.close()
    kinds = []
    for e in events:
        if getattr(e, "opcode", None) is Opcode.TEXT:
            event = json.loads(e.data)
            kinds.append(event["error"]["code"] if event["type"] == "error" else event["type"])
    return kinds, proto.close_rcvd.code if proto.close_rcvd is not None else None


def abuse(kind: str, url: str, seconds: float) -> dict[str, Any]:
    """One abuser, for ``seconds``: what the server answered it."""
    end = time.monotonic() + seconds
    if kind == "idle":
        from concurrent.futures import ThreadPoolExecutor

        def idle(i: int) -> tuple[list[str], int | None]:
            with _sync(url, f"127.0.0.{10 + i}") as ws:
                return _until_closed(ws, timeout=seconds + 60)

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(idle, range(20)))
        return {"connections": 20, "errors": dict(Counter(k for r in results for k in r[0] if k != "session.created")),
                "close_codes": dict(Counter(str(r[1]) for r in results))}
    if kind == "flood":
        tiny = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAAAA=="})
        from websockets.exceptions import ConnectionClosed

        sent, sessions, codes, errors = 0, 0, Counter(), Counter()
        while time.monotonic() < end:  # 1,000 a second until closed, then again
            with _sync(url) as ws:
                _first(ws)
                sessions += 1
                try:
                    while time.monotonic() < end:
                        start = time.monotonic()
                        for _ in range(100):
                            ws.send(tiny)
                        sent += 100
                        time.sleep(max(0.0, 0.1 - (time.monotonic() - start)))
                except (ConnectionClosed, OSError):
                    pass
                kinds, code = _until_closed(ws, timeout=5)
                errors.update(k for k in kinds if k != "session.created")
                codes[str(code)] += 1
        return {"sent": sent, "sessions": sessions, "errors": dict(errors), "close_codes": dict(codes)}
    if kind == "frames":
        big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (10 << 20)})
        codes: Counter[str] = Counter()
        while time.monotonic() < end:
            with _sync(url, max_size=None) as ws:
                _first(ws)
                with contextlib.suppress(Exception):  # the server closed while the frame was still going out
                    ws.send(big)
                codes[str(_until_closed(ws)[1])] += 1
        return {"frames_10mb": sum(codes.values()), "close_codes": dict(codes)}
    if kind == "storm":
        from concurrent.futures import ThreadPoolExecutor

        start = time.monotonic()

        def one(i: int) -> str:
            time.sleep(max(0.0, start + i * 0.05 - time.monotonic()))  # 200 in 10 s
            try:
                with _sync(url) as ws:
                    return _first(ws)
            except Exception as exc:
                return type(exc).__name__

        with ThreadPoolExecutor(32) as pool:
            answers = Counter(pool.map(one, range(200)))
        return {"connections": 200, "in_s": round(time.monotonic() - start, 1), "answers": dict(answers)}
    if kind == "stall":
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": STORY}]}
        ask = [json.dumps({"type": "conversation.item.create", "item": item}), json.dumps({"type": "response.create"})]
        results: Counter[str] = Counter()
        while time.monotonic() < end:
            kinds, code = _stalled(url, ask, end)
            results[f"{kinds[-1] if kinds else '-'}/{code}"] += 1
        return {"stalled_clients": sum(results.values()), "last_event/close": dict(results)}
    raise SystemExit(f"unknown abuse {kind!r}: one of {', '.join(ABUSES)}")


def server_figures(pid: int) -> dict[str, float]:
    """The s2s-run process's RSS and threads, and the CPU seconds of it and its llama-server so far."""
    import psutil

    proc = psutil.Process(pid)
    cpu = sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
    return {"rss_mb": round(proc.memory_info().rss / 2**20, 1), "threads": proc.num_threads(), "cpu_s": cpu}


def settle(served: Any, timeout: float = 120.0) -> None:
    """Until the server holds no session (its /healthz), then a moment for its threads to go."""
    deadline = time.monotonic() + timeout
    while get(served.http + "/healthz")[1].get("sessions", 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)


async def normal_session(url: str, prompts: list[tuple[np.ndarray, float]], refused: Counter) -> list[float]:
    """One connection per prompt, as bench_realtime.py; a client refused (session_limit_reached: the
    abuser holds the slots) retries, as a real one would, and ``refused`` counts it."""
    import websockets

    v2v = []
    for pcm, end_s in prompts:
        while True:
            async with websockets.connect(f"{url}/realtime", max_size=None, open_timeout=60,
                                          local_addr=("127.0.0.1", 0)) as ws:
                if '"session.created"' not in (first := await ws.recv()):
                    refused["normal_session_refused"] += 1
                    refused[f"normal_refused:{json.loads(first).get('error', {}).get('code')}"] += 1
                    await asyncio.sleep(0.2)
                    continue
                turn = await one_prompt(ws, pcm, end_s, forget=False)
                if turn is not None:
                    v2v.append(turn["v2v"])
                break
    return v2v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6, help="the corpus' prompts the normal session plays per phase")
    ap.add_argument("--abuse", nargs="+", default=["none", *ABUSES, "none"], choices=["none", *ABUSES],
                    help="the phases, in order; 'none': the normal session alone (twice or more: the noise)")
    ap.add_argument("--abuser", nargs=3, metavar=("KIND", "URL", "SECONDS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-abuse-")))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.abuser:
        import os
        import resource

        os.nice(19)  # the abuser would be another machine: it takes what the server leaves idle

        kind, url, seconds = args.abuser
        answered = abuse(kind, url, float(seconds))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({**answered, "abuser_cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}))
        return
    import soundfile as sf

    from s2s_flow.audio import resample

    directory, entries = corpus(args.overrides)
    prompts = []
    for e in entries[: args.prompts]:
        pcm, rate = sf.read(directory / e["file"], dtype="float32")
        prompts.append((resample(pcm, rate, RATE), float(e["speech_end_s"])))
    play_s = sum(len(pcm) / RATE + 3 for pcm, _ in prompts)
    # admission by count only (io.target_ms=null): by load, a small machine whose replies start over
    # 1 s after the user stops refuses the abusers' sessions (session_limit_reached) and the abuse
    # is never met; here each abuser reaches a session, so each limit is what stops it
    overrides = [f"llm.base_url=http://127.0.0.1:{free_port()}/v1", "io.idle_timeout_s=5", "io.max_sessions=24",
                 "io.target_ms=null",
                 "io.max_queued_bytes=262144", *args.overrides]
    if "client_limits" in (Path(__file__).resolve().parents[1] / "conf/io/realtime.yaml").read_text():
        overrides.insert(0, "io.client_limits.exempt=[]")  # loopback is exempt as shipped
    rows = []
    with realtime_process(args.out, *overrides) as served:
        # warm: first turns, pools, and each prompt once (llama-server's prompt cache: the first phase
        # to play a prompt would be slower than the ones after it)
        asyncio.run(normal_session(served.url, prompts, Counter()))
        settle(served)
        for phase in args.abuse:
            before = server_figures(served.proc.pid)
            abuser = None
            if phase != "none":
                abuser = subprocess.Popen([sys.executable, __file__, "--abuser", phase, served.url, str(play_s)],
                                          stdout=subprocess.PIPE, text=True)
            refused: Counter[str] = Counter()
            v2v = asyncio.run(normal_session(served.url, prompts, refused))
            answered = json.loads(abuser.communicate(timeout=900)[0] or "{}") if abuser else {}
            settle(served)
            after = server_figures(served.proc.pid)
            rows.append({"abuse": phase, "turns": len(v2v), "v2v_p50_ms": p(v2v, 50), "v2v_p95_ms": p(v2v, 95),
                         "rss_mb_before": before["rss_mb"], "rss_mb_after": after["rss_mb"],
                         "threads_before": before["threads"], "threads_after": after["threads"],
                         "server_cpu_s": round(after["cpu_s"] - before["cpu_s"], 1),
                         "answered": answered, **refused})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| abuse | turns | v2v p50 / p95 ms | RSS MB before / after | threads before / after "
          "| CPU s: server / abuser |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['abuse']} | {r['turns']} | {r['v2v_p50_ms']} / {r['v2v_p95_ms']} | "
              f"{r['rss_mb_before']} / {r['rss_mb_after']} | {r['threads_before']} / {r['threads_after']} | "
              f"{r['server_cpu_s']} / {r['answered'].get('abuser_cpu_s', '-')} |")
    quiet = [r["v2v_p50_ms"] for r in rows if r["abuse"] == "none" and r["turns"]]
    if len(quiet) > 1:
        print(f"\nnoise (the no-abuse phases' v2v p50): {min(quiet)} - {max(quiet)} ms, "
              f"spread {round(max(quiet) - min(quiet), 1)} ms")
        for r in rows:
            if r["abuse"] != "none" and r["turns"]:
                v = r["v2v_p50_ms"]
                off = round(v - max(quiet) if v > max(quiet) else min(v - min(quiet), 0), 1)
                print(f"  {r['abuse']}: p50 {v} ms, " + ("within the noise" if not off else f"{off:+} ms beyond it"))


if __name__ == "__main__":
    main()
