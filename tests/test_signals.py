"""A signal stops s2s-run at once and cleanly, also while a ``setup()`` is stalled (a download
that never answers), also when closing hangs too (a second Ctrl-C), also with a recipe's model
server running (it is stopped), also in a sweep (which then starts no further job).

The tests run the real CLI in a subprocess on a node whose ``setup()`` connects to a socket of
this test that takes the connection and never answers (a stalled download); the signal is sent
once the test has that connection in hand. How long the exits take is printed here
(``pytest -s``) and measured by benchmarks/bench_timing.py.
"""

from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.managed import processes_with, start_cli, write_recipes

T = "tests.support.nodes."
SETUP_TIMEOUT_S = 60  # the CLI's start (imports, composition) until the node's setup() connects
HANG_S = 10  # a run still alive this long after the signal hangs (it takes well under a second)


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
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"s2s-run still ran {HANG_S} s after the signal:\n{err[-3000:]}")
    return out, err, time.monotonic() - since


def read_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def stall_args(port: int, **params: object) -> list[str]:
    extra = "".join(f",{k}:{str(v).lower()}" for k, v in params.items())
    return ["chain=[src,stall]", f"+src={{_target_:{T}CountSource,n:3}}",
            f"+stall={{_target_:{T}SocketStall,port:{port}{extra}}}"]


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
    env = write_recipes(tmp_path / "conf", stops_server=f"""server:
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


# -- in a sweep -------------------------------------------------------------------------------


def test_ctrl_c_in_a_sweep_stops_the_sweep_after_the_row_of_its_job(tmp_path, silent_server):
    port = silent_server.port
    env = write_recipes(tmp_path / "conf", stops_stall=f"""chain: [src, stall]
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
