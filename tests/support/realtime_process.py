"""A real ``s2s-run ... io=realtime`` process on a free loopback port, for the tests and benchmarks that
signal it, kill it, or put a load balancer in front of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as answer:
        return answer.code, json.loads(answer.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


@dataclass
class RealtimeProcess:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        """The WebSocket base (ws://127.0.0.1:PORT/v1), as the tests' clients take it."""
        return f"ws://127.0.0.1:{self.port}/v1"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> int:
        return get(self.http + "/readyz")[0]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def realtime_process(run_dir: Path, *overrides: str, port: int | None = None,
                     start_timeout: float = 300.0) -> Iterator[RealtimeProcess]:
    """``s2s-run recipe=local_cpu io=realtime`` with ``overrides``, serving (``/healthz`` answers) for the
    block; killed after it if still running. Its output goes to ``run_dir/s2s-run.log``."""
    port = port or free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "s2s-run.log"
    cmd = [sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", "io=realtime", f"io.port={port}",
           f"hydra.run.dir={run_dir / 'run'}", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("S2S_REALTIME_API_KEY", None)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    served = RealtimeProcess(proc, port, log)
    try:
        deadline = time.monotonic() + start_timeout
        while get(served.http + "/healthz", timeout=2)[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"s2s-run exited ({proc.returncode}) before serving:\n{served.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"s2s-run did not serve within {start_timeout:g} s:\n{served.output()[-3000:]}")
            time.sleep(0.2)
        yield served
    finally:  # the process and its managed model servers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
