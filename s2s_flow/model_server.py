"""The recipe's model server: s2s-run starts it before the graph and stops it after.

What to start is the ``server:`` block (s2s_flow/model_server_spec.py). If a server that looks
like the expected one already answers ``ready_url`` it is used as is and left running;
otherwise it is started in its own session, logged to ``server.log`` in the run dir (an
``--api-key`` it was given shows as ``***`` there), and stopped (process group: TERM, then
KILL) on exit, on error and on SIGINT/SIGTERM. While the run goes on, a server started here is
watched and restarted if it exits or stops answering (s2s_flow/server_watch.py). A server that
fails to start is explained by what its log says went wrong (s2s_flow/server_causes.py). What
answers ``ready_url``, and whether it is the expected server, is asked by s2s_flow/server_probe.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from s2s_flow import redact
from s2s_flow.errors import Stopped
from s2s_flow.model_server_spec import ServerSpec
from s2s_flow.server_causes import explain, last_start
from s2s_flow.server_probe import ServerError, check_identity, model_ids, probe_url, same_model
from s2s_flow.server_watch import Watch, replicas_of, restarts, running, slots_of

__all__ = ["ServerError", "ServerHandle", "ServerSpec", "managed_server", "replicas_of", "restarts", "slots_of"]

log = logging.getLogger("s2s_flow.model_server")

_POLL_S = 0.1


# -- running ---------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """What a job used: read by the CLI and the metrics (``server.json`` in the run dir)."""

    url: str
    started: bool  # False: a server that already answered was used (and left running)
    command: list[str] = field(default_factory=list)
    pid: int | None = None
    log: str | None = None
    ready_s: float | None = None  # start to ready, when started
    models: list[str] = field(default_factory=list)
    replicas: list[ServerHandle] = field(default_factory=list)  # the other copies (server.replicas)

    def info(self) -> dict[str, Any]:
        return asdict(self)


class _Signals:
    """SIGINT/SIGTERM while the server is ours. ``mode``: 'flag' (start-up: the wait loop
    checks ``.caught``), 'raise' (the graph runs; the scheduler nests its own handlers
    inside), 'hold' (stopping: finish the cleanup first)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.caught: str | None = None
        self.mode = "flag"
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.caught = signal.Signals(signum).name
        if self.mode == "raise":
            raise Stopped(f"stopped by {self.caught}")


def _pdeathsig() -> Callable[[], None] | None:
    """In the child: die with the parent (Linux), so even a SIGKILLed s2s-run leaves no server. KILL:
    an orphan has nobody to escalate TERM (once, in CI, one lived 10 s past its TERM; cause unknown)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(line.rstrip() for line in text.splitlines()[-lines:] if line.strip())


def _binary(spec: ServerSpec) -> Callable[[], str]:
    def find() -> str:
        from s2s_flow.llama_server import find_llama_server

        path = find_llama_server()
        if path is None:
            raise ServerError(
                "no llama-server binary to start: build it once with `s2s-build-llama-server` "
                "(a few minutes; needs cmake and a C++ compiler), or put llama-server on PATH, or "
                f"set S2S_LLAMA_SERVER=/path/to/llama-server. Or start the server yourself so that "
                f"it answers {spec.ready_url}"
            )
        if not (path.is_file() and os.access(path, os.X_OK)):
            source = "S2S_LLAMA_SERVER" if os.environ.get("S2S_LLAMA_SERVER") else "llama-server"
            raise ServerError(
                f"{source}={path} is not an executable file: fix or unset S2S_LLAMA_SERVER, or "
                "build llama-server once with `s2s-build-llama-server`"
            )
        return str(path)

    return find


def _executable(argv: list[str], spec: ServerSpec) -> None:
    exe = argv[0]
    found = shutil.which(exe) if os.sep not in exe else (exe if os.access(exe, os.X_OK) else None)
    if found is None:
        raise ServerError(
            f"server.command[0]={exe!r} is not an executable on PATH: install it (for vLLM: "
            f"pip install vllm; for llama.cpp: use {{llama_server}} and `s2s-build-llama-server`), "
            f"or start the server yourself so that it answers {spec.ready_url}"
        )


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """TERM the whole process group, KILL what is left after ``timeout``; reap the leader."""
    def group(sig: int) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    if proc.poll() is None:
        group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("server pid %d ignored SIGTERM for %.0f s: killing it", proc.pid, timeout)
        group(signal.SIGKILL)
        proc.wait()
    while group(0) and time.monotonic() < deadline:  # children of the server (vLLM workers)
        time.sleep(0.05)
    group(signal.SIGKILL)


class _Until:
    """A watch's restarts end with the run: ``caught`` as :class:`_Signals` has it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    @property
    def caught(self) -> str | None:
        return "the end of the run" if self.event.is_set() else None


