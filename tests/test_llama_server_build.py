"""Locating and running the cached llama-server (building it is `s2s-build-llama-server`)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import shutil
import ssl
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from s2s_flow import llama_server
from s2s_flow.cache import cache_dir
from s2s_flow.llama_server import cached_binary, find_llama_server, install_dir
from tests.support.servers import running_llama_server


def test_the_build_is_cached_per_version_and_build_options(monkeypatch, tmp_path):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    version = llama_server.LLAMA_CPP_PYTHON_VERSION
    assert cached_binary().parent.parent.parent == tmp_path / "llama-server"
    assert cached_binary().parent.parent.name.startswith(f"{version}-")
    assert cached_binary() == install_dir() / "bin" / "llama-server"
    assert install_dir() == install_dir(version)  # stable: the same options find the same build
    assert install_dir("0.3.1") != install_dir()
    with_https = install_dir()
    monkeypatch.setattr(llama_server, "CMAKE_ARGS", tuple(a.replace("OPENSSL=ON", "OPENSSL=OFF")
                                                          for a in llama_server.CMAKE_ARGS))
    assert install_dir() != with_https  # a build made without HTTPS is never taken for one with it


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


def test_a_build_is_installed_whole_where_it_is_then_found(monkeypatch, tmp_path):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    monkeypatch.delenv("S2S_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(llama_server, "_check_toolchain", lambda: None)
    builds = []

    def build_in(tmp: Path, dest: Path, jobs: int, verbose: bool, log) -> None:  # compiling takes minutes
        if not builds:
            assert not cached_binary().exists()  # nothing is visible before the build is whole
        builds.append(dest)
        (dest / "bin").mkdir()
        (dest / "bin" / "llama-server").write_text("#!/bin/sh\n")
        (dest / "bin" / "llama-server").chmod(0o755)

    monkeypatch.setattr(llama_server, "_build_in", build_in)
    assert llama_server.build() == cached_binary() and find_llama_server() == cached_binary()
    assert llama_server.build() == cached_binary() and len(builds) == 1
    llama_server.build(force=True)
    assert len(builds) == 2 and [p.name for p in cached_binary().parents[2].iterdir() if p.is_dir()] == [
        install_dir().name]  # the old build swapped out, no staging dir left


def test_the_llama_cpp_python_wheel_is_cached_beside_the_binary_and_printed_alone(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path))
    assert llama_server.wheel_dir().parent == install_dir().parent  # the directory .ci/run keeps
    assert llama_server.wheel_dir() == llama_server.wheel_dir(llama_server.LLAMA_CPP_PYTHON_VERSION)
    assert llama_server.wheel_dir("0.3.1") != llama_server.wheel_dir() != install_dir()
    assert llama_server.cached_wheel() is None
    wheel = llama_server.wheel_dir() / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    monkeypatch.setattr(llama_server, "_check_toolchain", lambda: pytest.fail("built again"))
    assert llama_server.main(["--python-wheel"]) == 0
    assert capsys.readouterr().out == f"{wheel}\n"  # the one line scripts/bootstrap.sh installs


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
    assert info["cmake_args"] == list(llama_server.CMAKE_ARGS)
    assert "-DGGML_NATIVE=OFF" in info["cmake_args"] and "-DLLAMA_OPENSSL=ON" in info["cmake_args"]


def test_the_cached_llama_server_can_download_from_the_hub(llama_server_binary: Path):
    """The recipes' `-hf org/model` needs HTTPS in the binary itself (OpenSSL, found at build time)."""
    proc = subprocess.run([str(llama_server_binary), "--help"], capture_output=True, text=True, timeout=60)
    assert "-hf," in proc.stdout + proc.stderr
    if shutil.which("ldd"):
        linked = subprocess.run(["ldd", str(llama_server_binary)], capture_output=True, text=True).stdout
        assert "libssl.so" in linked and "libcrypto.so" in linked


@pytest.fixture
def https_server(tmp_path: Path, smollm2_gguf: Path):
    """An HTTPS file server on 127.0.0.1 serving the SmolLM2 GGUF, with a self-signed certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    root, cert, key = tmp_path / "www", tmp_path / "cert.pem", tmp_path / "key.pem"
    root.mkdir()
    (root / "smollm2.gguf").symlink_to(smollm2_gguf)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()
    server.server_close()


def test_the_cached_llama_server_downloads_a_model_over_https(https_server, smollm2_gguf: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    """What `-hf` does on a machine with the internet, against a local HTTPS server: the TLS
    handshake, certificate check (our certificate, trusted through SSL_CERT_FILE) and download."""
    url, cert = https_server
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama-cache"))
    fetched = tmp_path / "fetched.gguf"
    with (running_llama_server(fetched, extra_args=("-mu", f"{url}/smollm2.gguf")) as base_url,
          httpx.Client(timeout=10, trust_env=False) as client):
        assert client.get(f"{base_url}/health").status_code == 200

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert digest(fetched) == digest(smollm2_gguf)


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
