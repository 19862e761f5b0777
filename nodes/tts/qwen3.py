"""Qwen3-TTS CustomVoice (the reference's default voice), 24 kHz, streamed in codec packets of
``chunk_frames`` x 80 ms. It needs a GPU: on Apple Silicon ``mlx-audio``, on Linux with an
NVIDIA GPU ``faster-qwen3-tts`` on CUDA (its CUDA-graph backend). Its GGML backend
(qwentts.cpp) needs ``qwentts-cpp-python``, which PyPI ships for Apple Silicon only.
The engine is loaded and warmed up once per process; the sessions take turns on it, a sentence
at a time."""

from __future__ import annotations

import importlib.util
import platform
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nodes._hub import ensure_installed, hub_snapshot, load_offline_first, local_dir, model_path
from nodes.tts._base import SentenceTTS
from s2s_flow.errors import ConfigError, MissingDependency
from s2s_flow.node import require

__all__ = ["Qwen3TTS", "PLATFORMS", "SharedEngine"]

_BACKENDS = ("auto", "cuda", "mlx", "ggml")
_QUANTS = ("BF16", "F32", "Q8_0", "Q4_K_M")
_FRAME_S = 0.08  # one 12.5 Hz codec frame
PLATFORMS = ("tts=qwen3 runs on Apple Silicon (tts.backend=mlx, mlx-audio) and on Linux with an NVIDIA "
             "GPU (tts.backend=cuda, faster-qwen3-tts); it has no CPU backend. Elsewhere choose tts=piper, "
             "tts=kokoro or tts=openai.")
#: held by a sentence's synthesis from its first packet to its last: one at a time in the process
_SYNTHESIZING = threading.Lock()


def _apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


