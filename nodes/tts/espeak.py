"""espeak-ng through the shared library of the ``espeakng-loader`` wheel (ctypes; no apt, no subprocess).

Formant synthesis: robotic but tiny, instant and fully offline. libespeak-ng keeps global
state and is not thread-safe, so one process-wide engine is initialised once and every
call into it holds :data:`_LOCK`.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from nodes.tts._base import SentenceTTS
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

__all__ = ["EspeakTTS", "espeak_synthesize"]

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000  # without it, a failed initialisation calls exit(1)
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_ENDPAUSE = 0x1000
_PARAM_RATE, _PARAM_PITCH = 1, 3
_EE_OK = 0

_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)

_LOCK = threading.Lock()
_ENGINE: _Espeak | None = None


class _Espeak:
    """The process-wide libespeak-ng instance. Use only while holding ``_LOCK``."""

    def __init__(self) -> None:
        loader = require("espeakng_loader", "espeak")
        lib = ctypes.CDLL(loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 100, loader.get_data_path().encode(), _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise RuntimeError(f"espeak-ng failed to initialise with data at {loader.get_data_path()}")
        self.lib, self.rate = lib, rate
        self._pieces: list[np.ndarray] = []
        self._callback = _SYNTH_CALLBACK(self._on_audio)  # kept alive as long as the engine
        lib.espeak_SetSynthCallback(self._callback)
        self._settings: tuple[str, int, int] | None = None

    def _on_audio(self, wav: ctypes._Pointer, n: int, _events: int) -> int:
        if wav and n > 0:
            self._pieces.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0  # 0 = go on

    def configure(self, voice: str, rate: int, pitch: int) -> bool:
        """Select voice and prosody; False when espeak-ng has no such voice."""
        if self._settings != (voice, rate, pitch):
            self._settings = None
            if self.lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
                return False
            self.lib.espeak_SetParameter(_PARAM_RATE, rate, 0)
            self.lib.espeak_SetParameter(_PARAM_PITCH, pitch, 0)
            self._settings = (voice, rate, pitch)
        return True

    def synth(self, text: str) -> np.ndarray:
        data = text.encode("utf-8") + b"\0"
        self._pieces = []
        flags = _CHARS_UTF8 | _ENDPAUSE
        err = self.lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, flags, None, None)
        if err != _EE_OK:
            raise RuntimeError(f"espeak_Synth failed with status {err}")
        pcm = np.concatenate(self._pieces) if self._pieces else np.zeros(0, dtype=np.int16)
        self._pieces = []
        return pcm


def _engine() -> _Espeak:
    global _ENGINE
    with _LOCK:
        if _ENGINE is None:
            _ENGINE = _Espeak()
        return _ENGINE


def espeak_has_voice(voice: str) -> bool:
    """Whether espeak-ng has a voice of that name (a language, or a voice with a +variant)."""
    engine = _engine()
    with _LOCK:
        return engine.configure(voice, 175, 50)


def espeak_synthesize(
    text: str, *, voice: str = "en-us", rate: int = 175, pitch: int = 50
) -> tuple[np.ndarray, int]:
    """Speak ``text`` with espeak-ng: (int16 PCM, sample rate). Thread-safe."""
    engine = _engine()
    with _LOCK:
        if not engine.configure(voice, rate, pitch):
            raise ConfigError(
                f"tts.voice={voice!r}: espeak-ng has no such voice. Use a language or voice name "
                "from espeak-ng-data, e.g. tts.voice=en-us, en (British), fr, de, es or en-us+f3."
            )
        return engine.synth(text), engine.rate


class EspeakTTS(SentenceTTS):
    """espeak-ng: formant speech at 22.05 kHz, sub-millisecond per word, no model files."""

    shared_safety = "locked: libespeak-ng has global state; one engine per process, every call holds _LOCK"

    def __init__(self, *, voice: str = "en-us", rate: int = 175, pitch: int = 50,
                 **options: Any) -> None:
        super().__init__(**options)
        if not 80 <= rate <= 450:
            raise ConfigError(f"tts.rate={rate}: espeak-ng speaks 80 to 450 words per minute; "
                              "pick one in that range (default 175).")
        if not 0 <= pitch <= 100:
            raise ConfigError(f"tts.pitch={pitch}: espeak-ng pitch runs from 0 to 100 (default 50).")
        if not voice.strip():
            raise ConfigError("tts.voice is empty: name an espeak-ng voice, e.g. tts.voice=en-us.")
        self.voice, self.rate, self.pitch = voice, rate, pitch
        self._rate = 22050

    def inference_key(self) -> str:
        return "espeak-ng"  # one engine per process, one call at a time

    @property
    def native_rate(self) -> int:
        return self._rate

    def setup(self) -> None:
        self.ctx.progress("loading espeak-ng")
        _, self._rate = espeak_synthesize("Hello.", voice=self.voice, rate=self.rate, pitch=self.pitch)

    def use_voice(self, name: str) -> bool:
        """Any voice espeak-ng has (tts.voice's names: en-us, en, fr, en-us+f3, ...)."""
        if name != self.voice and not (name.strip() and espeak_has_voice(name)):
            return False
        self.voice = name
        return True

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        # espeak renders a sentence in a few milliseconds: one piece, chunked by the base class.
        pcm, self._rate = espeak_synthesize(sentence, voice=self.voice, rate=self.rate, pitch=self.pitch)
        yield pcm
