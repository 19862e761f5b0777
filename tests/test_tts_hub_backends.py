"""Kokoro and Qwen3-TTS: their hub weights cannot be fetched here, so pin down how they fail.

A missing library names its extra; a library that is installed but whose model is not
cached fails within 5 s with ModelNotAvailable, never a hang on an unreachable hub.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from nodes._hub import hub_file, reachable
from nodes.tts.kokoro import KokoroTTS
from nodes.tts.qwen3 import Qwen3TTS
from s2s_flow.errors import ConfigError, MissingDependency, ModelNotAvailable
from s2s_flow.messages import TextDelta
from s2s_flow.node import Context
from tests.support.servers import free_port


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


QWEN3_INSTALLED = installed("faster_qwen3_tts")  # what the qwen3-tts extra installs on Linux
LINUX = sys.platform.startswith("linux")


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """An empty hub cache and a hub endpoint that refuses connections (loopback, nothing listens)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def setup_node(node, tmp_path) -> None:
    node.ctx = Context("tts", tmp_path)
    node.setup()


@pytest.mark.skipif(installed("kokoro"), reason="kokoro is installed")
def test_kokoro_without_its_library_names_the_extra(tmp_path) -> None:
    with pytest.raises(MissingDependency, match=r"s2s-flow\[kokoro\]"):
        setup_node(KokoroTTS(), tmp_path)


@pytest.mark.skipif(QWEN3_INSTALLED or not LINUX, reason="faster-qwen3-tts is installed, or not Linux")
def test_qwen3_on_linux_without_its_library_names_the_extra(tmp_path) -> None:
    assert Qwen3TTS().backend == "cuda"  # auto on Linux: faster-qwen3-tts on an NVIDIA GPU
    with pytest.raises(MissingDependency, match=r"s2s-flow\[qwen3-tts\]"):
        setup_node(Qwen3TTS(), tmp_path)


@pytest.mark.skipif(not LINUX, reason="Linux")
@pytest.mark.parametrize("backend", ["ggml", "mlx"])
def test_qwen3_backends_pypi_ships_only_for_apple_silicon_say_so_on_linux(tmp_path, backend: str) -> None:
    if backend == "ggml" and installed("qwentts_cpp"):
        pytest.skip("qwentts-cpp-python built from source is installed")
    with pytest.raises(ConfigError, match=r"Apple Silicon.*Linux with an NVIDIA GPU \(tts.backend=cuda"):
        setup_node(Qwen3TTS(backend=backend), tmp_path)


@pytest.mark.skipif(not QWEN3_INSTALLED or not LINUX, reason="needs the qwen3-tts extra on Linux")
def test_qwen3_on_a_machine_without_a_cuda_gpu_names_the_platforms(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("qwen3-tts: this machine has a CUDA GPU")
    local = tmp_path / "qwen3"  # a local directory: no hub involved
    local.mkdir()
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU.*no CPU backend"):
        setup_node(Qwen3TTS(model=str(local)), tmp_path)


@pytest.mark.skipif(not installed("kokoro"), reason="needs the kokoro extra")
def test_kokoro_model_missing_offline_fails_fast(tmp_path, offline_hub) -> None:
    start = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="hexgrad/Kokoro-82M"):
        setup_node(KokoroTTS(), tmp_path)
    assert time.monotonic() - start < 5


@pytest.mark.skipif(not QWEN3_INSTALLED or not LINUX, reason="needs the qwen3-tts extra on Linux")
def test_qwen3_model_missing_offline_fails_fast(tmp_path, offline_hub) -> None:
    start = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="Qwen3-TTS"):
        setup_node(Qwen3TTS(backend="cuda"), tmp_path)
    assert time.monotonic() - start < 5


