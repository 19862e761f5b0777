"""Helpers for tests of recipes and of the server s2s-run manages: the real CLI in a
subprocess, and a look at /proc to prove that no server process outlived it.

    proc = start_cli(["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{port}/v1"], run_dir)
    assert not processes_with(f"--port\\0{port}")
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def processes_with(needle: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose NUL-separated argv contains ``needle``."""
    try:
        import psutil
    except ImportError:  # Linux without psutil: read /proc
        psutil = None
    found = []
    if psutil is not None:
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            argv = proc.info["cmdline"] or []
            if proc.info["pid"] != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE \
                    and needle in "\0".join(argv) + "\0":
                found.append((proc.info["pid"], " ".join(argv)))
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle.encode() in raw:
            found.append((int(entry.name), raw.replace(b"\0", b" ").decode(errors="replace")))
    return found


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Terminate a child process; kill it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(check: Callable[[], object], timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(step)
    return bool(check())


def cli_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def write_recipes(root: Path, **files: str) -> dict[str, str]:
    """Write test recipes (``name=yaml body``) into ``root/recipe/`` and return the CLI env that finds them."""
    (root / "recipe").mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (root / "recipe" / f"{name}.yaml").write_text("# @package _global_\n" + body)
    return cli_env(S2S_FLOW_CONFIG_PATH=str(root))


def start_cli(args: Sequence[str], run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``s2s-run ARGS hydra.run.dir=RUN_DIR`` in the background; output captured as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "s2s_flow.cli", *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, stdin=subprocess.DEVNULL,
    )


def run_cli(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s2s_flow.cli", *args], cwd=cwd, env=env or cli_env(),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def question_wav(path: Path, text: str = "How many kilometers are there in a marathon?",
                 tail_s: float = 1.0) -> Path:
    """A spoken question (Piper) followed by ``tail_s`` of silence, as a 16 kHz WAV."""
    import soundfile as sf

    from tests.support.speech import speech_with_pauses

    pcm, _ = speech_with_pauses([text], 16000, tail_s=tail_s)
    sf.write(path, pcm, 16000)
    return path


#: A graph that runs until a signal stops it, in a process of its own (argv[1]: the checkout):
#: it prints "running" once messages reach its sink, then how it was stopped and how many node
#: threads were left, and exits 130.
SIGNALLED_GRAPH = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    from omegaconf import OmegaConf
    from s2s_flow.errors import Stopped
    from s2s_flow.graph import build_graph
    from s2s_flow.scheduler import Scheduler
    from s2s_flow.validate import validate
    T = "tests.support.nodes."
    cfg = OmegaConf.create({"chain": ["src", "up", "out"], "src": {"_target_": T + "CountSource", "n": 10**9},
                            "up": {"_target_": T + "Upper", "delay_s": 0.001}, "out": {"_target_": T + "Collect"}})
    s = Scheduler(validate(build_graph(cfg)), ".")
    def announce():  # once messages reach the sink, run() is running and handles signals
        while not s.graph.nodes["out"].node.got:
            time.sleep(0.001)
        print("running", flush=True)
    threading.Thread(target=announce, daemon=True).start()
    try:
        s.run()
    except Stopped as exc:
        left = [t.name for t in threading.enumerate() if t.name.startswith("node:")]
        print("stopped:", exc, f"({len(left)} node threads left)", flush=True)
        sys.exit(130)
""")


def start_signalled_graph(cwd: Path) -> subprocess.Popen:
    """:data:`SIGNALLED_GRAPH`, started and running (its first messages reached the sink)."""
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_GRAPH, str(REPO)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "running":
        proc.kill()
        raise AssertionError(f"the graph never ran: {proc.communicate()[1][-2000:]}")
    return proc
