"""Sweeps and stops that tell the truth: a dry run loads nothing, a failed job fails the
sweep, a signal stops a run whose setup is stalled, a dead node thread fails the run, and an
impossible run directory is an answer.

The signal tests run the real CLI in a subprocess on a node whose ``setup()`` connects to a
socket of this test that takes the connection and never answers (a stalled download); the
signal is sent once the test has that connection in hand.
"""

from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from s2s_flow.errors import NodeFailed
from s2s_flow.graph import build_graph
from s2s_flow.rings import RingClosed
from s2s_flow.scheduler import Scheduler
from s2s_flow.validate import validate
from tests.support.managed import cli_env, processes_with, run_cli, start_cli

T = "tests.support.nodes."
SETUP_TIMEOUT_S = 60  # the CLI's start (imports, composition) until the node's setup() connects
EXIT_BOUND_S = 10  # generous: the target is 1 s; the measured time is printed (pytest -s)


class SilentServer:
    """A listening socket that takes connections and never answers them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []  # accepted, kept open, never answered

    def connected(self, proc: subprocess.Popen, what: str, timeout: float = SETUP_TIMEOUT_S) -> None:
        """Wait until ``proc`` connects (``what`` names the code that does, for the failure)."""
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{what} never connected; s2s-run said:\n{out[-2000:]}\n{err[-3000:]}")
        self.held.append(conn)

    def close(self) -> None:
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    srv = SilentServer()
    yield srv
    srv.close()


def exits_within(proc: subprocess.Popen, since: float) -> tuple[str, str, float]:
    try:
        out, err = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"s2s-run still ran {EXIT_BOUND_S} s after the signal:\n{err[-3000:]}")
    return out, err, time.monotonic() - since


def recipes(root: Path, **files: str) -> dict[str, str]:
    """Write test recipes into ``root/recipe/`` and return the env that finds them."""
    (root / "recipe").mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (root / "recipe" / f"{name}.yaml").write_text("# @package _global_\n" + body)
    return cli_env(S2S_FLOW_CONFIG_PATH=str(root))


def read_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def stall_args(port: int, **params: object) -> list[str]:
    extra = "".join(f",{k}:{str(v).lower()}" for k, v in params.items())
    return ["chain=[src,stall]", f"+src={{_target_:{T}CountSource,n:3}}",
            f"+stall={{_target_:{T}SocketStall,port:{port}{extra}}}"]


MARK = f"""chain: [src, mark]
src: {{_target_: {T}CountSource, n: 3}}
mark:
  _target_: {T}MarkSetup
  path: ???
  fail: false
"""


# -- signals while setup() is stalled ------------------------------------------------------


@pytest.mark.parametrize("in_pool", [False, True], ids=["in-setup", "in-a-pool-worker"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_a_setup_is_stalled_on_a_silent_server_stops_at_once(sig, in_pool, tmp_path, silent_server):
    proc = start_cli(stall_args(silent_server.port, in_pool=in_pool), tmp_path / "run")
    silent_server.connected(proc, "the stalled setup()")
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err, took = exits_within(proc, t0)
    print(f"\n{sig.name} during a stalled setup() (in_pool={in_pool}): s2s-run exited {took:.3f} s later")
    assert proc.returncode == 130, err
    assert f"stopped by {sig.name} while the setup() of 'stall' had not returned" in err
    assert "Traceback" not in err
    assert (tmp_path / "run" / "trace.json").exists()  # what the run had written is kept


def test_a_second_ctrl_c_leaves_when_closing_the_nodes_hangs_too(tmp_path, silent_server):
    proc = start_cli(stall_args(silent_server.port, stall_close=True), tmp_path / "run")
    silent_server.connected(proc, "the stalled setup()")
    proc.send_signal(signal.SIGINT)
    silent_server.connected(proc, "the stalled close()")  # the first stop hangs in close()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err, took = exits_within(proc, t0)
    print(f"\nsecond SIGINT while close() hung: s2s-run exited {took:.3f} s later")
    assert proc.returncode == 130, err
    assert "stopped by SIGINT a second time: left without waiting for the nodes to close" in err
    assert "the setup() of 'stall' had not returned" in err and "Traceback" not in err


def test_a_recipe_server_is_still_stopped_when_a_stalled_setup_is_interrupted(tmp_path, silent_server):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        http_port = probe.getsockname()[1]
    env = recipes(tmp_path / "conf", stops_server=f"""server:
  command: ["{sys.executable}", -m, http.server, --bind, "{{host}}", "{{port}}"]
  ready_url: http://127.0.0.1:{http_port}/
  start_timeout_s: 30
""")
    server = "\0".join(["http.server", "--bind", "127.0.0.1", str(http_port), ""])  # its argv
    proc = start_cli(["recipe=stops_server", *stall_args(silent_server.port)], tmp_path / "run", env)
    silent_server.connected(proc, "the stalled setup()")  # the server answered before setup
    assert processes_with(server)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err, took = exits_within(proc, t0)
    print(f"\nSIGINT during a stalled setup() with a recipe server: s2s-run exited {took:.3f} s later")
    assert proc.returncode == 130, err
    assert not processes_with(server)


# -- sweeps -------------------------------------------------------------------------------------


def test_a_dry_run_sweep_sets_nothing_up_and_starts_no_server(tmp_path):
    mark = tmp_path / "setup-ran"
    marked = MARK.replace("???", str(mark))
    env = recipes(tmp_path / "conf", stops_mark=marked, stops_mark_server=marked + f"""server:
  command: [sh, -c, "echo started > {mark}.server"]
  ready_url: http://127.0.0.1:9/health
  start_timeout_s: 2
