"""io=realtime over WebRTC: client-measured voice-to-voice, and the pacing of the reply's RTP audio.

Run: python benchmarks/bench_webrtc.py [--prompts 8] [override ...]
     (default stack: recipe=local_cpu, its llama-server started here)

A server on a free port (``POST /v1/realtime/calls``); one aiortc client, in a process of its own
(as a real client would be: not on the server's GIL), calls it over loopback ICE and plays the
``bench=latency`` corpus as its microphone (Opus, 48 kHz, a 20 ms frame every 20 ms), each prompt
once the previous reply has played out (``output_audio_buffer.stopped``). Voice-to-voice: the first
audible frame of the reply received (a sample over 300 of 32767: the TTS's leading silence counts,
where bench_realtime.py takes the first audio delta) - the moment the prompt's true end of speech
was "recorded".
Pacing: the gaps between the reply's received frames (p50/p95/max; 20 ms is perfect pacing) and
the frames received per second of the call, silence included (50 is one per 20 ms). Both sides
read the machine's one monotonic clock. ``--idle-s 20``: instead, one call that stays silent both
ways for that long (the microphone sends silence, the server its silent frames), and the server
process's CPU time per second of it, beside the same process with no call (Opus both ways, the
session's VAD on the silence). On a shared or loaded machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_realtime import corpus, p  # noqa: E402
from s2s_flow.cli import plan  # noqa: E402
from s2s_flow.compose import compose  # noqa: E402
from s2s_flow.model_server import managed_server  # noqa: E402

RATE = 48000
FRAME = RATE // 50


async def client(base: str, prompts: list[tuple[np.ndarray, float]], idle_s: float = 0.0) -> dict[str, Any]:
    import urllib.request

    import av
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    from nodes.io.realtime.ice import host_addresses

    class Mic(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.queue, self.start, self.pts, self.sent = np.zeros(0, np.int16), None, 0, 0

        async def recv(self) -> Any:
            if self.start is None:
                self.start = time.monotonic()
            else:
                self.pts += FRAME
                await asyncio.sleep(max(0.0, self.start + self.pts / RATE - time.monotonic()))
            out = np.zeros(FRAME, np.int16)
            take = min(FRAME, len(self.queue))
            out[:take], self.queue = self.queue[:take], self.queue[take:]
            self.sent += FRAME
            frame = av.AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
            return frame

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    mic = Mic()
    pc.addTrack(mic)
    channel = pc.createDataChannel("oai-events")
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    channel.on("message", lambda text: events.put_nowait(json.loads(text)))
    arrivals: list[tuple[float, bool]] = []  # (when, audible) per received frame

    async def listen(track: Any) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            arrivals.append((time.monotonic(), bool(np.abs(frame.to_ndarray()).max() > 300)))

    pc.on("track", lambda track: asyncio.ensure_future(listen(track)))
    with host_addresses(["127.0.0.1"]):
        await pc.setLocalDescription(await pc.createOffer())
    request = urllib.request.Request(base + "/v1/realtime/calls", data=pc.localDescription.sdp.encode(),
                                     headers={"Content-Type": "application/sdp"}, method="POST")
    answer = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=60).read().decode())
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))

    async def until(kind: str) -> dict[str, Any]:
        while True:
            event = await asyncio.wait_for(events.get(), 120)
            if event["type"] == kind:
                return event

    await until("session.created")
    if idle_s:
        await asyncio.sleep(idle_s)
        await pc.close()
        return {"idle_s": idle_s, "frames": len(arrivals)}
    turns, gaps = [], []
    for pcm, speech_end_s in prompts:
        while mic.start is None:
            await asyncio.sleep(0.01)
        pcm16 = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
        lead = len(mic.queue)
        mic.queue = np.concatenate([mic.queue, pcm16, np.zeros(RATE, np.int16)])
        true_end = mic.start + (mic.sent + lead) / RATE + speech_end_s
        start = len(arrivals)
        await until("output_audio_buffer.started")
        await until("output_audio_buffer.stopped")
        mine = arrivals[start:]
        first = next((t for t, loud in mine if loud and t > true_end), None)
        if first is not None:
            turns.append(1000 * (first - true_end))
        loud_at = [i for i, (_, loud) in enumerate(mine) if loud]
        if loud_at:
            times = [t for t, _ in mine[loud_at[0]: loud_at[-1] + 1]]
            gaps += [1000 * (b - a) for a, b in zip(times, times[1:], strict=False)]
    span = arrivals[-1][0] - arrivals[0][0] if len(arrivals) > 1 else 0.0
    await pc.close()
    return {"v2v_ms": turns, "gaps_ms": gaps, "frames_per_s": len(arrivals) / span if span else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="play the first N prompts of the corpus")
    ap.add_argument("--idle-s", type=float, default=0.0, help="one silent call this long: the server's CPU")
    ap.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the client process: call URL
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-webrtc-")))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import soundfile as sf

    from s2s_flow.audio import resample

    directory, entries = corpus(args.overrides)
    prompts = []
    for e in entries[: args.prompts or None]:
        pcm, rate = sf.read(directory / e["file"], dtype="float32")
        prompts.append((resample(pcm, rate, RATE), float(e["speech_end_s"])))
    if args.client:
        print(json.dumps(asyncio.run(client(args.client, prompts, args.idle_s))))
        return
    from nodes.io.realtime.server import RealtimeServer

    cfg, choices = compose(["recipe=local_cpu", "io=realtime", "io.port=0", *args.overrides])
    graph = plan(cfg, choices)
    with managed_server(cfg.get("server"), args.out):
        server = RealtimeServer(lambda: plan(cfg, choices), graph.nodes["source"].node, args.out / "realtime")
        url = server.start().replace("ws://", "http://").removesuffix("/v1")
        try:
            if args.idle_s:
                report = idle_cpu(url, args)
                print(json.dumps(report, indent=1))
                return
            out = subprocess.run([sys.executable, __file__, "--client", url, "--prompts", str(args.prompts),
                                  *args.overrides], capture_output=True, text=True, check=True)
        finally:
            server.stop()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    v2v, gaps = got["v2v_ms"], got["gaps_ms"]
    report = {"webrtc_v2v_ms": {"p50": p(v2v, 50), "p95": p(v2v, 95), "n": len(v2v)},
              "reply_frame_gap_ms": {"p50": p(gaps, 50), "p95": p(gaps, 95),
                                     "max": round(max(gaps), 1) if gaps else None, "n": len(gaps)},
              "frames_per_s": round(got["frames_per_s"], 2) if got["frames_per_s"] else None}
    print(json.dumps(report, indent=1))
    (args.out / "bench_webrtc.json").write_text(json.dumps(report, indent=1))


def idle_cpu(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The server process's CPU (% of one core) with no call, then during one silent call."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    c0, t0 = cpu(), time.monotonic()
    time.sleep(args.idle_s)
    no_call = 100 * (cpu() - c0) / (time.monotonic() - t0)
    proc = subprocess.Popen([sys.executable, __file__, "--client", url, "--prompts", "1", "--idle-s",
                             str(args.idle_s), *args.overrides], stdout=subprocess.PIPE, text=True)
    c0, t0 = cpu(), time.monotonic()
    out, _ = proc.communicate(timeout=args.idle_s + 120)
    call = 100 * (cpu() - c0) / (time.monotonic() - t0)
    got = json.loads(out.strip().splitlines()[-1])
    return {"server_cpu_pct_no_call": round(no_call, 1), "server_cpu_pct_one_silent_call": round(call, 1),
            "seconds": args.idle_s, "frames_received": got["frames"]}


if __name__ == "__main__":
    main()
