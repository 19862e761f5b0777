"""NVIDIA Parakeet-TDT: NeMo on Linux/CUDA, parakeet-mlx on Apple Silicon.

Parakeet-TDT 0.6b v3 transcribes 25 European languages and detects the language itself;
the MLX port (``mlx-community/parakeet-tdt-0.6b-v3``) runs on Apple GPUs (and, slowly,
on mlx[cpu] elsewhere). The model is loaded and warmed up once per process; the sessions take
turns transcribing on it.
"""

from __future__ import annotations

import platform
import re
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nodes._hub import (
    check_available,
    ensure_installed,
    hf_offline,
    hub_file,
    hub_snapshot,
    model_path,
)
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

from ._base import UtteranceSTT

__all__ = ["ParakeetSTT"]

NEMO_MODEL = "nvidia/parakeet-tdt-0.6b-v3"
MLX_MODEL = "mlx-community/parakeet-tdt-0.6b-v3"
_BACKENDS = ("auto", "nemo", "mlx")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
#: held by a transcription: one at a time in the process
_TRANSCRIBING = threading.Lock()


def _apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


class ParakeetSTT(UtteranceSTT):
    """Transcribes each utterance with Parakeet-TDT (greedy TDT decoding)."""

    def __init__(
        self,
        *,
        model: str = NEMO_MODEL,
        backend: str = "auto",
        device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        if backend not in _BACKENDS:
            raise ConfigError(f"stt.backend={backend!r} is unknown: use auto (mlx on Apple Silicon, nemo "
                              "elsewhere), nemo or mlx.")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ConfigError(f"stt.device={device!r} is unknown: use auto, cpu, cuda or cuda:N "
                              "(stt.backend=mlx always runs on the MLX default device).")
        if dtype not in _DTYPES:
            raise ConfigError(f"stt.dtype={dtype!r} is unknown: use one of {', '.join(_DTYPES)}.")
        if not model:
            raise ConfigError(f"stt.model is empty: use {NEMO_MODEL} (NeMo), {MLX_MODEL} (MLX) or a local "
                              "path (.nemo file, or an MLX directory with config.json + model.safetensors).")
        self.backend = ("mlx" if _apple_silicon() else "nemo") if backend == "auto" else backend
        # the default names the NeMo checkpoint; MLX reads its own conversion of the same model
        self.model = MLX_MODEL if self.backend == "mlx" and model == NEMO_MODEL else model_path(model)
        self.device = device
        self.dtype = dtype
        self._asr = None

    # NeMo's transcribe() switches the model's settings (dither, padding, eval mode) for the length
    # of a call and restores them after; parakeet-mlx runs on MLX streams.
    shared_safety = ("locked: one transcription at a time in the process: NeMo's transcribe() changes the "
                     "model's settings for the call, and MLX's streams are not known to be safe across threads")

    def shared_key(self) -> tuple:
        return (self.backend, self.model, self.device, self.dtype)

    def inference_key(self) -> str:
        return f"parakeet:{self.model}:{self.backend}:{self.device}"  # one at a time (_TRANSCRIBING)

    def load_shared(self) -> Callable[[np.ndarray], str]:
        """The transcribing function (a closure over the model), warmed up."""
        self.ctx.progress(f"loading {self.model} ({self.backend})")
        asr = self._load_mlx() if self.backend == "mlx" else self._load_nemo()
        self.ctx.progress("warming up Parakeet")
        with _TRANSCRIBING:
            asr(np.zeros(self.input_rate // 2, np.float32))
        return asr

    def setup(self) -> None:
        if self.backend == "mlx":
            ensure_installed("mlx", "parakeet_mlx", extra="parakeet")
        else:
            ensure_installed("torch", "nemo", extra="parakeet")
        marker = "config.json" if self.backend == "mlx" else f"{self.model.rsplit('/', 1)[-1]}.nemo"
        check_available(self.model, f"stt=parakeet, {self.backend}", marker=marker)
        self._asr = self.shared()

    # -- MLX (Apple Silicon) -------------------------------------------------------------

    def _load_mlx(self) -> Callable[[np.ndarray], str]:
        parakeet_mlx = require("parakeet_mlx", "parakeet")
        mx = require("mlx.core", "parakeet")
        from parakeet_mlx.audio import get_logmel

        path = hub_snapshot(self.model, "stt=parakeet, mlx", allow_patterns=["config.json", "model.safetensors"])
        gpu = mx.metal.is_available() if hasattr(mx, "metal") else False
        dtype = getattr(mx, self.dtype) if self.dtype != "auto" else mx.bfloat16 if gpu else mx.float32
        with hf_offline():  # from_pretrained tries the hub before the path
            model = parakeet_mlx.from_pretrained(str(path), dtype=dtype)

        def transcribe(audio: np.ndarray) -> str:
            mel = get_logmel(mx.array(audio, dtype=dtype), model.preprocessor_config)
            return model.generate(mel)[0].text

        return transcribe

    # -- NeMo (Linux, CUDA) --------------------------------------------------------------

    def _load_nemo(self) -> Callable[[np.ndarray], str]:
        torch = require("torch", "parakeet")
        nemo_asr = require("nemo.collections.asr", "parakeet")
        device = self.device if self.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        model = nemo_asr.models.ASRModel.restore_from(str(self._nemo_file()), map_location=device)
        model.eval()
        if self.dtype not in ("auto", "float32"):
            model = model.to(getattr(torch, self.dtype))

        def transcribe(audio: np.ndarray) -> str:
            with torch.inference_mode():
                out = model.transcribe([audio], batch_size=1, verbose=False)
            if isinstance(out, tuple):  # NeMo < 2: (best hypotheses, all hypotheses)
                out = out[0]
            first = out[0]
            return first.text if hasattr(first, "text") else str(first)

        return transcribe

    def _nemo_file(self) -> Path:
        """The .nemo checkpoint: given, inside a given directory, cached, or downloaded."""
        given = Path(self.model).expanduser()
        if given.is_file():
            return given
        if given.is_dir():
            found = sorted(given.glob("*.nemo"))
            if not found:
                raise ConfigError(
                    f"stt.model={self.model!r} is a directory without a .nemo file: point it at the .nemo "
                    "checkpoint (stt.backend=nemo), or use stt.backend=mlx for an MLX directory."
                )
            return found[0]
        filename = f"{self.model.rsplit('/', 1)[-1]}.nemo"
        return hub_file(self.model, filename, backend="stt=parakeet, nemo")

    def transcribe(self, audio: np.ndarray) -> tuple[str, str | None]:
        with _TRANSCRIBING:
            text = self._asr(audio)
        return text.strip(), None  # v3 detects the language but does not report it

    def close(self) -> None:
        self._asr = None