class _Starter:
    """Start the server, show its progress, wait until ready_url answers."""

    def __init__(self, spec: ServerSpec, run_dir: Path, console: Any, signals: _Signals | _Until):
        self.spec, self.run_dir, self.console, self.signals = spec, run_dir, console, signals
        self._copier: threading.Thread | None = None
        self.argv: list[str] = []

    def start(self, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        self.argv = argv
        log_path = self.run_dir / self.spec.log
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        redact.register(redact.command_secrets(argv, self.spec.env))
        with open(log_path, "a", encoding="utf-8") as out:
            out.write(f"$ {shlex.join(redact.argv(argv))}\n")
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_pdeathsig(),
        )
        self._copier = threading.Thread(target=_copy_masked, args=(proc.stdout, log_path), daemon=True,
                                        name="server-log")
        self._copier.start()
        log.debug("started %s (pid %d), log in %s", shlex.join(redact.argv(argv)), proc.pid, log_path)
        return proc, log_path

    def log_complete(self, timeout: float = 2.0) -> None:
        """Wait (briefly: a child of the server may hold its output open) for the log's last lines."""
        if self._copier is not None:
            self._copier.join(timeout)

    def wait_ready(self, proc: subprocess.Popen | None, log_path: Path | None, what: str) -> float:
        """Seconds until ready_url answers 200; raises on death, timeout or a signal."""
        spec, started = self.spec, time.monotonic()
        status = self.console.status(f"starting {what}") if self.console is not None else None
        last_state = ""
        with status if status is not None else contextlib.nullcontext():
            while True:
                elapsed = time.monotonic() - started
                if self.signals.caught:
                    raise Stopped(f"stopped by {self.signals.caught} while {what} was starting")
                if proc is not None and proc.poll() is not None:
                    self._died(proc, log_path, what)
                probe = probe_url(spec.ready_url)
                if probe.state == "ready":
                    return elapsed
                if probe.state == "foreign" and proc is None:
                    raise ServerError(f"{spec.ready_url} stopped answering like a server while it "
                                      f"loaded: {probe.detail}")
                if elapsed > spec.start_timeout_s:
                    cause = explain(last_start(log_path), self.argv, host=spec.host, port=spec.port)
                    where = f" Its log ({log_path}) ends with:\n{_tail(log_path)}" if log_path else ""
                    where = f" Its log ({log_path}) says: {cause[1]}" if cause else where
                    raise ServerError(
                        f"{what} was not ready after {spec.start_timeout_s:g} s ({spec.ready_url}: "
                        f"{probe.detail or probe.state}); raise server.start_timeout_s if it is still "
                        f"loading or downloading.{where}"
                    )
                line = _tail(log_path, 1) if log_path else probe.detail
                if status is not None:
                    status.update(f"starting {what} ({elapsed:4.1f} s) [dim]{_markup_safe(line)[-100:]}")
                if probe.state != last_state:
                    log.debug("%s: %s %s", spec.ready_url, probe.state, probe.detail)
                    last_state = probe.state
                time.sleep(_POLL_S)

    def _died(self, proc: subprocess.Popen, log_path: Path | None, what: str) -> None:
        """The cause the log names (a hub out of reach, a missing file, a port taken, no memory)
        with its fix; only when no known cause is in it, the log's last lines."""
        self.log_complete()
        cause = explain(last_start(log_path), self.argv, host=self.spec.host, port=self.spec.port)
        if cause is not None:
            raise ServerError(f"{what} exited with code {proc.returncode} while starting: {cause[1]} "
                              f"Whole log: {log_path}")
        tail = _tail(log_path, 30) if log_path else ""
        raise ServerError(f"{what} exited with code {proc.returncode} while starting. "
                          f"Its log ({log_path}) ends with:\n{tail}")


