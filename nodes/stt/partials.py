"""Live partial transcripts: the growing utterance re-transcribed while the user speaks.

A node beside the chain (wired by explicit edges in conf/io/mic.yaml): it keeps the last
seconds of microphone audio, and between the VAD's ``SpeechStarted`` and its ``Speech``
it transcribes the utterance so far every ``interval_ms`` with its own instance of the
chosen stt backend, emitting ``Transcript(final=False)`` for display. The interval counts
from the end of the previous transcription, so a slow STT is skipped over, never queued.
The final transcript still comes from the stt stage; the LLM ignores partial ones.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from s2s_flow.audio import resample
from s2s_flow.errors import ConfigError
from s2s_flow.graph import load_class
from s2s_flow.inference import Shed
from s2s_flow.messages import AudioChunk, Message, Speech, SpeechStarted, Transcript
from s2s_flow.node import Context, Node

__all__ = ["PartialTranscriber"]

PREROLL_S = 2.0  # audio kept before speech is confirmed (the VAD confirms a few hundred ms late)


class PartialTranscriber(Node):
    """Transcript(final=False) of the utterance so far, every ``interval_ms`` while the user speaks."""

    inputs = {"audio": AudioChunk, "started": SpeechStarted, "speech": Speech}
    outputs = {"text": Transcript}

    def __init__(self, *, stt: Mapping[str, Any] | None = None, interval_ms: int = 0,
                 max_window_s: float = 15.0) -> None:
        if interval_ms < 0 or 0 < interval_ms < 100:
            raise ConfigError(f"io.partials.interval_ms={interval_ms}: use 0 (off) or at least 100 ms "
                              "(each partial transcribes the whole utterance so far)")
        if max_window_s <= 1:
            raise ConfigError(f"nodes.partials.max_window_s={max_window_s} must be above 1 s")
        self.interval_s, self.max_window_s = interval_ms / 1000, max_window_s
        self._stt: Any = None
        if interval_ms:
            target = (stt or {}).get("_target_")
            if not target:
                raise ConfigError("io.partials.interval_ms > 0 needs an stt backend to transcribe with, and "
                                  "stt=none has none: choose one (e.g. stt=whisper) or set io.partials.interval_ms=0")
            cls = load_class(str(target), "stt")
            if not callable(getattr(cls, "transcribe", None)):
                raise ConfigError(f"io.partials: the stt backend {cls.__name__} has no transcribe(audio) method; "
                                  "choose stt=whisper (or another utterance STT) or set io.partials.interval_ms=0")
            self._stt = cls(**{k: v for k, v in stt.items() if not str(k).startswith("_")})  # type: ignore[union-attr]
        self._chunks: deque[AudioChunk] = deque()
        self._turn: int | None = None  # the utterance being transcribed
        self._start = 0.0
        self._due = 0.0
        self._last = ""

    def setup(self) -> None:
        if self._stt is None:
            return
        ctx = self.ctx
        self._stt.ctx = Context(f"{ctx.name}.stt", ctx.run_dir, stopping=ctx.stopping, progress=ctx.progress,
                                run_state=ctx.run_state)  # the session's: its schedulers' side too
        self._stt.setup()

    def process(self, port: str, msg: Message) -> Iterator[Transcript]:
        if self._stt is None:
            return
        if isinstance(msg, AudioChunk):
            self._keep(msg)
            if self._turn is not None and time.monotonic() >= self._due:
                yield from self._partial()
        elif isinstance(msg, SpeechStarted):
            self._turn, self._start, self._last = msg.turn, msg.start, ""
            self._due = time.monotonic() + self.interval_s
        elif isinstance(msg, Speech) and msg.turn == self._turn:
            self._turn = None  # the stt stage makes the final transcript

    def _keep(self, chunk: AudioChunk) -> None:
        self._chunks.append(chunk)
        end = chunk.start + chunk.duration
        keep_from = end - (self.max_window_s if self._turn is not None else PREROLL_S)
        while self._chunks and self._chunks[0].start + self._chunks[0].duration < keep_from:
            self._chunks.popleft()

    def _partial(self) -> Iterator[Transcript]:
        turn, rate = self._turn, self._chunks[-1].rate
        chunks = [c for c in self._chunks if c.start + c.duration > self._start]
        if turn is None or not chunks:
            return
        skip = max(0, round((self._start - chunks[0].start) * rate))  # the speech starts inside the first
        pcm = np.concatenate([c.pcm for c in chunks])[skip:]
        audio = resample(pcm, rate, getattr(self._stt, "input_rate", rate))
        try:  # in a slot of the shared model, after every confirmed turn's work
            with self._stt.inference_slot("partial", turn=turn):
                text, language = self._stt.transcribe(audio)
        except Shed:  # under load: this partial is skipped
            text, language = self._last, None
        self._due = time.monotonic() + self.interval_s  # from the end: a busy STT is skipped, not queued
        if text and text != self._last:
            self._last = text
            yield Transcript(turn=turn, text=text, language=language, final=False)

    def close(self) -> None:
        if self._stt is not None:
            self._stt.close()
