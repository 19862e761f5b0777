"""bench_realtime.py --conversations: people talking to the io=realtime server at once, not prompts.

Each of N clients holds one conversation over the WebSocket, paced like a person: it speaks a
2-3 s question at a microphone's pace (20 ms appends, each sent once its last sample is
"recorded"; the microphone stays open and sends silence between questions), waits for the reply,
listens to it for as long as its audio lasts, thinks ``--think-s``, and asks the next, ``--turns``
times; the clients start ``--stagger-s`` apart. Voice-to-voice is the client's: the first reply
audio received minus the question's true end of speech (a response the user talked over, a false
end, is not counted; its audio is ignored). A reply is played as it arrives: where the listener
has heard all it got and the next audio is more than 50 ms late, that is a gap (counted per
reply, with the longest): a reply written and spoken just in time must not stutter. A reply is "no
reply" (an error, and that client's conversation ends) when nothing of it came for
``--reply-timeout-s``: before its first audio counted from the question's end, after it from the
reply's last event, so a long reply spoken steadily is never one. ``conversations.json`` keeps
every reply (``replies``: client, turn, response id, voice-to-voice, audio seconds, when
``response.done`` came after the question's end, gaps), and what a "no reply" had got so far.

Per N: voice-to-voice p50/p95, errors (refused connections, error events, replies that never came),
the work the server shed (``s2s_inference_shed_total`` from ``/metrics``, where the server has it),
and CPU seconds: the server's Python process (VAD, STT, TTS, engine) and its children (llama-server:
the LLM), per answered turn, beside the seconds of reply audio per turn, and the Python process's by
stage (``s2s_stage_cpu_seconds_total`` from ``/metrics``: each node's threads, ``native`` for an
engine's own threads such as CTranslate2's that run Whisper, ``other`` for the event loop and the
rest; s2s_flow/cpu.py). And llama-server's own figures (its ``/metrics``, turned on with
``LLAMA_ARG_ENDPOINT_METRICS=1``): ms per generated token and per prompt token, a slot's time (a
token decoded in one batch beside other sessions' replies takes the whole batch's time), and how
many slots each decode carried on average: on one thread the batch is shared out, so a turn's first
words slow down as more replies are written beside them. The host, during each N: its own speed (the
CPU time of a fixed Python loop every 2 s, :class:`HostSpeed`: a shared host runs the same vCPU 2-4x
slower in some minutes), how busy the cores were and how much time the hypervisor stole. Then the
largest N whose p95 < 1 s. ``conversations.json`` keeps every turn's voice-to-voice (``v2v_ms`` per
tree and N): on 2 cores one run's p95 of a few dozen turns moves by 200-700 ms from run to run (the
table gives each p95's 90 % interval, a bootstrap over its turns, and each N's p95 as a multiple of
one conversation's with the ratio's interval), so compare trees over several runs pooled (``--pool
A/conversations.json B/...`` prints the pooled figures). ``--min-turns T`` repeats each N with fresh
conversations (other questions) until it has T turns: one conversation's p95 of 8 turns is their
slowest but one, a ratio against 4 conversations' p95 of 32 turns is then mostly the noise of the
one-conversation figure. The rounds of the N are interleaved, each N's spread around the run's
middle (1 4 8 with 32 turns of 8: 1, 1, 4, 8, 1, 1), so that a host running slower in one quarter of
an hour than in the next slows every N alike; each N's figures are summed over its rounds.

CPU per turn follows the replies' length: the LLM's tokens, the TTS's audio, and the time the
session stays open while its client listens (an open session's microphone stream, VAD and event
loop cost CPU every second). The LLM samples with ``--seed`` (``llm.seed``, the same for every
tree) so that two trees are asked the same questions and give the same replies; without it
(``--seed -1``) one tree's replies may be twice as long as the other's, and so its CPU per turn.

``--server-tree PATH ...``: the same clients against the server started from each source tree
(``s2s-run recipe=local_cpu io=realtime`` run with that tree on PYTHONPATH), in one run: before and
after side by side. Every tree's server is started at the outset, with io.max_sessions = the largest
N and its own llama-server on a free port (one already running elsewhere is not used), and each
round is run against every tree in turn, the trees' order swapped from round to round: the trees
meet the same minutes of the host, as the N do (an idle server costs next to nothing meanwhile).
Admission is by count only (``io.target_ms=null`` where the tree has it), so that every tree
serves every conversation; ``--load-admission`` keeps the tree's own admission.

``--late-joiner S``: one more caller connects S seconds after the last client of each N started
(in its first round; the server has room for it by count: io.max_sessions is the largest N + 1), and the run
records what it met: admitted, or refused with the server's words (``session_limit_reached``:
the server is full by load). It hangs up at once either way. With ``--load-admission`` and the
default ``io.target_ms: auto``, run N=1 first (``--conversations 1 4 8``): the target is taken
from the replies one caller alone gets.

A burst: ``--stagger-s 0 --load-admission io.admission=wait io.admission_wait_s=40``: every client
of a round calls at once, and the server holds those beyond its ramp of newcomers until earlier
ones have been answered; the table says how long they were held (p50, max) and how many were
refused in the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._host import HostSpeed, host_load, host_ticks, loop_figures
from benchmarks._stats import percentile, percentile_interval, ratio_interval
from s2s_flow.machine import cpu_label

ROOT = Path(__file__).resolve().parents[1]

RATE = 24000  # the protocol's default PCM rate, both ways
STEP = RATE // 50  # 20 ms per append
GAP_S = 0.05  # a reply's audio this late after the listener has heard all it got is a gap
QUESTIONS = [  # 2-3 s of speech each in the corpus voice (Piper en_US)
    "What is the tallest mountain in Europe, and how high is it?",
    "How long should I boil an egg for a soft breakfast?",
    "Can you suggest a good name for my new puppy?",
    "Why do the leaves on the trees change colour in autumn?",
    "How far away is the moon from the earth, roughly?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Tell me one interesting fact about octopuses.",
    "What is a good way to start learning to cook at home?",
]


def pct(values: list[float], q: int) -> float | None:
    return round(percentile(values, q), 1) if values else None


def interval(values: list[float]) -> list[float] | None:
    """Where the p95 of these turns lies, 9 times in 10 (benchmarks/_stats.py): how far two runs' p95 may
    differ with nothing changed."""
    return [round(v, 1) for v in percentile_interval(values, 95)] if values else None


def questions() -> list[tuple[np.ndarray, float]]:
    """The questions as 24 kHz PCM with their true end of speech (s), from the benchmark corpus
    machinery (synthesized once, cached)."""
    from s2s_flow.audio import resample
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from s2s_flow.corpus import manifest
    from s2s_flow.node import Context

    listed = ",".join(f"'{q}'" for q in QUESTIONS)
    cfg, choices = compose(["recipe=local_cpu", "server=null", "bench=latency", f"bench.prompts=[{listed}]",
                            "bench.lead_silence_s=0.2", "bench.tail_silence_s=0"])
    source = plan(cfg, choices).nodes["source"].node
    source.ctx = Context("source", Path(tempfile.mkdtemp()))
    source.setup()
    import soundfile as sf

    out = []
    for entry in manifest(source.corpus_dir)["files"]:
        pcm, rate = sf.read(source.corpus_dir / entry["file"], dtype="float32")
        out.append((resample(pcm, rate, RATE), float(entry["speech_end_s"])))
    return out


class Mic:
    """A microphone that never closes: a 20 ms append every 20 ms, the question being spoken or silence."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.t0, self.sent = ws, time.monotonic(), 0  # blocks taken so far
        self.pending = np.zeros(0, np.int16)
        self.spoken: asyncio.Future[None] | None = None

    def say(self, pcm: np.ndarray, speech_end_s: float) -> tuple[float, asyncio.Future[None]]:
        """Queue a question; its true end of speech on the monotonic clock, and a future set once sent.
        Its first sample is the next block's, recorded from t0 + sent blocks."""
        self.pending = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
        self.spoken = asyncio.get_running_loop().create_future()
        return self.t0 + self.sent * STEP / RATE + speech_end_s, self.spoken

    async def run(self) -> None:
        silence = base64.b64encode(bytes(2 * STEP)).decode()
        while True:
            # a microphone hands over a block once its last sample is recorded
            await asyncio.sleep(max(0.0, self.t0 + (self.sent + 1) * STEP / RATE - time.monotonic()))
            self.sent += 1
            if len(self.pending):
                block, self.pending = self.pending[:STEP], self.pending[STEP:]
                block = np.pad(block, (0, STEP - len(block)))
                audio = base64.b64encode(block.astype("<i2").tobytes()).decode()
                if not len(self.pending) and self.spoken is not None and not self.spoken.done():
                    self.spoken.set_result(None)
            else:
                audio = silence
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


