"""Whisper through transformers (PyTorch): distil-large-v3 by default, any Whisper checkpoint.

For GPUs and Apple Silicon (cuda > mps > cpu); on a CPU-only machine stt=whisper is faster.
The model is loaded and warmed up once per process; every session transcribes on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nodes._hub import check_available, ensure_installed, load_offline_first, model_path
from nodes._torch import check_device, pick_device
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

from ._base import UtteranceSTT
from .whisper import WHISPER_RATE, check_language

__all__ = ["WhisperHFSTT"]

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_CHUNK_S = 30  # Whisper's window; longer audio takes transformers' long-form path


@dataclass
class _SharedWhisper:
    """The processor and model every session of the process uses (a pair cannot be weakly referenced)."""

    processor: Any
    model: Any
    device: str
    dtype: Any


class WhisperHFSTT(UtteranceSTT):
    """Transcribes each utterance with ``AutoModelForSpeechSeq2Seq.generate``."""

    def __init__(
        self,
        *,
        model: str = "distil-whisper/distil-large-v3",
        language: str = "en",
        device: str = "auto",
        dtype: str = "auto",
        beam_size: int = 1,
    ) -> None:
        if not model:
            raise ConfigError("stt.model is empty: give a Whisper hub id (distil-whisper/distil-large-v3, "
                              "openai/whisper-large-v3-turbo ...) or a local model directory.")
        check_language(language, "stt.language")
        check_device(device, "stt.device")
        if dtype not in _DTYPES:
            raise ConfigError(f"stt.dtype={dtype!r} is unknown: use one of {', '.join(_DTYPES)} "
                              "(auto: float16 on a GPU, float32 on CPU).")
        if beam_size < 1:
            raise ConfigError(f"stt.beam_size={beam_size} must be >= 1 (1: greedy, fastest).")
        self.model = model_path(model)
        self.language = language
        self.device = device
        self.dtype = dtype
        self.beam_size = beam_size
        self._shared: _SharedWhisper | None = None
        self._model = None
        self._processor = None

    # generate() works on a copy of the generation config (language, task); the feature
    # extractor keeps no state and the tokenizer only decodes.
    shared_safety = ("thread-safe: generate() only reads the weights (eval, inference_mode); "
                     "language and beam size are passed with each call")

    def shared_key(self) -> tuple:
        return (self.model, self.device, self.dtype)

    def inference_key(self) -> str:
        return f"whisper-hf:{self.model}:{self.device}"

    def load_shared(self) -> _SharedWhisper:
        torch = require("torch", "whisper-hf")
        transformers = require("transformers", "whisper-hf")
        device = pick_device(torch, self.device, "stt.device")
        dtype = (getattr(torch, self.dtype) if self.dtype != "auto"
                 else torch.float16 if device.startswith(("cuda", "mps")) else torch.float32)
        self.ctx.progress(f"loading {self.model} on {device} ({str(dtype).removeprefix('torch.')})")

        def load(local_only: bool):
            processor = transformers.AutoProcessor.from_pretrained(self.model, local_files_only=local_only)
            model = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(
                self.model, dtype=dtype, local_files_only=local_only
            )
            return processor, model

        processor, model = load_offline_first(self.model, "stt=whisper_hf", load)
        model = model.to(device).eval()
        self.ctx.progress("warming up Whisper")  # in whatever language it hears: no session's options yet
        silence = processor(np.zeros(WHISPER_RATE // 2, np.float32), sampling_rate=WHISPER_RATE, return_tensors="pt")
        with torch.inference_mode():
            model.generate(silence["input_features"].to(device, dtype))
        return _SharedWhisper(processor, model, device, dtype)

    def setup(self) -> None:
        ensure_installed("torch", "transformers", extra="whisper-hf")
        check_available(self.model, "stt=whisper_hf")  # before the multi-second torch import
        self._torch = require("torch", "whisper-hf")
        shared = self._shared = self.shared()
        self._processor, self._model, self._device, self._dtype = (
            shared.processor, shared.model, shared.device, shared.dtype)
        gen = self._model.generation_config
        self._multilingual = bool(getattr(gen, "is_multilingual", False))
        lang_to_id = getattr(gen, "lang_to_id", None) or {}
        self._lang_of_id = {i: tok.strip("<|>") for tok, i in lang_to_id.items()}
        if not self._multilingual and self.language not in ("en", "auto"):
            raise ConfigError(f"stt.model={self.model!r} is English-only but stt.language={self.language!r}: "
                              "choose a multilingual Whisper or stt.language=en.")
        if self._multilingual and self.language != "auto" and f"<|{self.language}|>" not in lang_to_id:
            raise ConfigError(f"stt.language={self.language!r} is not a language of {self.model}: use one of "
                              f"{', '.join(sorted(self._lang_of_id.values()))} or 'auto'.")

    def transcribe(self, audio: np.ndarray) -> tuple[str, str | None]:
        long_form = len(audio) > _CHUNK_S * WHISPER_RATE
        extra = {"truncation": False, "padding": "longest", "return_attention_mask": True}
        inputs = self._processor(audio, sampling_rate=WHISPER_RATE, return_tensors="pt",
                                 **(extra if long_form else {}))
        kwargs: dict = {"num_beams": self.beam_size}
        if long_form:
            kwargs["attention_mask"] = inputs["attention_mask"].to(self._device)
        if self._multilingual:
            kwargs["task"] = "transcribe"
            if self.language != "auto":
                kwargs["language"] = self.language
        features = inputs["input_features"].to(self._device, self._dtype)
        with self._torch.inference_mode():
            ids = self._model.generate(features, **kwargs)
        ids = ids[0].tolist()
        text = self._processor.batch_decode([ids], skip_special_tokens=True)[0].strip()
        if not self._multilingual:
            return text, "en"
        return text, next((self._lang_of_id[i] for i in ids if i in self._lang_of_id), None)

    def close(self) -> None:
        self._model = self._processor = self._shared = None
