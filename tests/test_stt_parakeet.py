"""stt=parakeet: the MLX loader runs a tiny random Parakeet-TDT built here; the NeMo path up to the weights.

parakeet-mlx runs on Linux through mlx[cpu]. NeMo is not installed in the test venv (it
brings ~100 packages); its path is pinned up to the point the weights are needed.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from nodes.stt.parakeet import MLX_MODEL, NEMO_MODEL, ParakeetSTT
from s2s_flow.errors import ConfigError, MissingDependency, ModelNotAvailable
from s2s_flow.messages import Speech
from s2s_flow.node import Context
from tests.support.speech import synthesize

WORDS = ["the", "a", "what", "is", "time", "how", "are", "you"]
VOCAB = ["<unk>"] + ["▁" + w for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz")


def build_tiny_parakeet_tdt(path: Path) -> Path:
    """A random 1-layer Parakeet-TDT in parakeet-mlx's layout (NeMo config.json + model.safetensors)."""
    mx = pytest.importorskip("mlx.core")
    from parakeet_mlx.utils import from_config

    config = {
        "target": "nemo.collections.asr.models.rnnt_bpe_models.EncDecRNNTBPEModel",
        "model_defaults": {"tdt_durations": [0, 1, 2, 3, 4]},
        "preprocessor": {"sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                         "window_stride": 0.01, "window": "hann", "features": 32, "n_fft": 512,
                         "dither": 0.0, "pad_to": 0, "pad_value": 0.0},
        "encoder": {"feat_in": 32, "n_layers": 1, "d_model": 32, "n_heads": 2, "ff_expansion_factor": 2,
                    "subsampling_factor": 8, "self_attention_model": "rel_pos", "subsampling": "dw_striding",
                    "conv_kernel_size": 9, "subsampling_conv_channels": 16, "pos_emb_max_len": 5000},
        "decoder": {"blank_as_pad": True, "vocab_size": len(VOCAB),
                    "prednet": {"pred_hidden": 32, "pred_rnn_layers": 1}},
        "joint": {"num_classes": len(VOCAB), "vocabulary": VOCAB, "num_extra_outputs": 5,
                  "jointnet": {"joint_hidden": 32, "activation": "relu", "encoder_hidden": 32,
                               "pred_hidden": 32}},
        "decoding": {"model_type": "tdt", "durations": [0, 1, 2, 3, 4], "greedy": {"max_symbols": 5}},
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    from_config(config).save_weights(str(path / "model.safetensors"))
    return path


def make(tmp_path: Path, **params) -> ParakeetSTT:
    stt = ParakeetSTT(**params)
    stt.ctx = Context("stt", tmp_path)
    return stt


def test_mlx_loads_a_local_parakeet_tdt_and_transcribes_real_speech(tmp_path):
    pytest.importorskip("parakeet_mlx", reason="pip install parakeet-mlx (needs mlx; mlx[cpu] on Linux)")
    model_dir = build_tiny_parakeet_tdt(tmp_path / "tiny-tdt")
    stt = make(tmp_path, model=str(model_dir), backend="mlx", dtype="float32")
    stt.setup()
    pcm = synthesize("What time is it?", 16000)
    out = list(stt.process("audio", Speech(turn=3, pcm=pcm, rate=16000, start=0.0, end=len(pcm) / 16000,
                                           speech_end_t=0.0)))
    # random weights: nonsense (or only blanks), but exactly what parakeet-mlx decodes itself
    import mlx.core as mx
    import parakeet_mlx
    from parakeet_mlx.audio import get_logmel

    model = parakeet_mlx.from_pretrained(str(model_dir), dtype=mx.float32)
    reference = model.generate(get_logmel(mx.array(pcm, dtype=mx.float32), model.preprocessor_config))[0].text
    assert [(t.turn, t.text) for t in out] == ([(3, reference.strip())] if reference.strip() else [])


def test_mlx_uses_the_mlx_conversion_of_the_default_model():
    assert make(Path("."), backend="mlx").model == MLX_MODEL
    assert make(Path("."), backend="nemo").model == NEMO_MODEL


@pytest.mark.parametrize("backend", ["mlx", "nemo"])
def test_a_hub_model_offline_fails_fast_with_model_not_available(tmp_path, offline_hub, backend):
    module = "parakeet_mlx" if backend == "mlx" else "nemo"
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    stt = make(tmp_path, backend=backend)
    t0 = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="parakeet-tdt-0.6b-v3"):
        stt.setup()
    assert time.monotonic() - t0 < 5


def test_nemo_missing_is_reported_with_the_extra(tmp_path):
    if importlib.util.find_spec("nemo") is not None:
        pytest.skip("NeMo is installed")
    checkpoint = tmp_path / "parakeet.nemo"
    checkpoint.write_bytes(b"")
    stt = make(tmp_path, model=str(checkpoint), backend="nemo")
    with pytest.raises(MissingDependency, match=r"s2s-flow\[parakeet\]"):
        stt.setup()


@pytest.mark.parametrize(
    ("params", "option"),
    [({"backend": "onnx"}, "stt.backend"), ({"device": "mps"}, "stt.device"),
     ({"dtype": "int8"}, "stt.dtype"), ({"model": ""}, "stt.model")],
)
def test_bad_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        ParakeetSTT(**params)