def _copy_masked(pipe: Any, path: Path) -> None:
    """The server's output into its log, secrets masked: vLLM, for one, prints its arguments."""
    with pipe, open(path, "a", encoding="utf-8") as out:
        for line in iter(pipe.readline, b""):  # whole lines: a secret is never split between two
            out.write(redact.text(line.decode("utf-8", "replace")))
            out.flush()


def _markup_safe(text: str) -> str:
    return text.replace("[", r"\[")


@contextlib.contextmanager
def managed_server(cfg_server: Any, run_dir: Path, *, console: Any = None) -> Iterator[ServerHandle | None]:
    """Make the recipe's server answer its ready_url for the duration of the block.

    Yields None when there is no ``server:`` block, else a ServerHandle saying whether the
    server was started here (and is stopped on the way out) or was already running. With
    ``server.replicas`` above 1 each copy is started on its own port, one after the other, and the
    handle lists the others under ``replicas`` (a first copy found running is used alone).
    """
    if cfg_server is None:
        yield None
        return
    spec = ServerSpec.from_config(cfg_server)
    run_dir = Path(run_dir)
    with _Signals() as signals, contextlib.ExitStack() as stack:
        try:
            copies = [_Copy(spec.replica(0), run_dir, console, signals, stack)]
            if copies[0].handle.started:  # one found running is used alone, as is
                copies += [_Copy(spec.replica(i), run_dir, console, signals, stack,
                                 f"it is copy {i + 1} of server.replicas={spec.replicas}, on the port after the "
                                 f"first's: free port {spec.port + i}, or start one copy with server.replicas=1")
                           for i in range(1, spec.replicas)]
            handle = copies[0].handle
            handle.replicas = [c.handle for c in copies[1:]]
            if all(c.handle.started for c in copies):  # no other process sends them requests
                running(spec.host, spec.ports, spec.slots)
                stack.callback(running, spec.host, spec.ports, None)
            for copy in copies:
                copy.watch(run_dir, handle)
            _write_info(run_dir, handle)
            signals.mode = "raise"
            if signals.caught:  # a signal between the last check and here
                raise Stopped(f"stopped by {signals.caught}")
            yield handle
        finally:
            signals.mode = "hold"  # the copies are stopped on the way out of the stack, last first


