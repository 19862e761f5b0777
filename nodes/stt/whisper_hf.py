"""Whisper through transformers (PyTorch): distil-large-v3 by default, any Whisper checkpoint.

For GPUs and Apple Silicon (cuda > mps > cpu); on a CPU-only machine stt=whisper is faster.
"""

from __future__ import annotations

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
        self._model = None
        self._processor = None

    def setup(self) -> None:
        ensure_installed("torch", "transformers", extra="whisper-hf")
        check_available(self.model, "stt=whisper_hf")  # before the multi-second torch import
        torch = require("torch", "whisper-hf")
        transformers = require("transformers", "whisper-hf")
        self._torch = torch
        self._device = pick_device(torch, self.device, "stt.device")
        self._dtype = (getattr(torch, self.dtype) if self.dtype != "auto"
                       else torch.float16 if self._device.startswith(("cuda", "mps")) else torch.float32)
        dtype_name = str(self._dtype).removeprefix("torch.")
        self.ctx.progress(f"loading {self.model} on {self._device} ({dtype_name})")

        def load(local_only: bool):
            processor = transformers.AutoProcessor.from_pretrained(self.model, local_files_only=local_only)
            model = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(
                self.model, dtype=self._dtype, local_files_only=local_only
            )
            return processor, model

        self._processor, model = load_offline_first(self.model, "stt=whisper_hf", load)
        self._model = model.to(self._device).eval()
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
        self.ctx.progress("warming up Whisper")
        self.transcribe(np.zeros(WHISPER_RATE // 2, np.float32))

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
        self._model = self._processor = None