def tiny_kokoro(directory: Path) -> Path:
    """A Kokoro directory with the real architecture at small width and random weights.

    KModel keeps what it cannot load from the weights file at its random initialisation,
    so an empty state dict gives a working random model; the decoder's widths are fixed
    by the architecture (512), the text side is shrunk.
    """
    import torch

    ipa = "abdefhijklmnoprstuvwxzæçðŋɐɑɔəɛɡɪɲɾʃʊʎʒʝβθχˈˌː ;:,.!?¿¡"
    config = {
        "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6], "gen_istft_hop_size": 5,
                     "gen_istft_n_fft": 20, "resblock_dilation_sizes": [[1, 3, 5]],
                     "resblock_kernel_sizes": [3], "upsample_initial_channel": 512},
        "dim_in": 64, "dropout": 0.2, "hidden_dim": 512, "max_conv_dim": 512, "max_dur": 50,
        "multispeaker": True, "n_layer": 1, "n_mels": 80, "n_token": 178, "style_dim": 128,
        "text_encoder_kernel_size": 5,
        "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                   "max_position_embeddings": 512, "num_hidden_layers": 2, "dropout": 0.1},
        "vocab": {ch: i + 1 for i, ch in enumerate(dict.fromkeys(ipa))},
    }
    (directory / "voices").mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    torch.save({}, directory / "kokoro-tiny.pth")
    torch.manual_seed(0)
    torch.save(torch.randn(510, 1, 256) * 0.1, directory / "voices" / "ef_dora.pt")
    return directory


@pytest.mark.skipif(not installed("kokoro"), reason="needs the kokoro extra")
def test_kokoro_speaks_each_sentence_with_a_local_model_directory(tmp_path) -> None:
    # Spanish (lang_code e) phonemizes with espeak-ng; English needs spaCy's en_core_web_sm.
    node = KokoroTTS(model=str(tiny_kokoro(tmp_path / "kokoro")), voice="ef_dora", lang_code="e",
                     sample_rate=16000)
    setup_node(node, tmp_path)
    first = list(node.process("text", TextDelta(turn=2, text="Hola, ¿qué tal?", sentence_end=True)))
    rest = list(node.process("text", TextDelta(turn=2, text=" Muy bien.", sentence_end=True, end=True)))
    assert {a.text for a in first} == {"Hola, ¿qué tal?"} and sum(len(a.pcm) for a in first) > 1600
    assert {a.text for a in rest if not a.end} == {"Muy bien."}
    assert [a.end for a in rest if a.end] == [True]
    assert {a.rate for a in first + rest} == {16000} and {a.turn for a in first + rest} == {2}
    assert max(len(a.pcm) for a in first + rest) <= 8000


@pytest.mark.skipif(not installed("huggingface_hub"), reason="needs huggingface_hub")
def test_an_uncached_hub_file_fails_fast_when_the_hub_does_not_answer(offline_hub) -> None:
    start = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="hexgrad/Kokoro-82M.*needs a download from the hub"):
        hub_file("hexgrad/Kokoro-82M", "config.json", backend="tts=kokoro")
    assert time.monotonic() - start < 5


def test_an_unreachable_host_is_reported_within_the_timeout() -> None:
    start = time.monotonic()
    assert not reachable(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda: KokoroTTS(lang_code="x"), "tts.lang_code"),
        (lambda: KokoroTTS(model="no-such-model"), "tts.model"),
        (lambda: KokoroTTS(speed=0), "tts.speed"),
        (lambda: Qwen3TTS(backend="torch"), "tts.backend"),
        (lambda: Qwen3TTS(quant="Q2"), "tts.quant"),
        (lambda: Qwen3TTS(chunk_frames=0), "tts.chunk_frames"),
        (lambda: Qwen3TTS(sample_rate=100), "tts.sample_rate"),
    ],
)
def test_bad_hub_backend_options_are_config_errors_naming_the_option(make, option: str) -> None:
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        make()


def test_a_local_model_directory_may_be_given_from_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "kokoro").mkdir()
    (tmp_path / "qwen3-tts").mkdir()
    # a directory, not a hub name: accepted, and kept expanded for the loaders, which do not expand ~
    assert KokoroTTS(model="~/kokoro").model == str(tmp_path / "kokoro")
    assert Qwen3TTS(model="~/qwen3-tts").model == str(tmp_path / "qwen3-tts")
    with pytest.raises(ConfigError, match="neither a local Kokoro directory"):
        KokoroTTS(model="~/nothing-here")