class _Copy:
    """One copy of the server: found running, or started here and stopped when ``stack`` closes."""

    def __init__(self, spec: ServerSpec, run_dir: Path, console: Any, signals: _Signals,
                 stack: contextlib.ExitStack, replica: str = "") -> None:
        self.spec = spec
        self.starter = starter = _Starter(spec, run_dir, console, signals)
        self.proc: subprocess.Popen | None = None
        self._watch: Watch | None = None
        try:
            found = _attach(spec, starter)
        except ServerError as exc:  # a later copy's port taken: the count is the other way out
            if not replica:
                raise
            raise ServerError(f"{exc}; {replica}") from None
        if found is not None:
            self.handle = found
            return
        self.argv = argv = spec.argv(_binary(spec))
        _executable(argv, spec)
        what = f"{Path(argv[0]).name} on {spec.host}:{spec.port}"
        self.proc, log_path = starter.start(argv)
        stack.callback(self._stop)
        ready_s = starter.wait_ready(self.proc, log_path, what)
        models = model_ids(spec, probe_url(spec.ready_url).body) or []
        if spec.model and models and not same_model(spec.model, models):
            log.warning("the server started for %s lists the model as %s", spec.model, models[0])
        self.handle = ServerHandle(spec.ready_url, True, redact.argv(argv), self.proc.pid, str(log_path),
                                   round(ready_s, 3), models)
        _say(console, f"started {what} in {ready_s:.1f} s (log: {log_path})")

    def watch(self, run_dir: Path, root: ServerHandle) -> None:
        """Restart this copy, if started here, when it exits or stops answering (``root``: the
        handle server.json is written from)."""
        if self.proc is not None and self.spec.max_restarts:
            self._watch = _watch(self.spec, run_dir, self.argv, self.proc, self.handle, root)

    def _stop(self) -> None:
        proc = self._watch.stop() if self._watch is not None else self.proc  # the last one it started
        if proc is not None:
            _stop(proc, self.spec.stop_timeout_s)
            self.starter.log_complete()
            log.debug("stopped the server (pid %d, exit %s)", proc.pid, proc.returncode)


def _watch(spec: ServerSpec, run_dir: Path, argv: list[str], proc: subprocess.Popen,
           handle: ServerHandle, root: ServerHandle) -> Watch:
    """Restart the server started here if it exits or stops answering, until the run ends."""
    stopping = threading.Event()
    starter = _Starter(spec, run_dir, None, _Until(stopping))
    name = f"{Path(argv[0]).name}:{spec.port}"

    def probe() -> str | None:
        try:
            found = probe_url(spec.ready_url)
        except ServerError as exc:
            return str(exc)
        return None if found.state == "ready" else (found.detail or found.state)

    def start() -> subprocess.Popen:
        started, _ = starter.start(argv)
        handle.pid = started.pid
        return started

    def ready(started: subprocess.Popen) -> None:
        starter.wait_ready(started, run_dir / spec.log, name)
        _write_info(run_dir, root)

    def stop_proc(old: subprocess.Popen) -> None:
        _stop(old, spec.stop_timeout_s)
        starter.log_complete()  # the last lines of one it started (its copier is this starter's)

    return Watch(name, spec, proc, probe=probe, start=start, ready=ready, stopping=stopping,
                 stop_proc=stop_proc).start()


def _attach(spec: ServerSpec, starter: _Starter) -> ServerHandle | None:
    """A handle on a server that already answers ready_url, None if the port is free."""
    probe = probe_url(spec.ready_url)
    if probe.state == "free":
        return None
    if probe.state == "foreign":
        raise ServerError(
            f"{spec.host}:{spec.port} is taken by something that is not the expected server "
            f"(GET {spec.ready_url}: {probe.detail}). Stop it, or move this server to a free port "
            f"(e.g. llm.base_url=http://{spec.host}:<port>/v1)"
        )
    if probe.state == "loading":  # started by hand or by another job: let it finish
        starter.wait_ready(None, None, f"the server already running at {spec.host}:{spec.port}")
        probe = probe_url(spec.ready_url)
    models = check_identity(spec, probe)
    names = ", ".join(Path(m).name for m in models[:2]) or "model not listed"
    _say(starter.console, f"using the server already running at {spec.ready_url} ({names}); "
                          "not starting one, not stopping it")
    return ServerHandle(spec.ready_url, False, models=models)


def _say(console: Any, text: str) -> None:
    if console is None:
        log.info(text)
    else:
        console.print(f"[dim]{_markup_safe(text)}[/dim]")


def _write_info(run_dir: Path, handle: ServerHandle) -> None:
    with contextlib.suppress(OSError):
        run_dir.mkdir(parents=True, exist_ok=True)
        # rewritten on every restart: written beside and renamed, so a reader never sees half a file
        part = run_dir / "server.json.part"
        part.write_text(json.dumps(handle.info(), indent=2) + "\n")
        part.replace(run_dir / "server.json")