class Listener:
    """The server's events for the turn at hand: the first audio after the question's end, the
    completed response's audio length, errors; and the reply played as it comes: a gap is where
    the listener has heard all it got and the next audio is late (GAP_S of slack)."""

    def __init__(self) -> None:
        self.after = float("inf")
        self.first: float | None = None
        self.audio_bytes = 0
        self.played_until = 0.0  # when the audio received so far will have been heard
        self.gap_s = 0.0  # the reply's gaps, in all
        self.last = 0.0  # the turn's last event (audio or other) after the question's end
        self.done_at: float | None = None
        self.response_id: str | None = None
        self.done = asyncio.Event()
        self.errors: list[str] = []

    def expect(self, after: float) -> None:
        self.after, self.first, self.audio_bytes, self.gap_s = after, None, 0, 0.0
        self.last, self.done_at, self.response_id = after, None, None
        self.done.clear()

    async def wait(self, timeout_s: float) -> bool:
        """Until the reply is done; False when nothing of it came for ``timeout_s`` (from the
        question's end before its first audio, then from its last event)."""
        while not self.done.is_set():
            left = max(self.after, self.last) + timeout_s - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), left)
        return True

    def record(self) -> dict[str, Any]:
        """This turn's reply as the client saw it (ms from the question's end)."""
        def since(t: float | None) -> float | None:
            return None if t is None else round((t - self.after) * 1000, 1)

        return {"response_id": self.response_id, "v2v_ms": since(self.first),
                "audio_s": round(self.audio_bytes / 2 / RATE, 2), "done_ms": since(self.done_at),
                "last_event_ms": since(self.last), "gap_ms": round(self.gap_s * 1000, 1)}

    async def run(self, ws: Any) -> None:
        async for text in ws:
            now = time.monotonic()
            if '"response.output_audio.delta"' in text[:200]:
                if now >= self.after:
                    self.first, self.last = self.first or now, now
                    size = len(base64.b64decode(json.loads(text)["delta"]))
                    self.audio_bytes += size
                    if self.audio_bytes == size:
                        self.played_until = now
                    elif now > self.played_until + GAP_S:
                        self.gap_s += now - self.played_until
                    self.played_until = max(self.played_until, now) + size / 2 / RATE
                continue
            event = json.loads(text)
            if now >= self.after:
                self.last = now
            if event["type"] == "error":
                self.errors.append(event["error"].get("code") or "error")
            elif (event["type"] == "response.done" and now >= self.after and self.first is not None
                  and event["response"].get("status") == "completed"):
                self.done_at, self.response_id = now, event["response"].get("id")
                self.done.set()


