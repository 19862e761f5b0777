"""Real-audio test helpers: a private PulseAudio server with null sinks, so live-audio tests
play and record real audio on a machine without a sound card (Debian package `pulseaudio`,
which brings `pactl`); a recorder and a 'user' speaker on its sinks; a scripted user who
talks over the agent.

    with pulse_server(tmp_path, sinks=("agent", "user")) as pulse:   # default sink: agent
        pulse.default_source("user.monitor")                        # the mic hears the user sink
        ...   # sounddevice device "pulse"/"default" now reach these sinks

Each null sink has a monitor source that records what is played into it. The server gets
its own XDG_RUNTIME_DIR and HOME (nothing touches the user's session); this process is
pointed at it through PULSE_SERVER alone, and PortAudio is re-initialised so it lists the
server's devices. Runs as root too (PulseAudio only warns). Missing pieces skip the test
with the command that installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nodes._playback import playback_of
from s2s_flow.messages import AudioChunk
from s2s_flow.node import Node
from tests.support.managed import stop
from tests.support.servers import die_with_parent

__all__ = ["PulseServer", "pulse_server", "Recorder", "Speaker", "ScriptedUser", "BargeInRun", "run_barge_in",
           "llama_server_idle", "reinit_portaudio"]

APT = "apt-get install libportaudio2 pulseaudio"
ASK = "Please tell me a long story about a brave knight and a dragon."
TALK_OVER = "Stop, stop. What is the capital of France?"


def reinit_portaudio() -> None:
    """Make PortAudio enumerate devices again (it does so once, at import of sounddevice)."""
    import sounddevice as sd

    sd._terminate()
    sd._initialize()


class PulseServer:
    def __init__(self, root: Path, process: subprocess.Popen) -> None:
        self.root, self.process = root, process
        self.socket = root / "run" / "pulse" / "native"
        # All a client needs (anonymous auth); its cookie goes here rather than into ~/.config/pulse.
        self.env = {"PULSE_SERVER": f"unix:{self.socket}", "PULSE_COOKIE": str(root / "cookie")}

    def pactl(self, *args: str) -> str:
        env = {**os.environ, **self.env, "HOME": str(self.root)}  # no cookie files in the real home
        out = subprocess.run(["pactl", *args], env=env, capture_output=True, text=True, timeout=10)
        if out.returncode:
            raise RuntimeError(f"pactl {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def default_source(self, name: str) -> None:
        self.pactl("set-default-source", name)

    def default_sink(self, name: str) -> None:
        self.pactl("set-default-sink", name)

    def recording(self, source: str) -> int:
        """How many streams record from ``source`` now (e.g. the microphone node's)."""
        ids = {line.split()[0] for line in self.pactl("list", "short", "sources").splitlines()
               if line.split()[1:2] == [source]}
        return sum(line.split()[1] in ids for line in self.pactl("list", "short", "source-outputs").splitlines())

    def log(self) -> str:
        path = self.root / "pulse.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@contextmanager
def pulse_server(sinks: Sequence[str] = ("s2s",), *, rate: int = 48000) -> Iterator[PulseServer]:
    """Start PulseAudio with one null sink per name (the first is the default sink, its monitor
    the default source); point this process's audio at it; stop it afterwards."""
    if shutil.which("pulseaudio") is None or shutil.which("pactl") is None:
        pytest.skip(f"live-audio tests need PulseAudio: {APT}")
    try:
        import sounddevice  # noqa: F401
    except ImportError:
        pytest.skip("live-audio tests need sounddevice: pip install 's2s-flow[audio]'")
    except OSError:
        pytest.skip(f"live-audio tests need PortAudio: {APT}")
    root = Path(tempfile.mkdtemp(prefix="s2s-pulse-"))
    (root / "run").mkdir(mode=0o700)
    script = root / "server.pa"
    lines = ["load-module module-native-protocol-unix auth-anonymous=1"]
    lines += [f"load-module module-null-sink sink_name={s} rate={rate} channels=1" for s in sinks]
    lines += [f"set-default-sink {sinks[0]}", f"set-default-source {sinks[0]}.monitor"]
    script.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(root / "run"), "HOME": str(root)}
    env.pop("PULSE_SERVER", None)
    process = subprocess.Popen(
        ["pulseaudio", "-n", "-F", str(script), "--daemonize=no", "--exit-idle-time=-1", "--system=false",
         "--disallow-exit=yes", "--high-priority=yes", "--realtime=yes", f"--log-target=file:{root / 'pulse.log'}"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,  # no daemon outlives a crashed test run
    )
    server = PulseServer(root, process)
    saved = {k: os.environ.get(k) for k in server.env}
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pulseaudio exited with {process.returncode}:\n{server.log()}")
            if server.socket.exists():
                try:
                    server.pactl("info")
                    break
                except RuntimeError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pulseaudio did not start within 15 s:\n{server.log()}")
            time.sleep(0.05)
        os.environ.update(server.env)
        reinit_portaudio()
        _warm_up()
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # Streams must be closed before this point: PortAudio hangs terminating one whose server is gone.
        stop(process, 5)
        shutil.rmtree(root, ignore_errors=True)


def _warm_up() -> None:
    """The first capture stream after the server starts gets its first audio ~2 s late (the null
    sink starts at its largest latency); take that hit here, not in a test's timing."""
    import sounddevice as sd

    with sd.InputStream(device="pulse", samplerate=16000, channels=1, dtype="float32", blocksize=320) as stream:
        for _ in range(6):  # the first read waits until audio flows
            stream.read(320)


class Recorder:
    """Records a PulseAudio source (a null sink's monitor) in this process, each block stamped
    with the monotonic time it arrived, to see when sound starts and stops."""

    def __init__(self, source: str, *, rate: int = 16000, block_ms: int = 10) -> None:
        import sounddevice as sd

        os.environ["PULSE_SOURCE"] = source  # read by libpulse when the stream connects
        try:
            self.stream = sd.InputStream(device="pulse", samplerate=rate, channels=1, dtype="float32",
                                         blocksize=rate * block_ms // 1000, callback=self._block)
        finally:
            os.environ.pop("PULSE_SOURCE", None)
        self.rate = rate
        self.latency = self.stream.latency
        self._blocks: list[tuple[float, np.ndarray]] = []
        self._lock = threading.Lock()

    def _block(self, indata: np.ndarray, frames: int, time_info, status) -> None:
        with self._lock:
            self._blocks.append((time.monotonic(), indata[:, 0].copy()))

    def __enter__(self) -> Recorder:
        self.stream.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stream.stop()
        self.stream.close()

    def audio(self) -> np.ndarray:
        with self._lock:
            return np.concatenate([b for _, b in self._blocks]) if self._blocks else np.zeros(0, np.float32)

    def voiced_span(self, until: float = float("inf"), threshold: float = 0.01) -> float:
        """Seconds of the recording from the start of its first block with sound to the end of its
        last, among the blocks heard before ``until`` (a monotonic time): measured in samples
        recorded, so how late the blocks were handed over does not count."""
        with self._lock:
            blocks = list(self._blocks)
        pos, loud = 0, []
        for t, block in blocks:
            if t - self.latency >= until:
                break
            if np.sqrt(np.mean(block**2)) > threshold:
                loud.append((pos, pos + len(block)))
            pos += len(block)
        return (loud[-1][1] - loud[0][0]) / self.rate if loud else 0.0

    def loud_times(self, threshold: float = 0.01) -> list[float]:
        """Monotonic times (end of block, minus the input latency) of the blocks with sound."""
        with self._lock:
            blocks = list(self._blocks)
        return [t - self.latency for t, b in blocks if np.sqrt(np.mean(b**2)) > threshold]


class Speaker:
    """A 'user' talking into one PulseAudio sink from this process: a thread writes silence
    between utterances, so the stream is always running and an utterance starts on time."""

    def __init__(self, sink: str, *, rate: int = 16000) -> None:
        import sounddevice as sd

        os.environ["PULSE_SINK"] = sink
        try:
            self.stream = sd.OutputStream(device="pulse", samplerate=rate, channels=1, dtype="float32",
                                          blocksize=rate // 50)
        finally:
            os.environ.pop("PULSE_SINK", None)
        self.rate, self.block = rate, rate // 50
        self._cond = threading.Condition()
        self._queue: list[tuple[int, np.ndarray]] = []  # (utterance number, 20 ms block)
        self._started: dict[int, float] = {}
        self._said = 0
        self._paced = 0
        self._running = True
        self.stream.start()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        with self._cond:  # past PulseAudio's start-up hold (see nodes/io/_player.py)
            self._cond.wait_for(lambda: self._paced >= 5, timeout=5)

    def _run(self) -> None:
        silence = np.zeros(self.block, np.float32)
        while self._running:
            with self._cond:
                n, block = self._queue.pop(0) if self._queue else (0, silence)
                if n:
                    self._started.setdefault(n, time.monotonic())
                self._cond.notify_all()
            t0 = time.monotonic()
            self.stream.write(block[:, None])
            took = time.monotonic() - t0
            with self._cond:
                self._paced = self._paced + 1 if 0.006 < took < 0.04 else 0
                self._cond.notify_all()

    def play(self, pcm: np.ndarray) -> float:
        """Say ``pcm``, waiting until it is written; returns the monotonic time it started."""
        pcm = np.concatenate([pcm, np.zeros(-len(pcm) % self.block, np.float32)]).astype(np.float32)
        with self._cond:
            self._said += 1
            n = self._said
            self._queue += [(n, pcm[i : i + self.block]) for i in range(0, len(pcm), self.block)]
            self._cond.wait_for(lambda: n in self._started and not any(m == n for m, _ in self._queue),
                                timeout=len(pcm) / self.rate + 10)
            return self._started[n]

    def close(self) -> None:
        self._running = False
        self._thread.join(1)
        self.stream.stop()
        self.stream.close()


class ScriptedUser(Node):
    """A live microphone whose user asks, lets the agent talk ``talk_over_after_s``, then talks over it."""

    outputs = {"audio": AudioChunk}

    def __init__(self, *, ask: str = ASK, talk_over: str = TALK_OVER, talk_over_after_s: float = 1.0,
                 wait_s: float = 60.0, rate: int = 16000):
        self.texts = (ask, talk_over)
        self.talk_over_after_s, self.wait_s, self.rate = talk_over_after_s, wait_s, rate
        self.talk_over_t: float | None = None  # when the user started talking over the agent

    def port_rate(self, port: str) -> int | None:
        return self.rate

    def setup(self) -> None:
        from tests.support.speech import synthesize

        self.ask, self.talk_over = (synthesize(text, self.rate) for text in self.texts)

    def produce(self) -> Iterator[AudioChunk]:
        chunk, pos, t0 = self.rate // 50, 0, time.monotonic()
        playback = playback_of(self.ctx)

        def say(pcm: np.ndarray) -> Iterator[AudioChunk]:
            nonlocal pos
            for i in range(0, len(pcm), chunk):
                piece = pcm[i : i + chunk]
                t = t0 + (pos + len(piece)) / self.rate  # a chunk exists once its last sample is "recorded"
                if self.ctx.stopping.wait(max(0.0, t - time.monotonic())):
                    return
                yield AudioChunk(pcm=piece, rate=self.rate, start=pos / self.rate, t=t)
                pos += len(piece)

        silence = np.zeros(chunk, np.float32)
        yield from say(np.zeros(self.rate // 2, np.float32))
        yield from say(self.ask)
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not self.ctx.stopping.is_set():
            started = playback.started_at(1)
            if started is not None and time.monotonic() - started >= self.talk_over_after_s and playback.audible():
                break  # the agent has been talking a while, and is talking now
            yield from say(silence)
        self.talk_over_t = t0 + pos / self.rate
        yield from say(self.talk_over)
        while not self.ctx.stopping.is_set():  # the microphone stays open until the test stops the run
            yield from say(silence)


@dataclass
class BargeInRun:
    """What a barge-in session left behind, for tests and benchmarks to judge."""

    scheduler: Any
    user: ScriptedUser
    llm: Any
    sink: Any
    loud: list[float]  # when the agent's voice was audible in the room (agent sink monitor)
    room: Recorder | None = None  # the recording of the room itself
    server_idle_after_s: float | None = None  # when llama-server stopped generating after the cut
    history: list[tuple[int, Any, str]] = field(default_factory=list)  # the LLM's, once turn 2 is answered

    @property
    def cut(self) -> dict[str, Any]:
        return next(e for e in self.scheduler.trace.events if e["kind"] == "interrupt")

    def silent_after(self, t: float, within: float = 1.0) -> float:
        """When the agent's voice was last heard between ``t`` and ``t + within`` (``t`` if not at all)."""
        return max([x for x in self.loud if t <= x < t + within], default=t)

    def audible_at(self, t: float, window: float = 0.03) -> bool:
        """Whether the agent's voice was heard in the ``window`` before ``t``."""
        return any(t - window <= x <= t for x in self.loud)


def llama_server_idle(base_url: str) -> bool:
    """Whether llama-server is generating nothing now (its /slots endpoint)."""
    with urllib.request.urlopen(f"{base_url}/slots", timeout=5) as resp:
        return not any(slot.get("is_processing") for slot in json.load(resp))


def run_barge_in(overrides: list[str], base_url: str, out_dir: Path, *, sink: str = "agent",
                 talk_over_after_s: float = 1.0, timeout_s: float = 180.0) -> BargeInRun:
    """Run io=mic with the scripted user as microphone and the speaker on ``sink``; stop once
    the agent has started answering the user's second turn (the one that barged in)."""
    from omegaconf import OmegaConf

    from nodes._playback import playback_of
    from s2s_flow.cli import plan
    from s2s_flow.compose import compose
    from s2s_flow.errors import Stopped
    from s2s_flow.scheduler import Scheduler

    cfg, choices = compose(["io=mic", f"llm.base_url={base_url}/v1", f"io.output_dir={out_dir}", *overrides])
    cfg.io.source = OmegaConf.create({"_target_": f"{__name__}.ScriptedUser", "talk_over_after_s": talk_over_after_s})
    scheduler = Scheduler(plan(cfg, choices), out_dir)
    nodes = {name: spec.node for name, spec in scheduler.graph.nodes.items()}
    run = BargeInRun(scheduler, nodes["source"], nodes["llm"], nodes["sink"], [])

    def watch() -> None:
        playback = playback_of(run.sink.ctx)
        deadline = time.monotonic() + timeout_s
        while not playback.cuts and time.monotonic() < deadline and not run.sink.ctx.stopping.is_set():
            time.sleep(0.01)
        cut_t = time.monotonic()
        while time.monotonic() < cut_t + 2.0:  # the closed request must stop the server generating
            if llama_server_idle(base_url):
                run.server_idle_after_s = time.monotonic() - cut_t
                break
            time.sleep(0.02)
        while playback.started_at(2) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        run.history = [(ex.turn, ex.user, ex.reply) for ex in run.llm.conversation.exchanges]
        scheduler.stop("the scripted conversation is over")

    with Recorder(f"{sink}.monitor") as rec:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with suppress(Stopped):
            scheduler.run()
        watcher.join(10)
    run.loud, run.room = rec.loud_times(), rec
    return run
