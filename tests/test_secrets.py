"""Secrets never reach disk or the terminal: every path runs the real CLI and greps every file
it wrote and every line it printed for the key. What is secret is what node classes declare
in ``secret_params`` (plus a server's ``--api-key`` and key-named environment variables)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from omegaconf import OmegaConf

from s2s_flow import redact
from s2s_flow.node import Node
from tests.support.fault_server import FaultServer, Reply
from tests.support.managed import REPO, cli_env
from tests.support.servers import free_port

KEY = "sk-SECRET123"
OTHER_KEY = "sk-SECRET456"


def s2s_run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The real CLI, logging everything it can (DEBUG): more lines that could show a key."""
    return subprocess.run([sys.executable, "-m", "s2s_flow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL,
                          env=cli_env(**{"S2S_LOG_LEVEL": "DEBUG", "OPENAI_API_KEY": "", **env}))


def leaks(proc: subprocess.CompletedProcess, *dirs: Path, keys: tuple[str, ...] = (KEY,)) -> list[str]:
    """Where a key shows: 'stdout', 'stderr' or a file under ``dirs``."""
    found = [name for name, out in (("stdout", proc.stdout), ("stderr", proc.stderr)) if any(k in out for k in keys)]
    for root in dirs:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            found += [str(path) for k in keys if k.encode() in data][:1]
    return found


@pytest.fixture(scope="module")
def silence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 s of silence: the cheap source -> VAD chain runs through it in a fraction of a second."""
    path = tmp_path_factory.mktemp("secrets-input") / "silence.wav"
    sf.write(path, np.zeros(16000, np.float32), 16000)
    return path


CHEAP = ("chain=[io.source,vad]", "llm=chat")


def recipe(tmp_path: Path, body: str) -> dict[str, str]:
    """A user recipe ``keyed`` (S2S_FLOW_CONFIG_PATH): the environment that finds it."""
    (tmp_path / "conf" / "recipe").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "recipe" / "keyed.yaml").write_text(
        "# @package _global_\n# A recipe that holds its secrets in the file.\n#   s2s-run recipe=keyed\n"
        + textwrap.dedent(body))
    return {"S2S_FLOW_CONFIG_PATH": str(tmp_path / "conf")}


@pytest.mark.parametrize("key_in", ["override", "recipe"])
def test_a_run_writes_and_prints_no_key(tmp_path: Path, silence: Path, key_in: str):
    run = tmp_path / "run"
    if key_in == "recipe":
        env, args = recipe(tmp_path, f"llm: {{api_key: {KEY}}}\n"), ["recipe=keyed"]
    else:
        env, args = {}, [f"llm.api_key={KEY}"]
    # hydra.output_subdir=.hydra: Hydra's own copy of the config and overrides too (off by default)
    proc = s2s_run(*CHEAP, *args, f"io.input={silence}", f"hydra.run.dir={run}", "hydra.output_subdir=.hydra",
                   cwd=tmp_path, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "config.yaml").exists() and (run / ".hydra" / "config.yaml").exists()
    assert leaks(proc, run) == []


def test_masking_touches_secrets_only_in_the_written_config(tmp_path: Path, silence: Path):
    run = tmp_path / "run"
    proc = s2s_run(*CHEAP, f"llm.api_key={KEY}", "llm.max_tokens=24", f"io.input={silence}",
                   f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = OmegaConf.load(run / "config.yaml")
    assert written.llm.api_key == "***"
    assert written.llm.max_tokens == 24
    assert written.llm.model == OmegaConf.load(REPO / "conf/llm/chat.yaml").model


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_a_sweep_writes_and_prints_no_key(tmp_path: Path, silence: Path, launcher: str):
    extra = []
    if launcher == "joblib":
        pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install 's2s-flow[sweep-joblib]'")
        extra = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    out = tmp_path / "sweep"
    # one job per key: a key swept over is hidden as well as one fixed for every job
    proc = s2s_run("-m", *CHEAP, *extra, f"llm.api_key={KEY},{OTHER_KEY}", "vad.min_silence_ms=300",
                   f"io.input={silence}", f"hydra.sweep.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (out / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and (out / "multirun.yaml").exists() and (out / "1" / "job.json").exists()
    assert "#1 : " in proc.stdout + proc.stderr  # the launcher still lists its jobs
    assert leaks(proc, out, keys=(KEY, OTHER_KEY)) == []


@pytest.mark.parametrize("args", [
    ("--cfg", "job"), ("--cfg", "job", "--resolve"), ("--cfg", "all", "--resolve"), ("--info", "all"), ("--help",),
    ("--info",),  # argparse takes the override for --info's value and quotes it in its error
    ("dry_run=true",),
])
def test_printed_configs_and_graphs_show_no_key(tmp_path: Path, args: tuple[str, ...]):
    proc = s2s_run(*args, f"llm.api_key={KEY}", "llm.max_tokens=24", cwd=tmp_path)
    assert proc.stdout or proc.stderr
    assert leaks(proc, tmp_path) == []
    if "--cfg" in args:
        assert proc.returncode == 0, proc.stderr
        assert "api_key:" in proc.stdout and "max_tokens: 24" in proc.stdout


def test_a_key_from_the_environment_is_never_printed(tmp_path: Path):
    proc = s2s_run("--cfg", "job", "--resolve", f"llm.system_prompt=say {KEY}", cwd=tmp_path, OPENAI_API_KEY=KEY)
    assert proc.returncode == 0, proc.stderr
    assert "system_prompt: say ***" in proc.stdout and leaks(proc, tmp_path) == []


# -- a model server started with the key ------------------------------------------------------
# A real llama-server serving SmolLM2 (skipped with the command that provides either). The LLM's
# setup asks it for its models with llm.api_key, which it refuses unless it was given that very
# key: a run that succeeds shows the key reached the server unmasked while no output shows it.

SERVED = ("stt=none", "llm=chat", "chain=[io.source,vad,llm]")


def served_recipe(tmp_path: Path, model: Path, port: int, *, llm_key: str | None, command: list[str],
                  env: dict[str, str] | None = None) -> dict[str, str]:
    """The ``keyed`` recipe: llama-server on ``port`` started with ``command`` and ``env``; the LLM talks to it."""
    block = {"llm": {"base_url": f"http://127.0.0.1:{port}/v1"},
             "server": {"command": command, "model": str(model), "ready_url": f"http://127.0.0.1:{port}/health",
                        "stop_timeout_s": 5}}
    if llm_key is not None:
        block["llm"]["api_key"] = llm_key
    if env:
        block["server"]["env"] = env
    return recipe(tmp_path, OmegaConf.to_yaml(OmegaConf.create(block)))


def llama_command(*key_args: str) -> list[str]:
    return ["{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}", "-c", "512", "-np", "1",
            *key_args]


def sweep_or_run(args: list[str], out: Path, mode: str) -> list[str]:
    if mode == "sweep":  # one server per job
        return ["-m", *args, "vad.min_silence_ms=300,500", f"hydra.sweep.dir={out}"]
    return [*args, f"hydra.run.dir={out}"]


@pytest.mark.parametrize(("key_in", "mode"), [("recipe", "run"), ("recipe", "sweep"), ("override", "run"),
                                              ("override", "sweep"), ("env", "run")])
def test_a_key_the_server_is_started_with_reaches_no_file_and_no_output(
        tmp_path: Path, silence: Path, llama_server_binary: Path, smollm2_gguf: Path, key_in: str, mode: str):
    port, args = free_port(), ["recipe=keyed", *SERVED, f"io.input={silence}"]
    if key_in == "recipe":  # and a second secret flag the server takes (and has no use for here)
        env = served_recipe(tmp_path, smollm2_gguf, port, llm_key=KEY,
                            command=llama_command("--api-key", KEY, "--hf-token", OTHER_KEY))
    elif key_in == "override":
        env = served_recipe(tmp_path, smollm2_gguf, port, llm_key=None, command=llama_command())
        command = ",".join(a if a.startswith("-") or a.isdigit() else f"'{a}'" for a in llama_command())
        args += [f"server.command=[{command},--api-key,{KEY}]", f"llm.api_key={KEY}"]
    else:  # llama-server reads LLAMA_API_KEY as its --api-key
        env = served_recipe(tmp_path, smollm2_gguf, port, llm_key=KEY, command=llama_command(),
                            env={"LLAMA_API_KEY": KEY})
    out = tmp_path / "out"
    proc = s2s_run(*sweep_or_run(args, out, mode), cwd=tmp_path, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the LLM got in: the server has the real key
    logs = sorted(out.rglob("server.log"))
    assert len(logs) == (2 if mode == "sweep" else 1)
    for log in logs:
        command_line = log.read_text().splitlines()[0]
        assert command_line.startswith("$ ") and "llama-server" in command_line, command_line
        if key_in != "env":
            assert "--api-key '***'" in command_line, command_line
        info = json.loads((log.parent / "server.json").read_text())
        assert info["started"] is True and "--port" in info["command"]
    assert leaks(proc, out, keys=(KEY, OTHER_KEY)) == []


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_server_that_dies_quoting_its_key_is_reported_without_it(
        tmp_path: Path, silence: Path, llama_server_binary: Path, smollm2_gguf: Path, mode: str):
    # llama-server takes no --api-key=KEY form: it exits at once, its error quoting the argument
    env = served_recipe(tmp_path, smollm2_gguf, free_port(), llm_key=KEY, command=llama_command(f"--api-key={KEY}"))
    out = tmp_path / "out"
    proc = s2s_run(*sweep_or_run(["recipe=keyed", *SERVED, f"io.input={silence}"], out, mode), cwd=tmp_path, **env)
    quoted = "invalid argument: --api-key=***"
    if mode == "run":
        assert proc.returncode != 0, "this llama-server took --api-key=KEY: the test needs an argument it refuses"
        assert quoted in proc.stderr, proc.stderr[-3000:]
    else:
        assert quoted in (out / "0" / "error.txt").read_text()
        assert "2 failed" in (out / "sweep.md").read_text()
    logs = sorted(out.rglob("server.log"))
    assert len(logs) == (2 if mode == "sweep" else 1) and all(quoted in log.read_text() for log in logs)
    assert leaks(proc, out) == []


# -- a server error that echoes the key -------------------------------------------------------


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_server_error_that_echoes_the_key_is_shown_without_it(tmp_path: Path, silence: Path, mode: str):
    refused = Reply.status(401, {"error": {"message": f"Incorrect API key provided: {KEY}.", "code": 401}})
    out = tmp_path / "out"
    with FaultServer() as srv:
        srv.routes["/models"] = refused
        srv.script(refused)
        args = ["stt=none", "llm=chat", "chain=[io.source,vad,llm]", f"llm.base_url={srv.base_url}",
                f"llm.api_key={KEY}", f"io.input={silence}"]
        if mode == "sweep":
            args = ["-m", *args, "vad.min_silence_ms=300,500", f"hydra.sweep.dir={out}"]
        else:
            args.append(f"hydra.run.dir={out}")
        proc = s2s_run(*args, cwd=tmp_path)
    assert srv.requests and srv.requests[0].headers["Authorization"] == f"Bearer {KEY}"  # the key was sent
    if mode == "run":
        assert proc.returncode != 0 and "refused the API key" in proc.stderr
    else:
        assert "refused the API key" in (out / "0" / "error.txt").read_text()
        assert "2 failed" in (out / "sweep.md").read_text()
    assert leaks(proc, out) == []


# -- what is secret: the node classes' declaration --------------------------------------------


class Vault(Node):
    """A node with a secret whose name looks like nothing special, and a harmless *token* option."""

    secret_params = frozenset({"passphrase"})

    def __init__(self, *, passphrase: str = "", token_limit: int = 0, api_key: str = ""):
        pass


def test_what_is_masked_is_what_each_node_class_declares():
    cfg = {
        "llm": {"_target_": "nodes.llm.chat.ChatCompletionsLLM", "api_key": "k1-abcdef", "max_tokens": 24},
        "vault": {"_target_": f"{Vault.__module__}.Vault", "passphrase": "open sesame", "token_limit": 3,
                  "api_key": "public-id"},
        "server": {"command": ["vllm", "serve", "m", "--api-key", "k2-abcdef", "--hf-token=k3-abcdef"],
                   "env": {"VLLM_API_KEY": "k4-abcdef", "CUDA_VISIBLE_DEVICES": "0"}},
        "stt": {"_target_": None},
    }
    shown = redact.masked(cfg)
    assert shown["llm"] == {**cfg["llm"], "api_key": "***"}
    assert shown["vault"] == {**cfg["vault"], "passphrase": "***"}  # api_key is no secret of this class
    assert shown["server"]["command"] == ["vllm", "serve", "m", "--api-key", "***", "--hf-token=***"]
    assert shown["server"]["env"] == {"VLLM_API_KEY": "***", "CUDA_VISIBLE_DEVICES": "0"}
    assert redact.values(cfg) == {"k1-abcdef", "open sesame", "k2-abcdef", "k3-abcdef", "k4-abcdef"}
    assert redact.masked({"llm": {**cfg["llm"], "api_key": None}})["llm"]["api_key"] is None  # unset stays unset
    assert redact.masked({"server": {"command": "vllm serve m --api-key k5-abcdef"}})["server"]["command"] == \
        "vllm serve m --api-key '***'"


def test_secret_overrides_reach_hydra_as_references_to_the_environment(monkeypatch: pytest.MonkeyPatch):
    from s2s_flow.compose import compose
    from s2s_flow.model_server_spec import ServerSpec

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the S2S_SECRET_n it sets go with the test
    args = ["recipe=vllm_qwen3", "llm.api_key=k6-abcdef", "llm.max_tokens=24",
            "server.command='vllm serve m --port 8000 --api-key k7-abcdef'"]
    hidden = redact.hide_overrides(args)
    assert hidden[:3:2] == args[:3:2] and not any("abcdef" in a for a in hidden)
    assert hidden[1].startswith("llm.api_key=${oc.env:S2S_SECRET_")
    cfg, _ = compose(hidden)  # what Hydra composes from them: the keys themselves
    assert cfg.llm.api_key == "k6-abcdef"
    assert ServerSpec.from_config(cfg.server).command[-2:] == ["--api-key", "k7-abcdef"]