async def conversation(url: str, k: int, said: list[tuple[np.ndarray, float]], args: argparse.Namespace,
                       order: int | None = None) -> dict:
    """Client ``k`` (started k stagger-s late) asks the questions in the order numbered ``order``
    (default ``k``): each client, and each round's, its own."""
    from websockets.asyncio.client import connect

    await asyncio.sleep(k * args.stagger_s)
    out: dict[str, Any] = {"v2v": [], "errors": [], "refused": 0, "reply_s": [], "gap_ms": [], "replies": [],
                           "admit_s": []}
    t_connect = time.monotonic()
    try:
        ws = await connect(f"{url}/realtime", max_size=None)
    except Exception as exc:
        out["errors"].append(f"connect: {type(exc).__name__}")
        return out
    async with ws:
        first = json.loads(await ws.recv())
        out["admit_s"].append(time.monotonic() - t_connect)  # io.admission=wait: how long it was held
        if (code := not_admitted(first)) is not None:
            if code == "session_limit_reached":
                out["refused"] = 1
            else:
                out["errors"].append(code)
            return out
        mic, listener = Mic(ws), Listener()
        tasks = [asyncio.create_task(mic.run()), asyncio.create_task(listener.run(ws))]
        try:
            for j in range(args.turns):
                pcm, end = said[((k if order is None else order) * 3 + j) % len(said)]
                t_end, spoken = mic.say(pcm, end)
                listener.expect(t_end)
                await spoken
                answered = await listener.wait(args.reply_timeout_s)
                out["replies"].append({"client": k, "turn": j + 1, **listener.record(),
                                       **({} if answered else {"error": "no reply"})})
                if not answered:
                    out["errors"].append("no reply")
                    break
                out["v2v"].append((listener.first - t_end) * 1000)
                out["reply_s"].append(listener.audio_bytes / 2 / RATE)
                out["gap_ms"].append(listener.gap_s * 1000)
                await asyncio.sleep(max(0.0, listener.played_until - time.monotonic()) + args.think_s)  # listen, think
        except Exception as exc:  # the server closed the connection, or the clients' loop failed
            out["errors"].append(f"{type(exc).__name__}: {exc}"[:80])
        finally:
            for task in tasks:
                task.cancel()
            out["errors"] += listener.errors
    return out


