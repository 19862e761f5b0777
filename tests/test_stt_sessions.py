"""stt=whisper_hf and stt=parakeet (MLX) serve every session of a process from one loaded model.

The models are the tiny random checkpoints their own tests build; each session's transcript
must be what the library decodes by itself, however the sessions interleave.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

from nodes.stt.parakeet import ParakeetSTT
from nodes.stt.whisper_hf import WhisperHFSTT
from s2s_flow.errors import ConfigError
from s2s_flow.node import Context, keep_shared
from tests.support.loads import AtOnce, count_loads, fresh_models, warm_ups
from tests.support.speech import synthesize

RATE = 16000


@pytest.fixture(autouse=True)
def _fresh_models(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_models(monkeypatch)  # each test loads anew


def session(cls: type, tmp_path: Path, said: list[str], **params):
    node = cls(**params)
    node.ctx = Context("stt", tmp_path, progress=said.append)
    node.setup()
    return node


def transcribe_at_once(nodes: list, audio: list[np.ndarray]) -> list[str]:
    """Each node transcribes its audio on a thread of its own, all starting together."""
    start, texts = threading.Barrier(len(nodes), timeout=30), [""] * len(nodes)

    def run(i: int) -> None:
        start.wait()
        texts[i] = nodes[i].transcribe(audio[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return texts


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    return [synthesize(text, RATE) for text in ("What is the capital of Italy?", "How are you today?")]


# -- stt=whisper_hf: thread-safe ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.test_stt_whisper_hf import build_tiny_whisper

    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def whisper_reference(path: Path, pcm: np.ndarray, beams: int) -> str:
    """What transformers decodes by itself, from a model of its own."""
    import transformers

    processor = transformers.WhisperProcessor.from_pretrained(path)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    features = processor(pcm, sampling_rate=RATE, return_tensors="pt").input_features
    return processor.batch_decode(model.generate(features, num_beams=beams), skip_special_tokens=True)[0].strip()


def test_whisper_hf_sessions_share_one_load_and_one_warm_up(tiny_whisper, speech, tmp_path, monkeypatch):
    import transformers

    loads, said = count_loads(transformers.AutoModelForSpeechSeq2Seq, "from_pretrained", monkeypatch), []
    greedy = session(WhisperHFSTT, tmp_path, said, model=str(tiny_whisper), device="cpu")
    beams = session(WhisperHFSTT, tmp_path, said, model=str(tiny_whisper), device="cpu", beam_size=2)
    assert loads == [str(tiny_whisper)] and warm_ups(said) == 1
    assert beams._model is greedy._model and beams._processor is greedy._processor
    expected = [whisper_reference(tiny_whisper, speech[0], 1), whisper_reference(tiny_whisper, speech[1], 2)]
    assert [greedy.transcribe(speech[0])[0], beams.transcribe(speech[1])[0]] == expected
    assert transcribe_at_once([greedy, beams], speech) == expected, "at the same time, as alone"


def test_whisper_hf_with_another_dtype_loads_apart(tiny_whisper, speech, tmp_path, monkeypatch):
    import transformers

    loads, said = count_loads(transformers.AutoModelForSpeechSeq2Seq, "from_pretrained", monkeypatch), []
    f32 = session(WhisperHFSTT, tmp_path, said, model=str(tiny_whisper), device="cpu", dtype="float32")
    bf16 = session(WhisperHFSTT, tmp_path, said, model=str(tiny_whisper), device="cpu", dtype="bfloat16")
    assert len(loads) == 2 and warm_ups(said) == 2 and bf16._model is not f32._model
    assert str(next(bf16._model.parameters()).dtype) == "torch.bfloat16"
    assert f32.transcribe(speech[0])[0] == whisper_reference(tiny_whisper, speech[0], 1)
    assert isinstance(bf16.transcribe(speech[0])[0], str)


def test_an_english_only_whisper_refuses_another_language_in_every_session(tiny_whisper, tmp_path, monkeypatch):
    import transformers

    loads, refused = count_loads(transformers.AutoModelForSpeechSeq2Seq, "from_pretrained", monkeypatch), []
    for _ in range(2):
        node = WhisperHFSTT(model=str(tiny_whisper), language="de", device="cpu")
        node.ctx = Context("stt", tmp_path)
        with pytest.raises(ConfigError, match="English-only but stt.language='de'"):
            node.setup()
        refused.append(node)  # a run closes it; held here, its model stays loaded
    assert loads == [str(tiny_whisper)]


# -- stt=parakeet on MLX: locked -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_parakeet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("parakeet_mlx", reason="pip install parakeet-mlx (needs mlx; mlx[cpu] on Linux)")
    from tests.test_stt_parakeet import build_tiny_parakeet_tdt

    return build_tiny_parakeet_tdt(tmp_path_factory.mktemp("tiny-tdt"))


def test_parakeet_sessions_share_one_load_and_take_turns(tiny_parakeet, speech, tmp_path, monkeypatch):
    import mlx.core as mx
    import parakeet_mlx
    from parakeet_mlx.audio import get_logmel

    reference = parakeet_mlx.from_pretrained(str(tiny_parakeet), dtype=mx.float32)
    mels = [get_logmel(mx.array(pcm, dtype=mx.float32), reference.preprocessor_config) for pcm in speech]
    expected = [reference.generate(mel)[0].text.strip() for mel in mels]
    loads, said = count_loads(parakeet_mlx, "from_pretrained", monkeypatch), []
    params = {"model": str(tiny_parakeet), "backend": "mlx", "dtype": "float32"}
    nodes = [session(ParakeetSTT, tmp_path, said, **params) for _ in range(2)]
    assert len(loads) == 1 and warm_ups(said) == 1 and nodes[0]._asr is nodes[1]._asr
    watched = AtOnce(nodes[0]._asr)  # how many transcriptions run at once
    for node in nodes:
        node._asr = watched
    assert transcribe_at_once(nodes, speech) == expected
    assert watched.most == 1, "one transcription at a time"


@pytest.mark.parametrize(("cls", "model", "held"), [(WhisperHFSTT, "tiny_whisper", "_shared"),
                                                     (ParakeetSTT, "tiny_parakeet", "_asr")],
                         ids=["whisper_hf", "parakeet"])
def test_a_server_preloads_the_model_without_a_setup_and_its_sessions_load_nothing(cls, model, held, request,
                                                                                   speech, tmp_path):
    params = {"model": str(request.getfixturevalue(model)), "device": "cpu"}
    if cls is ParakeetSTT:
        params["backend"] = "mlx"
    said: list[str] = []
    with keep_shared():  # what io=realtime's preload does: shared() on a node never set up
        preloading = cls(**params)
        preloading.ctx = Context("stt", tmp_path, progress=said.append)
        preloaded = preloading.shared()
        del preloading
        gc.collect()
        node = session(cls, tmp_path, said, **params)
        assert getattr(node, held) is preloaded
        assert warm_ups(said) == 1 and sum(line.startswith("loading") for line in said) == 1
        assert isinstance(node.transcribe(speech[0])[0], str)