""")
    out = run_cli(["-m", "recipe=stops_mark_server,stops_mark", "dry_run=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("src.text -> mark.text") == 2  # each job's graph, printed
    assert not mark.exists() and not Path(f"{mark}.server").exists()
    rows = read_rows(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_a_sweep_with_a_failed_job_writes_its_report_then_exits_non_zero(tmp_path):
    env = recipes(tmp_path / "conf", stops_mark=MARK)
    out = run_cli(["-m", "recipe=stops_mark", f"mark.path={tmp_path / 'setup-ran'}", "mark.fail=false,true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, env, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    rows = read_rows(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "node 'mark' failed: RuntimeError: model file is corrupt" in rows[1]["error"]
    assert "2 jobs, 1 ok, 1 failed" in (tmp_path / "sweep" / "sweep.md").read_text()
    assert "sweep: 2 jobs, 1 failed" in out.stderr


def test_ctrl_c_in_a_sweep_stops_the_sweep_after_the_row_of_its_job(tmp_path, silent_server):
    port = silent_server.port
    env = recipes(tmp_path / "conf", stops_stall=f"""chain: [src, stall]
src: {{_target_: {T}CountSource, n: 3}}
stall: {{_target_: {T}SocketStall, port: {port}}}
""")
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "s2s_flow.cli", "-m", "recipe=stops_stall", "src.n=1,2,3",
                             f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    silent_server.connected(proc, "job 0's stalled setup()")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err, took = exits_within(proc, t0)
    print(f"\nSIGINT in a sweep's stalled setup(): s2s-run exited {took:.3f} s later")
    assert proc.returncode == 130, err
    assert "No further job was started" in err and "Traceback" not in err
    rows = read_rows(sweep_dir)
    assert len(rows) == 1 and rows[0]["status"] == "failed" and "stopped by SIGINT" in rows[0]["error"]
    silent_server.sock.settimeout(0.5)
    with pytest.raises(TimeoutError):  # job 1 never started its setup()
        silent_server.sock.accept()


# -- node threads -------------------------------------------------------------------------------


@pytest.mark.parametrize("chain, culprit", [
    ({"src": f"{T}CountSource", "bad": f"{T}ClosesRing", "out": f"{T}Collect"}, "bad"),
    ({"bad": f"{T}ClosesRingSource", "out": f"{T}CollectTranscripts"}, "bad"),
])
def test_a_ring_closed_that_ends_a_node_thread_fails_the_run_and_names_the_node(chain, culprit, tmp_path,
                                                                                monkeypatch):
    unreported: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unreported.append)
    cfg = OmegaConf.create({"chain": list(chain), **{k: {"_target_": v} for k, v in chain.items()}})
    s = Scheduler(validate(build_graph(cfg)), tmp_path)
    with pytest.raises(NodeFailed) as failed:
        s.run()
    assert failed.value.node == culprit and isinstance(failed.value.exc, RingClosed)
    assert f"node '{culprit}' failed: RingClosed" in str(failed.value)
    assert unreported == []


def test_an_exception_in_a_node_loop_s_own_cleanup_fails_the_run_and_names_the_node(tmp_path, monkeypatch):
    unreported: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unreported.append)
    cfg = OmegaConf.create({"chain": ["src", "out"], "src": {"_target_": f"{T}CountSource"},
                            "out": {"_target_": f"{T}CollectTranscripts"}})
    s = Scheduler(validate(build_graph(cfg)), tmp_path)
    close_outputs = s._close_outputs

    def broken(run):  # the engine's own cleanup raising, after the node's loop
        close_outputs(run)
        if run.name == "src":
            raise OSError("cleanup failed")

    monkeypatch.setattr(s, "_close_outputs", broken)
    with pytest.raises(NodeFailed, match="node 'src' failed: OSError: cleanup failed"):
        s.run()
    assert unreported == []


# -- run directories ----------------------------------------------------------------------------


@pytest.mark.parametrize("multirun", [False, True])
@pytest.mark.parametrize("where", ["/proc/x", "{file}/sub"])
def test_an_impossible_run_dir_is_one_paragraph_with_exit_code_2(where, multirun, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    where = where.format(file=tmp_path / "file")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    mark = tmp_path / "setup-ran"
    args = ["chain=[src,mark]", f"+src={{_target_:{T}CountSource,n:3}}",
            f"+mark={{_target_:{T}MarkSetup,path:'{mark}'}}", f"{key}={where}"]
    out = run_cli(["-m", *args] if multirun else args, tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip()
    assert err.startswith(f"s2s-run: error: {key}={where}: the ") and f"Point {key} at a directory" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not mark.exists()
