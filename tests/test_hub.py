"""nodes/_hub.py: the hub probe asks the endpoint (or proxy) really in use, once per address,
and a model that cannot be fetched from here fails with the command that fetches it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

import nodes._hub as hub
from s2s_flow.errors import ModelNotAvailable
from tests.support.servers import free_port


@pytest.fixture
def clean_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached answers, no offline switch, no proxy from the environment."""
    monkeypatch.setattr(hub, "_probed", {})
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "http_proxy", "HTTP_PROXY", "https_proxy",
                 "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts connections."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_the_hub_probe_follows_hf_endpoint_and_the_offline_switch(clean_probe, listening, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening}")
    assert hub.hub_reachable()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # an answer is per address
    assert not hub.hub_reachable()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening}")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert not hub.hub_reachable()


def test_a_proxy_from_the_environment_is_probed_instead_of_the_hub(clean_probe, listening, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # never resolves; the proxy is asked
    monkeypatch.setenv("https_proxy", f"127.0.0.1:{listening}")
    assert hub.hub_reachable()
    monkeypatch.setenv("no_proxy", "hub.invalid")
    start = time.monotonic()
    assert not hub.reachable("https://hub.invalid", timeout=1.0)
    assert time.monotonic() - start < 2


def test_a_hub_model_names_the_huggingface_cli_download_and_the_option():
    err = ModelNotAvailable("org/model", "stt=whisper_hf", "the option is stt.model")
    assert err.download == "huggingface-cli download org/model"
    assert str(err) == (
        "model 'org/model' is not available locally and needs a download from the hub, which this machine "
        "cannot reach (stt=whisper_hf). Download it once where the hub is reachable (huggingface-cli "
        "download org/model) and point the option at the local directory; the option is stt.model."
    )


def test_a_model_from_outside_the_hub_names_its_own_download_command():
    err = ModelNotAvailable("en_core_web_sm", "tts=kokoro", "or choose tts.lang_code=e",
                            download="pip install https://example.org/en_core_web_sm.whl")
    assert "huggingface" not in str(err) and "from the hub" not in str(err)
    assert "(pip install https://example.org/en_core_web_sm.whl); or choose tts.lang_code=e." in str(err)
