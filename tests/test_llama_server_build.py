"""Locating and running the cached llama-server (building it is `s2s-build-llama-server`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from s2s_flow import llama_server
from s2s_flow.llama_server import cache_dir, cached_binary, find_llama_server


def test_cache_dir_honours_s2s_flow_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cached_binary() == (
        tmp_path / "llama-server" / llama_server.LLAMA_CPP_PYTHON_VERSION / "bin" / "llama-server"
    )


def test_find_llama_server_prefers_s2s_llama_server(monkeypatch, tmp_path):
    chosen = tmp_path / "my-llama-server"
    monkeypatch.setenv("S2S_LLAMA_SERVER", str(chosen))
    assert find_llama_server() == chosen


def test_find_llama_server_falls_back_to_path(monkeypatch, tmp_path):
    monkeypatch.delenv("S2S_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "empty-cache"))
    on_path = tmp_path / "bin" / "llama-server"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_llama_server() == on_path
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert find_llama_server() is None


def test_build_is_a_no_op_when_the_binary_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    cached_binary().parent.mkdir(parents=True)
    cached_binary().write_text("#!/bin/sh\n")
    assert llama_server.build() == cached_binary()


def test_print_path_exits_1_when_there_is_no_server(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("S2S_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert llama_server.main(["--print-path"]) == 1
    assert "s2s-build-llama-server" in capsys.readouterr().err


def test_missing_cmake_names_the_apt_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert llama_server.main([]) == 2
    assert "apt-get install cmake g++" in capsys.readouterr().err


def test_the_llama_server_binary_runs(llama_server_binary: Path):
    proc = subprocess.run([str(llama_server_binary), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "version:" in proc.stdout + proc.stderr


def test_cached_build_records_its_build_info():
    if not cached_binary().is_file():
        pytest.skip("no cached build: run `s2s-build-llama-server`")
    info = json.loads((cached_binary().parent.parent / "build-info.json").read_text())
    assert info["llama_cpp_python_version"] == llama_server.LLAMA_CPP_PYTHON_VERSION
    assert "-DGGML_NATIVE=OFF" in info["cmake_args"]


def test_llama_server_serves_smollm2_chat_completions(smollm2_server: str):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    with httpx.Client(timeout=60, trust_env=False) as client:
        resp = client.post(
            f"{smollm2_server}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 24, "temperature": 0},
        )
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