async def conversations(url: str, n: int, said: list[tuple[np.ndarray, float]], args: argparse.Namespace,
                        round_: int = 0) -> dict:
    results = await asyncio.gather(*(conversation(url, k, said, args, k + round_ * n) for k in range(n)))
    return {"v2v": [v for r in results for v in r["v2v"]], "errors": [e for r in results for e in r["errors"]],
            "refused": sum(r["refused"] for r in results), "reply_s": [v for r in results for v in r["reply_s"]],
            "gap_ms": [v for r in results for v in r["gap_ms"]],
            "replies": [v for r in results for v in r["replies"]],
            "admit_s": [v for r in results for v in r["admit_s"]]}


async def late_joiner(url: str, after_s: float) -> dict[str, Any]:
    """One more caller, ``after_s`` into a round: admitted, or refused with the server's words."""
    from websockets.asyncio.client import connect

    await asyncio.sleep(after_s)
    out: dict[str, Any] = {"after_s": after_s}
    try:
        async with connect(f"{url}/realtime", max_size=None) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
    except Exception as exc:  # noqa: BLE001 - what it met is the figure
        return {**out, "admitted": False, "code": f"connect: {type(exc).__name__}"}
    if (code := not_admitted(first)) is None:
        return {**out, "admitted": True}
    return {**out, "admitted": False, "code": code, "message": str((first.get("error") or {}).get("message", ""))[:400]}


def not_admitted(first: dict[str, Any]) -> str | None:
    """The server's first event: None for a session, else why not (its error code)."""
    if first.get("type") == "session.created":
        return None
    return (first.get("error") or {}).get("code", first.get("type"))


