"""The managed server comes back (s2s_flow/server_watch.py), on a real llama-server: one that is
frozen (SIGSTOP: alive, but answers nothing) is restarted after its missed probes; one that
cannot come back (its model file gone) is tried a bounded number of times, each try counted,
then given up on; a server started by someone else is never restarted; a restarted server is
stopped at the end as gently as the first."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal

from omegaconf import OmegaConf

from s2s_flow.model_server import managed_server
from s2s_flow.server_watch import restarts
from tests.support.managed import processes_with, wait_until
from tests.support.servers import answers, free_port


def _cfg(model, port: int, **extra):
    return OmegaConf.create({
        "command": ["{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}", "-c", "512", "-np", "1"],
        "model": str(model), "ready_url": f"http://127.0.0.1:{port}/health", "stop_timeout_s": 2,
        "health_interval_s": 0.2, "restart_backoff_s": 0.2, **extra})


def test_a_frozen_server_is_restarted_after_its_missed_probes(llama_server_binary, smollm2_gguf, tmp_path, caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, "s2s_flow.model_server"), \
            managed_server(_cfg(smollm2_gguf, port, health_failures=2), tmp_path) as handle:
        frozen = handle.pid
        os.kill(frozen, signal.SIGSTOP)
        assert wait_until(lambda: handle.pid != frozen and answers(port), 120), caplog.text
        assert [pid for pid, _ in processes_with(f"--port\0{port}\0")] == [handle.pid], "the frozen one was killed"
    assert f"llama-server:{port} stopped answering" in caplog.text and "2 probes in a row" in caplog.text
    assert restarts()[f"llama-server:{port}"] == 1
    assert not processes_with(f"--port\0{port}\0"), "neither the frozen server nor the new one is left"


def test_a_restarted_server_is_stopped_as_gently_as_the_first_at_the_end(llama_server_binary, smollm2_gguf,
                                                                          tmp_path):
    # The watch's thread started it, and a thread's end KILLs what it started (PR_SET_PDEATHSIG):
    # the watch stops it itself first, so llama-server runs its own shutdown as the first one would.
    port = free_port()
    with managed_server(_cfg(smollm2_gguf, port), tmp_path) as handle:
        first = handle.pid
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: handle.pid != first and answers(port), 120)
    starts = (tmp_path / "server.log").read_text().split("$ ")
    assert len(starts) == 3, "the first server and its restart, each logged"
    assert "cleaning up before exit" in starts[2], starts[2][-400:]
    assert not processes_with(f"--port\0{port}\0")


def test_a_server_that_cannot_come_back_is_tried_a_bounded_number_of_times(llama_server_binary, smollm2_gguf,
                                                                           tmp_path, caplog):
    model = tmp_path / "model.gguf"
    shutil.copy(smollm2_gguf, model)
    port = free_port()
    name = f"llama-server:{port}"
    with caplog.at_level(logging.WARNING, "s2s_flow.model_server"), \
            managed_server(_cfg(model, port, max_restarts=2), tmp_path) as handle:
        model.unlink()  # every restart now fails: the file is gone
        os.kill(handle.pid, signal.SIGKILL)
        assert wait_until(lambda: "giving up" in caplog.text, 120), caplog.text
    assert restarts()[name] == 2, "each try counted"
    assert caplog.text.count("did not come back (try") == 2
    assert "cannot be read (No such file or directory)" in caplog.text, "each try says why, from the log"
    assert "did not come back after 2 tries: giving up" in caplog.text
    assert not processes_with(f"--port\0{port}\0")


def test_a_server_that_was_already_running_is_not_restarted(llama_server_binary, smollm2_gguf, tmp_path):
    from tests.support.servers import running_llama_server

    with running_llama_server(smollm2_gguf, binary=llama_server_binary) as base:
        port = int(base.rsplit(":", 1)[1])
        with managed_server(_cfg(smollm2_gguf, port), tmp_path) as handle:
            assert not handle.started
    assert f"llama-server:{port}" not in restarts()


def test_the_restart_options_are_checked_before_anything_starts():
    import pytest

    from s2s_flow.errors import ConfigError
    from s2s_flow.model_server_spec import ServerSpec

    base = {"command": ["x"], "ready_url": "http://127.0.0.1:1/health"}
    for key, bad, says in (("max_restarts", -1, "whole number >= 0 (0: never restart)"),
                           ("max_restarts", 1.5, "whole number"), ("health_failures", 0, "whole number >= 1"),
                           ("health_interval_s", 0, "seconds > 0"), ("restart_backoff_s", "soon", "seconds > 0")):
        with pytest.raises(ConfigError, match=re.escape(f"server.{key}={bad!r} must be a ") + ".*" + re.escape(says)):
            ServerSpec.from_config({**base, key: bad})
    spec = ServerSpec.from_config({**base, "max_restarts": 0})
    assert (spec.max_restarts, spec.health_failures, spec.health_interval_s) == (0, 3, 2.0)
