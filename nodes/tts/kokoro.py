"""Kokoro-82M (StyleTTS2-like, 24 kHz) through the ``kokoro`` package's KPipeline: the
reference's CPU choice. Weights come from the hub (hexgrad/Kokoro-82M) or a local directory.
The pipeline (model and G2P) is loaded and warmed up once per process; the sessions take turns
on it, one phoneme chunk at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nodes._hub import ensure_installed, hub_file, local_dir, model_path, reachable
from nodes.tts._base import SentenceTTS, in_turn
from s2s_flow.errors import ConfigError, ModelNotAvailable
from s2s_flow.node import require

__all__ = ["KokoroTTS"]

_LANG_CODES = "abefhijpz"  # US/UK English, es, fr, hi, it, ja, pt-br, zh (kokoro.pipeline.LANG_CODES)
_WEIGHTS = {"hexgrad/Kokoro-82M": "kokoro-v1_0.pth", "hexgrad/Kokoro-82M-v1.1-zh": "kokoro-v1_1-zh.pth"}
# misaki's English G2P loads this spaCy model and pip-installs it from GitHub when missing.
_SPACY_MODEL = "en_core_web_sm"
_SPACY_WHEEL = ("https://github.com/explosion/spacy-models/releases/download/"
                "en_core_web_sm-3.8.0/en_core_web_sm-3.8.0-py3-none-any.whl")
#: held while a pipeline makes one chunk (G2P, then the model): one at a time in the process
_SYNTHESIZING = threading.Lock()


class KokoroTTS(SentenceTTS):
    """Kokoro-82M: near-neural-quality speech from an 82M model, real time on a laptop CPU."""

    def __init__(
        self,
        *,
        model: str = "hexgrad/Kokoro-82M",
        voice: str = "af_heart",
        lang_code: str = "a",
        speed: float = 1.0,
        device: str = "cpu",
        **options: Any,  # SentenceTTS's: sample_rate, first_clause_words, ... (conf/tts/*.yaml)
    ) -> None:
        super().__init__(**options)
        if lang_code not in _LANG_CODES or len(lang_code) != 1:
            raise ConfigError(f"tts.lang_code={lang_code!r}: Kokoro knows a (US English), b (UK English), "
                              "e, f, h, i, j, p, z; a voice's first letter names its language (af_heart: a).")
        if not 0.25 <= speed <= 4.0:
            raise ConfigError(f"tts.speed={speed}: give a speaking-rate factor from 0.25 to 4 (1 = normal).")
        if local_dir(model) is None and model not in _WEIGHTS:
            raise ConfigError(f"tts.model={model!r} is neither a local Kokoro directory (config.json, "
                              f"*.pth, voices/) nor a known hub model ({', '.join(_WEIGHTS)}).")
        if not voice.strip():
            raise ConfigError("tts.voice is empty: name a Kokoro voice, e.g. tts.voice=af_heart.")
        self.model, self.voice, self.lang_code = model_path(model), voice, lang_code
        self.speed, self.device = speed, device
        self._pipeline: Any = None
        self._voice_arg = ""

    @property
    def native_rate(self) -> int:
        return 24000

    # The voice, the speed and the sentence go with each call; the pipeline caches the voice
    # packs it has read (a dict, filled under the lock).
    shared_safety = ("locked: one chunk at a time in the process: KPipeline's G2P (misaki, spaCy, an espeak-ng "
                     "fallback) and its voice cache are not known to be thread-safe")

    def shared_key(self) -> tuple:
        return (self.model, self.lang_code, self.device)

    def inference_key(self) -> str:
        return f"kokoro:{self.model}:{self.device}"  # one chunk at a time: the default single slot

    def load_shared(self) -> Any:
        # everything it needs from here: a server preloads the pipeline without a setup()
        config, weights, voices = self._files()
        if self.lang_code in "ab":
            self._check_spacy_model()
        self._voice_arg = ",".join(str(v) for v in voices)
        self.ctx.progress("importing kokoro")
        kokoro = require("kokoro", "kokoro")
        self.ctx.progress(f"loading Kokoro from {weights.parent}")
        kmodel = kokoro.KModel(repo_id=self._repo_id, config=str(config), model=str(weights))
        self._pipeline = kokoro.KPipeline(lang_code=self.lang_code, repo_id=self._repo_id,
                                          model=kmodel.to(self.device).eval())
        self.ctx.progress("warming up Kokoro")
        self.warm_up()  # with this session's voice; another voice is read at its first sentence
        return self._pipeline

    def setup(self) -> None:
        ensure_installed("kokoro", "huggingface_hub", extra="kokoro")
        _, _, voices = self._files()  # first: a missing model or voice is reported in a second
        self._voice_arg = ",".join(str(v) for v in voices)
        self._pipeline = self.shared()

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        # split_pattern=None: the sentence is already one segment; Kokoro yields per phoneme chunk.
        results = self._pipeline(sentence, voice=self._voice_arg, speed=self.speed, split_pattern=None)
        for result in in_turn(results, _SYNTHESIZING):
            if result.audio is not None:
                yield result.audio.detach().cpu().numpy().astype(np.float32)

    def close(self) -> None:
        self._pipeline = None

    @property
    def _repo_id(self) -> str:
        return self.model if self.model in _WEIGHTS else "hexgrad/Kokoro-82M"

    def _files(self) -> tuple[Path, Path, list[Path]]:
        """config.json, weights and voice packs (``a,b`` blends voices), local or from the hub."""
        names = [v.strip() for v in self.voice.split(",") if v.strip()]
        local = local_dir(self.model)
        if local is not None:
            weights = next(iter(sorted(local.glob("*.pth"))), None)
            voices = [Path(v) if v.endswith(".pt") else local / "voices" / f"{v}.pt" for v in names]
            missing = [p for p in [local / "config.json", weights, *voices] if p is None or not p.is_file()]
            if missing:
                raise ConfigError(f"tts.model={self.model!r}: missing {', '.join(map(str, missing))} "
                                  "(a Kokoro directory holds config.json, one .pth and voices/<voice>.pt).")
            return local / "config.json", weights, voices  # type: ignore[return-value]

        def fetch(name: str) -> Path:
            return hub_file(self.model, name, backend="tts=kokoro", hint="the option is tts.model")

        voices = [Path(v) if v.endswith(".pt") else fetch(f"voices/{v}.pt") for v in names]
        return fetch("config.json"), fetch(_WEIGHTS[self.model]), voices

    @staticmethod
    def _check_spacy_model() -> None:
        """Fail now, with the install command, where misaki would try to pip-install from GitHub."""
        spacy = require("spacy", "kokoro")
        if not spacy.util.is_package(_SPACY_MODEL) and not reachable("https://github.com"):
            raise ModelNotAvailable(
                _SPACY_MODEL, "tts=kokoro: misaki's English G2P loads this spaCy model",
                "or choose a non-English tts.lang_code (only a and b need it)",
                download=f"pip install {_SPACY_WHEEL}",
            )