# -- the server of one tree ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value} (the figures this bench reads: shed work, refusals)."""
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def shed_by_kind(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in after.items():
        if key.startswith("s2s_inference_shed_total{"):
            kind = dict(p.split("=", 1) for p in key[key.index("{") + 1 : -1].split(",")).get("kind", "?")
            out[kind] = out.get(kind, 0) + round(value - before.get(key, 0.0))
    return {k: v for k, v in out.items() if v}


_LLAMA_COUNTERS = ("tokens_predicted_total", "tokens_predicted_seconds_total", "prompt_tokens_total",
                   "prompt_seconds_total", "n_decode_total", "n_busy_slots_per_decode")


def llama_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What llama-server's counters added between two scrapes of its ``/metrics`` ({} where the
    server has none: an older tree's); one round's, or several rounds' summed, go to :func:`llama_from`."""
    def total(scraped: dict[str, float], name: str) -> float:
        value = scraped.get(f"llamacpp:{name}{{}}", 0.0)
        if name == "n_busy_slots_per_decode":  # a gauge, the mean since the start: busy slots in all
            value *= scraped.get("llamacpp:n_decode_total{}", 0.0)
        return value

    if not after:
        return {}
    if total(after, "n_decode_total") < total(before, "n_decode_total"):
        before = {}  # restarted meanwhile (server.max_restarts): its counters began again
    return {name: total(after, name) - total(before, name) for name in _LLAMA_COUNTERS}


def llama_from(delta: dict[str, float], turns: int = 0) -> dict[str, float]:
    """llama-server's decoding from its counters' increase (:func:`llama_delta`): ms per generated
    token and per prompt token (each slot's own time: a token decoded in a batch with others takes the
    batch's time), busy slots per decode and, given ``turns``, prompt and generated tokens per turn
    (what the slots' cached prefixes did not spare); {} without figures."""
    if not delta:
        return {}
    out = {}
    if tokens := delta["tokens_predicted_total"]:
        out["ms_per_token"] = round(1000 * delta["tokens_predicted_seconds_total"] / tokens, 1)
    if prompt := delta["prompt_tokens_total"]:
        out["ms_per_prompt_token"] = round(1000 * delta["prompt_seconds_total"] / prompt, 1)
    if decodes := delta["n_decode_total"]:
        out["slots_per_decode"] = round(delta["n_busy_slots_per_decode"] / decodes, 2)
    if turns:
        out["prompt_tokens_per_turn"] = round(prompt / turns, 1)
        out["tokens_per_turn"] = round(tokens / turns, 1)
    return out


def cpu_by_stage(before: dict[str, float], after: dict[str, float], turns: float) -> dict[str, float]:
    """The server process's CPU seconds per turn by stage (``s2s_stage_cpu_seconds``: each node's
    threads, engines' own threads as ``native``, the rest as ``other``); {} from a tree without it."""
    prefix = "s2s_stage_cpu_seconds_total{stage="
    return {key[len(prefix):-1]: round((value - before.get(key, 0.0)) / turns, 3)
            for key, value in sorted(after.items()) if key.startswith(prefix)}


class TreeServer:
    """``s2s-run recipe=local_cpu io=realtime`` from a source tree, in a process of its own."""

    def __init__(self, tree: Path, max_sessions: int, overrides: list[str], out: Path, load_admission: bool) -> None:
        self.tree, self.port, self.llama_port = tree, free_port(), free_port()
        args = ["recipe=local_cpu", "io=realtime", f"io.port={self.port}", f"io.max_sessions={max_sessions}",
                f"llm.base_url=http://127.0.0.1:{self.llama_port}/v1", f"hydra.run.dir={out}"]
        realtime_yaml = tree / "conf" / "io" / "realtime.yaml"
        if not load_admission and "target_ms:" in realtime_yaml.read_text():
            args.append("io.target_ms=null")
        self.argv = [sys.executable, "-m", "s2s_flow.cli", *args, *overrides]
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.log = out, out / "server-stdout.log"
        env = {**os.environ, "PYTHONPATH": str(tree), "NO_PROXY": "127.0.0.1,localhost",
               "LLAMA_ARG_ENDPOINT_METRICS": "1"}  # llama-server's /metrics (llama_delta)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server from {tree} exited ({self.proc.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                scrape(self.port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server from {tree} did not answer in 600 s; log: {self.log}") from None
                time.sleep(0.5)

    @property
    def url(self) -> str:
        """The Realtime API's base URL (``/v1``)."""
        return f"ws://127.0.0.1:{self.port}/v1"

    def llama_metrics(self) -> list[dict[str, float]]:
        """The ``/metrics`` of each llama-server replica now (server.replicas), {} where it has none."""
        ports = [self.llama_port]
        with contextlib.suppress(OSError, ValueError):  # an older tree's server.json has no replicas
            info = json.loads((self.out / "server.json").read_text())
            ports += [urllib.parse.urlsplit(r["url"]).port for r in info.get("replicas", [])]
        scraped = []
        for port in ports:
            try:
                scraped.append(scrape(port))
            except (OSError, ValueError):
                scraped.append({})
        return scraped

    def cpu_s(self) -> tuple[float, float]:
        """(this server's Python process, its children: llama-server) CPU seconds so far."""
        import psutil

        proc = psutil.Process(self.proc.pid)
        own = sum(proc.cpu_times()[:2])
        children = 0.0
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                children += sum(child.cpu_times()[:2])
        return own, children

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # s2s-run stops its llama-server on the way out
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def settled(port: int, timeout_s: float = 30.0) -> None:
    """Wait until the server has closed every session (a client's close returns before its session's
    graph is torn down): the next conversations find none still counted against io.max_sessions
    (with ``--conversations 1`` alone, the warm-up's or the last round's would take the one place)."""
    deadline = time.monotonic() + timeout_s
    while scrape(port).get("s2s_sessions_open{}", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)


async def with_late_joiner(url: str, n: int, said: list[tuple[np.ndarray, float]],
                           args: argparse.Namespace) -> tuple[dict, dict]:
    """A round of ``n`` conversations and, ``--late-joiner`` s after the last one began, one more caller."""
    return await asyncio.gather(conversations(url, n, said, args),
                                late_joiner(url, (n - 1) * args.stagger_s + args.late_joiner))


def planned_rounds(ns: list[int], turns: int, min_turns: int) -> list[tuple[int, int]]:
    """The rounds to run, as (N, its round number): each N as many as give it ``min_turns`` turns (at
    least one), each N's spread over the run: its k-th of R at (k + 1/2) / R of the way, so every N's
    turns come from the same hours on average (1 4 8 with 32 turns of 8: 1, 1, 4, 8, 1, 1). A shared
    host runs 1.5-2x slower in some hours than others: one N taken after another, their ratio is as
    much the host's drift as the load's."""
    rounds = {n: max(1, -(-min_turns // (n * turns))) for n in ns}
    return sorted(((n, k) for n in ns for k in range(rounds[n])), key=lambda nk: ((nk[1] + 0.5) / rounds[nk[0]], nk[0]))


class Tally:
    """One N's figures, summed over its rounds (other N's rounds may run between them)."""

    def __init__(self) -> None:
        self.got: dict[str, Any] = {}
        self.rounds = 0
        self.server: dict[str, float] = {}  # the server's /metrics counters: what the rounds added
        self.cpu = [0.0, 0.0]  # (Python process, llama-server) CPU seconds
        self.llama: dict[str, float] = {}
        self.ticks: list[int] = []
        self.probes: list[float] = []
        self.joined: dict[str, Any] | None = None

    def round(self, server: TreeServer, play: Callable[[], tuple[dict, dict | None]]) -> None:
        """Run one round (``play``) and add what it did."""
        ticks0, before, cpu0, llama0 = host_ticks(), scrape(server.port), server.cpu_s(), server.llama_metrics()
        with HostSpeed() as speed:
            got, joined = play()
        after, cpu1, llama1, ticks1 = scrape(server.port), server.cpu_s(), server.llama_metrics(), host_ticks()
        self.got = {key: self.got[key] + got[key] for key in got} if self.got else got
        self.joined = self.joined or joined
        self.rounds += 1
        for key, value in after.items():
            self.server[key] = self.server.get(key, 0.0) + value - before.get(key, 0.0)
        self.cpu = [self.cpu[0] + cpu1[0] - cpu0[0], self.cpu[1] + cpu1[1] - cpu0[1]]
        for replica0, replica1 in zip(llama0, llama1, strict=False):
            for key, value in llama_delta(replica0, replica1).items():
                self.llama[key] = self.llama.get(key, 0.0) + value
        if len(ticks0) == len(ticks1) == 8:
            self.ticks = [a + b - c for a, b, c in zip(self.ticks or [0] * 8, ticks1, ticks0, strict=True)]
        self.probes += speed.samples

    def row(self) -> dict[str, Any]:
        got, turns = self.got, max(1, len(self.got["v2v"]))
        row = {"p50": pct(got["v2v"], 50), "p95": pct(got["v2v"], 95), "p95_interval": interval(got["v2v"]),
               "turns": len(got["v2v"]),
               "rounds": self.rounds,
               "errors": len(got["errors"]) + got["refused"], "refused": got["refused"],
               "error_kinds": sorted(set(got["errors"])), "shed": shed_by_kind({}, self.server),
               "cpu_s_per_turn": {"python": round(self.cpu[0] / turns, 2),
                                  "llama_server": round(self.cpu[1] / turns, 2)},
               "cpu_s_per_turn_by_stage": cpu_by_stage({}, self.server, turns),
               "llama": llama_from(self.llama, turns),
               "host": {**loop_figures(self.probes), **(host_load([0] * 8, self.ticks) if self.ticks else {})},
               "reply_s_per_turn": round(sum(got["reply_s"]) / turns, 2),
               "admit_s": {"p50": round(percentile(got["admit_s"], 50), 2) if got["admit_s"] else None,
                           "max": round(max(got["admit_s"], default=0.0), 2)},
               "gaps": {"replies": sum(g > 0 for g in got["gap_ms"]), "p95_ms": pct(got["gap_ms"], 95),
                        "max_ms": round(max(got["gap_ms"], default=0.0))}}
        if self.joined is not None:
            row["late_joiner"] = self.joined
        return row


def run_trees(trees: dict[str, Path], ns: list[int], said: list[tuple[np.ndarray, float]],
              args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    """Every tree's server started at once; then each round of the plan (:func:`planned_rounds`) is
    run against every tree in turn, the trees' order swapped from one round to the next, so that the
    trees, like the N, meet the same hours of the host. Between its rounds a server is idle."""
    joiner = 1 if args.late_joiner is not None else 0  # room for it by count: only load may refuse it
    servers: dict[str, TreeServer] = {}
    try:
        for i, (name, tree) in enumerate(trees.items()):
            print(f"server from {tree} ...", file=sys.stderr, flush=True)
            servers[name] = TreeServer(tree, max(ns) + joiner, args.overrides, args.out / f"tree{i}-{tree.name}",
                                       args.load_admission)
        for server in servers.values():  # the warm-up
            asyncio.run(conversations(server.url, 1, said[:1], argparse.Namespace(**{**vars(args), "turns": 1})))
        tallies = {name: {n: Tally() for n in ns} for name in servers}

        def play(server: TreeServer, n: int, k: int) -> tuple[dict, dict | None]:
            if joiner and k == 0:  # the late joiner joins each N's first round
                return asyncio.run(with_late_joiner(server.url, n, said, args))
            return asyncio.run(conversations(server.url, n, said, args, k)), None  # round k: its own questions

        def one(name: str, n: int, k: int, label: str) -> None:
            print(f"  {name}: {n} conversation(s), round {k + 1}{label} ...", file=sys.stderr, flush=True)
            settled(servers[name].port)
            tallies[name][n].round(servers[name], lambda: play(servers[name], n, k))

        plan = planned_rounds(ns, args.turns, args.min_turns)
        for i, (n, k) in enumerate(plan):
            for name in list(servers)[:: 1 if i % 2 == 0 else -1]:
                one(name, n, k, f" ({i + 1} of {len(plan)})")
        for name, by_n in tallies.items():
            for n, tally in by_n.items():
                # a round that lost turns to errors: more until the N has its turns (none if a round got none)
                while len(tally.got["v2v"]) < args.min_turns and tally.got["v2v"]:
                    one(name, n, tally.rounds, " (more turns)")
    finally:
        for server in servers.values():
            server.stop()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for name, by_n in tallies.items():
        for n, tally in by_n.items():
            row = results.setdefault(name, {})[n] = tally.row()
            print(f"  {name}, {n}: {json.dumps(row)}", file=sys.stderr, flush=True)
            row["v2v_ms"] = [round(v, 1) for v in tally.got["v2v"]]  # each turn's, to pool runs by
            row["replies"] = tally.got["replies"]
    return results


def table(results: dict[str, dict[int, dict[str, Any]]], ns: list[int]) -> str:
    trees = list(results)
    head = "| conversations | " + " | ".join(
        f"{t}: v2v p50 / p95 ms | errors | shed | CPU s/turn py / llm | reply s/turn | replies with gaps "
        "(max ms)" for t in trees) + " |"
    lines = [head, "|---|" + "--:|--:|--:|--:|--:|--:|" * len(trees)]
    for n in ns:
        cells = []
        for t in trees:
            r = results[t][n]
            shed = ", ".join(f"{k} {v}" for k, v in sorted(r["shed"].items())) or "0"
            cpu = r["cpu_s_per_turn"]
            cells += [f"{r['p50']} / {r['p95']}", f"{r['errors']}" + (f" ({r['refused']} refused)" if r["refused"]
                                                                     else ""), shed,
                      f"{cpu['python']} / {cpu['llama_server']}", f"{r.get('reply_s_per_turn', '')}",
                      f"{r['gaps']['replies']} ({r['gaps']['max_ms']})" if "gaps" in r else ""]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for t in trees:
        for n in ns:
            if stages := results[t][n].get("cpu_s_per_turn_by_stage"):
                lines.append(f"- {t}, {n} conversation(s): the server's CPU s/turn by stage: "
                             + ", ".join(f"{k} {v}" for k, v in stages.items()))
    for t in trees:
        for n in ns:
            if llama := results[t][n].get("llama"):
                lines.append(f"- {t}, {n} conversation(s): llama-server: "
                             f"{llama.get('ms_per_token', '-')} ms per generated token, "
                             f"{llama.get('ms_per_prompt_token', '-')} per prompt token (a slot's time), "
                             f"{llama.get('slots_per_decode', '-')} slots per decode, "
                             f"{llama.get('prompt_tokens_per_turn', '-')} prompt and "
                             f"{llama.get('tokens_per_turn', '-')} generated tokens per turn")
    for t in trees:
        for n in ns:
            if host := results[t][n].get("host"):
                span = host.get("loop_ms_range", ["-", "-"])
                lines.append(f"- {t}, {n} conversation(s): the host: a fixed Python loop {host.get('loop_ms', '-')} "
                             f"ms of CPU ({span[0]}-{span[1]}), cores busy {host.get('busy_pct', '-')} %, "
                             f"stolen {host.get('stolen_pct', '-')} %")
    for t in trees:
        for n in ns:
            if (span := results[t][n].get("p95_interval")) is not None:
                lines.append(f"- {t}, {n} conversation(s): p95 {results[t][n]['p95']} ms, 90 % interval "
                             f"{span[0]}-{span[1]} (a bootstrap over its {results[t][n]['turns']} turns)")
    for t in trees:
        for n in ns:
            if (joined := results[t][n].get("late_joiner")) is not None:
                met = ("admitted" if joined["admitted"]
                       else f"refused ({joined.get('code')}: {joined.get('message', '')})")
                lines.append(f"- {t}, {n} conversation(s): a caller joining {joined['after_s']:g} s after the "
                             f"first client: {met}")
    for t in trees:
        for n in ns:
            if (held := results[t][n].get("admit_s")) and held["max"] >= 0.5:
                lines.append(f"- {t}, {n} conversation(s): held before admission (io.admission=wait): p50 "
                             f"{held['p50']} s, max {held['max']} s; refused {results[t][n]['refused']}")
    for t in trees:
        if line := against_one(t, {n: results[t][n].get("v2v_ms", []) for n in ns}):
            lines.append(line)
    for t in trees:
        ok = [n for n in ns if results[t][n]["p95"] is not None and results[t][n]["p95"] < 1000
              and not results[t][n]["errors"]]
        lines.append(f"- {t}: largest N with p95 < 1 s and no errors: {max(ok) if ok else 'none'}")
    return "\n".join(lines)


def against_one(tree: str, v2v_ms: dict[int, list[float]]) -> str:
    """Each N's p95 as a multiple of one conversation's, with the ratio's 90 % interval (a bootstrap
    over both sets of turns); "" without a one-conversation round."""
    base = v2v_ms.get(1)
    parts = []
    for n, values in v2v_ms.items():
        if n != 1 and base and values:
            lo, hi = ratio_interval(values, base, 95)
            parts.append(f"{n} at once {percentile(values, 95) / percentile(base, 95):.2f}x ({lo:.2f}-{hi:.2f})")
    return f"- {tree}: p95 against one conversation's (90 % interval): {', '.join(parts)}" if parts else ""


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_realtime.py --conversations", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", nargs="+", required=True, metavar="N",
                    help="numbers of conversations at once, e.g. 1 2 4 8")
    ap.add_argument("--server-tree", nargs="+", default=[str(ROOT)], metavar="PATH",
                    help="source trees to start the servers from, each round run against each in turn "
                         "(default: this one)")
    ap.add_argument("--turns", type=int, default=4, help="questions per conversation")
    ap.add_argument("--min-turns", type=int, default=0,
                    help="repeat each N with fresh conversations until it has this many turns (e.g. 32: one "
                         "conversation's p95 over 32 turns, as 4 conversations' over 4 x 8, not the max of 8)")
    ap.add_argument("--stagger-s", type=float, default=3.0, help="between the clients' starts")
    ap.add_argument("--think-s", type=float, default=1.0, help="after listening to a reply")
    ap.add_argument("--reply-timeout-s", type=float, default=30.0,
                    help="a reply of which nothing came for this long (from the question's end, then from its "
                         "last event) is an error, 'no reply'")
    ap.add_argument("--seed", type=int, default=1,
                    help="llm.seed for every tree's LLM: the same replies to the same questions (-1: unseeded)")
    ap.add_argument("--load-admission", action="store_true",
                    help="keep the server's admission by load (io.target_ms); default: by count only")
    ap.add_argument("--late-joiner", type=float, metavar="S",
                    help="one more caller connects S s after the last client of each N started: admitted, or "
                         "refused by load (with --load-admission)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-conversations-")))
    ap.add_argument("--pool", nargs="+", type=Path, metavar="JSON",
                    help="run nothing: pool the turns of these runs' conversations.json per tree and N (the "
                         "N given), and print their p50 / p95 with the p95's 90 %% interval")
    ap.add_argument("overrides", nargs="*", help="s2s-run overrides for every tree's server")
    args = ap.parse_args(argv)
    if args.pool:
        print(pooled(args.pool, sorted({int(a) for a in args.conversations if "=" not in a})))
        return
    # overrides may follow the lists: key=value words are overrides, the rest numbers or trees
    args.overrides += [a for a in args.conversations + args.server_tree if "=" in a]
    if args.seed >= 0 and not any(o.startswith("llm.seed=") for o in args.overrides):
        args.overrides.append(f"llm.seed={args.seed}")
    ns = sorted({int(a) for a in args.conversations if "=" not in a})
    trees = [Path(a).expanduser().resolve() for a in args.server_tree if "=" not in a]
    said = questions()
    names = [tree.name if [t.name for t in trees].count(tree.name) == 1 else str(tree) for tree in trees]
    results = run_trees(dict(zip(names, trees, strict=True)), ns, said, args)
    report = {"cpu": cpu_label(), "turns": args.turns, "min_turns": args.min_turns, "stagger_s": args.stagger_s,
              "seed": args.seed, "trees": {
        name: {str(n): row for n, row in rows.items()} for name, rows in results.items()}}
    (args.out / "conversations.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"\n{report['cpu']}, {args.turns} turns per conversation, starts {args.stagger_s:g} s apart "
          f"(results: {args.out})\n")
    print(table(results, ns))


def pooled(paths: list[Path], ns: list[int]) -> str:
    """Several runs' turns, per tree (by name) and N, as one table: p50 / p95 and the p95's interval."""
    turns: dict[str, dict[int, list[float]]] = {}
    runs: dict[str, int] = {}
    cpus = set()
    for path in paths:
        report = json.loads(path.read_text())
        cpus.add(report.get("cpu", "?"))
        for tree, rows in report["trees"].items():
            runs[tree] = runs.get(tree, 0) + 1
            for n in ns:
                turns.setdefault(tree, {}).setdefault(n, []).extend((rows.get(str(n)) or {}).get("v2v_ms", []))
    lines = [f"{len(paths)} run(s) on {', '.join(sorted(cpus))}", "",
             "| tree (runs) | conversations | turns | v2v p50 / p95 ms | p95 90 % interval |", "|---|--:|--:|--:|--:|"]
    for tree, by_n in turns.items():
        for n, v in by_n.items():
            if v:
                span = interval(v)
                lines.append(f"| {tree} ({runs[tree]}) | {n} | {len(v)} | {pct(v, 50)} / {pct(v, 95)} | "
                             f"{span[0]}-{span[1]} |")
    lines.append("")
    lines += [line for tree, by_n in turns.items() if (line := against_one(tree, by_n))]
    return "\n".join(lines)