class SharedEngine:
    """The engine every session of the process speaks with, and the speakers it knows (each
    session checks its own against them); a holder, as some engines cannot be weakly referenced."""

    def __init__(self, engine: Any, speakers: list[str] | None) -> None:
        self.engine, self.speakers = engine, list(speakers or [])


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
        **options: Any,  # SentenceTTS's: sample_rate, first_clause_words, ... (conf/tts/*.yaml)
    ) -> None:
        super().__init__(**options)
        if backend not in _BACKENDS:
            raise ConfigError(f"tts.backend={backend!r}: choose cuda (faster-qwen3-tts, NVIDIA GPU), mlx "
                              "(mlx-audio, Apple Silicon), ggml (qwentts.cpp) or auto (mlx on Apple Silicon, "
                              "else cuda).")
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
            self.backend = "mlx" if _apple_silicon() else "cuda"
        self._shared: SharedEngine | None = None

    @property
    def native_rate(self) -> int:
        return 24000

    # Speaker, language and instruct go with each call; the lock is held from a sentence's first
    # packet to its last, as the engine keeps the stream's state between packets.
    shared_safety = ("locked: one sentence at a time in the process: the engines keep state of their own "
                     "while they stream (CUDA graphs and static caches, qwentts.cpp's context, MLX streams)")

    # Not scheduled (no inference_key()): the engines keep state across a sentence's stream, so
    # _SYNTHESIZING is held from its first chunk to its last and the sessions take whole sentences
    # in turn; the scheduler hands out slots per chunk, which would wait on that lock.

    def shared_key(self) -> tuple:
        return (self.backend, self.model, self.quant)

    def load_shared(self) -> SharedEngine:
        load = {"cuda": self._load_cuda, "mlx": self._load_mlx, "ggml": self._load_ggml}[self.backend]
        shared = load()
        self.ctx.progress("warming up Qwen3-TTS")
        # with this session's speaker if the engine knows it: setup() tells each session if not
        speaker = next((s for s in shared.speakers if s.lower() == self.speaker.lower()),
                       shared.speakers[0] if shared.speakers else self.speaker)
        with _SYNTHESIZING:
            for _ in self._stream(shared.engine, "Hello.", speaker):
                pass
        return shared

    def setup(self) -> None:
        self._shared = self.shared()
        self.speaker = self._known_speaker(self._shared.speakers)

    @property
    def voice_name(self) -> str:
        return self.speaker

    def use_voice(self, name: str) -> bool:
        """Any preset speaker of the loaded engine."""
        known = next((s for s in (self._shared.speakers if self._shared else []) if s.lower() == name.lower()), None)
        if known is None:
            return name == self.speaker
        self.speaker = known
        return True

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        assert self._shared is not None, "setup() first"
        with _SYNTHESIZING:
            yield from self._stream(self._shared.engine, sentence, self.speaker)

    def _stream(self, engine: Any, sentence: str, speaker: str) -> Iterator[np.ndarray]:
        if self.backend == "mlx":
            for result in engine.generate(
                text=sentence, voice=speaker, instruct=self.instruct, lang_code=self.language,
                stream=True, streaming_interval=self.chunk_frames * _FRAME_S,
            ):
                yield np.asarray(result.audio, dtype=np.float32)
            return
        for pcm, _rate, _timing in engine.generate_custom_voice_streaming(
            text=sentence, speaker=speaker, language=self.language, instruct=self.instruct,
            chunk_size=self.chunk_frames,
        ):
            yield np.asarray(pcm, dtype=np.float32)

    def close(self) -> None:
        self._shared = None

    # -- loading ------------------------------------------------------------------------

    def _load_cuda(self) -> SharedEngine:
        if not sys.platform.startswith("linux"):
            raise ConfigError(f"tts.backend=cuda is for Linux. {PLATFORMS}")
        ensure_installed("faster_qwen3_tts", "torch", extra="qwen3-tts")
        path = hub_snapshot(self.model, "tts=qwen3 cuda", hint="the option is tts.model",
                            progress=self.ctx.progress)  # before the multi-second torch import
        torch = require("torch", "qwen3-tts")
        if not torch.cuda.is_available():
            raise ConfigError(f"tts.backend=cuda, but torch sees no CUDA GPU here. {PLATFORMS}")
        fq = require("faster_qwen3_tts", "qwen3-tts")
        self.ctx.progress(f"loading Qwen3-TTS from {path} on CUDA")
        engine = fq.FasterQwen3TTS.from_pretrained(str(path), device="cuda", dtype=torch.bfloat16)
        return SharedEngine(engine, engine.model.get_supported_speakers())

    def _load_ggml(self) -> SharedEngine:
        if importlib.util.find_spec("qwentts_cpp") is None and not _apple_silicon():
            raise ConfigError(
                "tts.backend=ggml needs qwentts.cpp's Python runtime (qwentts-cpp-python), which PyPI ships "
                f"for macOS on Apple Silicon only; build it from source, or choose another backend. {PLATFORMS}")
        for module in ("qwentts_cpp", "faster_qwen3_tts"):
            if importlib.util.find_spec(module) is None:
                raise MissingDependency(module, "qwen3-tts", command="pip install 'faster-qwen3-tts[ggml]'")
        qt = require("qwentts_cpp", "qwen3-tts")  # light (ctypes); faster_qwen3_tts imports torch
        talker, codec = self._gguf_files(qt)
        fq = require("faster_qwen3_tts", "qwen3-tts")
        self.ctx.progress(f"loading Qwen3-TTS ({talker.name}) on qwentts.cpp")
        engine = fq.FasterQwen3TTS.from_pretrained(
            self.model, backend="ggml", gguf_talker_path=talker, gguf_codec_path=codec,
        )
        return SharedEngine(engine, engine.get_supported_speakers())

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

    def _load_mlx(self) -> SharedEngine:
        if not _apple_silicon():
            raise ConfigError(f"tts.backend=mlx is for Apple Silicon. {PLATFORMS}")
        ensure_installed("mlx_audio", "huggingface_hub", extra="qwen3-tts")
        repo = self.model
        if local_dir(repo) is None and repo.startswith("Qwen/"):  # the MLX conversions live under mlx-community
            repo = f"mlx-community/{repo.split('/', 1)[1]}-bf16"
        path = hub_snapshot(repo, "tts=qwen3 mlx", hint="the option is tts.model", progress=self.ctx.progress)
        self.ctx.progress(f"loading Qwen3-TTS from {path} on MLX")
        mlx_tts = require("mlx_audio.tts.utils", "qwen3-tts")
        engine = mlx_tts.load_model(path)
        speakers = engine.get_supported_speakers() if hasattr(engine, "get_supported_speakers") else []
        return SharedEngine(engine, speakers)

    def _known_speaker(self, speakers: list[str]) -> str:
        """The runtime's own spelling of ``speaker`` (lists differ in case), or a clear error."""
        if not speakers:
            return self.speaker
        by_lower = {s.lower(): s for s in speakers}
        if self.speaker.lower() not in by_lower:
            raise ConfigError(f"tts.speaker={self.speaker!r} is not a voice of {self.model}; "
                              f"choose one of: {', '.join(sorted(speakers))}.")
        return by_lower[self.speaker.lower()]
