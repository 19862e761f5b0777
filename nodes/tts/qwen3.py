"""Qwen3-TTS CustomVoice (the reference's default voice): on Linux the GGML backend of
``faster-qwen3-tts`` (qwentts.cpp, CUDA or Metal), on Apple Silicon ``mlx-audio``. 24 kHz,
streamed in codec packets of ``chunk_frames`` x 80 ms."""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nodes._hub import ensure_installed, hub_snapshot, load_offline_first, local_dir, model_path
from nodes.tts._base import SentenceTTS
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

__all__ = ["Qwen3TTS"]

_BACKENDS = ("auto", "ggml", "mlx")
_QUANTS = ("BF16", "F32", "Q8_0", "Q4_K_M")
_FRAME_S = 0.08  # one 12.5 Hz codec frame


class Qwen3TTS(SentenceTTS):
    """Qwen3-TTS with a preset speaker (Ryan, Aiden, Vivian, ...), streamed as it decodes."""

    def __init__(
        self,
        *,
        model: str = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
        speaker: str = "Ryan",
        language: str = "english",
        instruct: str | None = None,
        backend: str = "auto",
        quant: str = "BF16",
        chunk_frames: int = 4,
        sample_rate: int | None = None,
    ) -> None:
        super().__init__(sample_rate=sample_rate)
        if backend not in _BACKENDS:
            raise ConfigError(f"tts.backend={backend!r}: choose ggml (faster-qwen3-tts on qwentts.cpp), "
                              "mlx (mlx-audio, Apple Silicon) or auto.")
        if quant.upper() not in _QUANTS:
            raise ConfigError(f"tts.quant={quant!r}: the GGML weights come as {', '.join(_QUANTS)}.")
        if not 1 <= chunk_frames <= 25:
            raise ConfigError(f"tts.chunk_frames={chunk_frames}: give 1 to 25 codec frames (80 ms each) "
                              "per streamed packet; 4 = 0.32 s.")
        if local_dir(model) is None and "/" not in model:
            raise ConfigError(f"tts.model={model!r}: give a hub id like Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice "
                              "or a local directory with the model's files.")
        if not speaker.strip():
            raise ConfigError("tts.speaker is empty: name a CustomVoice speaker, e.g. tts.speaker=Ryan.")
        self.model, self.speaker, self.language, self.instruct = model_path(model), speaker, language, instruct
        self.quant, self.chunk_frames = quant.upper(), chunk_frames
        self.backend = backend
        if backend == "auto":
            apple = sys.platform == "darwin" and platform.machine() == "arm64"
            self.backend = "mlx" if apple else "ggml"
        self._engine: Any = None

    @property
    def native_rate(self) -> int:
        return 24000

    def setup(self) -> None:
        if self.backend == "mlx":
            self._engine = self._load_mlx()
        else:
            self._engine = self._load_ggml()
        self.ctx.progress("warming up Qwen3-TTS")
        self.warm_up()

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        if self.backend == "mlx":
            for result in self._engine.generate(
                text=sentence, voice=self.speaker, instruct=self.instruct, lang_code=self.language,
                stream=True, streaming_interval=self.chunk_frames * _FRAME_S,
            ):
                yield np.asarray(result.audio, dtype=np.float32)
            return
        for pcm, _rate, _timing in self._engine.generate_custom_voice_streaming(
            text=sentence, speaker=self.speaker, language=self.language, instruct=self.instruct,
            chunk_size=self.chunk_frames,
        ):
            yield np.asarray(pcm, dtype=np.float32)

    # -- loading ------------------------------------------------------------------------

    def _load_ggml(self) -> Any:
        ensure_installed("faster_qwen3_tts", "qwentts_cpp", extra="qwen3-tts")
        qt = require("qwentts_cpp", "qwen3-tts")  # light (ctypes); faster_qwen3_tts imports torch
        talker, codec = self._gguf_files(qt)
        fq = require("faster_qwen3_tts", "qwen3-tts")
        self.ctx.progress(f"loading Qwen3-TTS ({talker.name}) on qwentts.cpp")
        engine = fq.FasterQwen3TTS.from_pretrained(
            self.model, backend="ggml", gguf_talker_path=talker, gguf_codec_path=codec,
        )
        self.speaker = self._known_speaker(engine.get_supported_speakers())
        return engine

    def _gguf_files(self, qt: Any) -> tuple[Path, Path]:
        """Talker and codec GGUFs: from a local directory, the hub cache, or a download if reachable."""
        local = local_dir(self.model)
        if local is not None:
            def pick(kind: str) -> list[Path]:
                exact = sorted(local.glob(f"*{kind}*{self.quant}.gguf"))
                return exact or sorted(local.glob(f"*{kind}*.gguf"))

            talkers, codecs = pick("talker"), pick("tokenizer")
            if not talkers or not codecs:
                raise ConfigError(f"tts.model={self.model!r} holds no qwentts.cpp GGUF pair "
                                  "(qwen-talker-*.gguf and qwen-tokenizer-12hz-*.gguf).")
            return talkers[0], codecs[0]
        try:
            return load_offline_first(
                self.model, "tts=qwen3 ggml",
                lambda local_only: qt.resolve_gguf_paths(self.model, quant=self.quant, local_files_only=local_only),
                hint=f"its GGUF files live in the hub repo {qt.GGUF_REPO} (the option is tts.model)",
                progress=self.ctx.progress,
            )
        except ValueError as exc:  # a model id the GGML runtime has no weights for
            raise ConfigError(f"tts.model={self.model!r}: {exc}") from exc

    def _load_mlx(self) -> Any:
        ensure_installed("mlx_audio", "huggingface_hub", extra="qwen3-tts")
        repo = self.model
        if local_dir(repo) is None and repo.startswith("Qwen/"):  # the MLX conversions live under mlx-community
            repo = f"mlx-community/{repo.split('/', 1)[1]}-bf16"
        path = hub_snapshot(repo, "tts=qwen3 mlx", hint="the option is tts.model", progress=self.ctx.progress)
        self.ctx.progress(f"loading Qwen3-TTS from {path} on MLX")
        mlx_tts = require("mlx_audio.tts.utils", "qwen3-tts")
        engine = mlx_tts.load_model(path)
        speakers = engine.get_supported_speakers() if hasattr(engine, "get_supported_speakers") else []
        self.speaker = self._known_speaker(speakers)
        return engine

    def _known_speaker(self, speakers: list[str]) -> str:
        """The runtime's own spelling of ``speaker`` (lists differ in case), or a clear error."""
        if not speakers:
            return self.speaker
        by_lower = {s.lower(): s for s in speakers}
        if self.speaker.lower() not in by_lower:
            raise ConfigError(f"tts.speaker={self.speaker!r} is not a voice of {self.model}; "
                              f"choose one of: {', '.join(sorted(speakers))}.")
        return by_lower[self.speaker.lower()]
