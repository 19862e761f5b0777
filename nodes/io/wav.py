"""File I/O: a WAV (any libsndfile format) source and a sink writing replies + transcript.

The source plays one file, a list, or a directory as a batch of conversations (one
session each), resampled with libsoxr and mixed to mono, optionally paced in real time
so latency runs behave like a live microphone. The sink writes each reply as a WAV and
one ``transcript.jsonl`` row per turn, flushed per turn, so a stopped run keeps
everything already produced.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nodes.io._transcript import TranscriptFile, TurnText, check_output_dir
from s2s_flow import corpus as bench_corpus
from s2s_flow.audio import resample, to_mono
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, AudioOut, Message, TextDelta, Transcript
from s2s_flow.node import Context, Node

SAMPLES = Path(__file__).parent / "samples"  # bundled spoken questions: the default input
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".aiff", ".aif", ".mp3", ".au", ".caf", ".w64", ".opus"}


def _input_files(spec: str | list[str] | None, where: str) -> list[Path]:
    paths = [str(SAMPLES)] if spec is None else [spec] if isinstance(spec, str) else list(spec)
    if not paths or paths == [""]:
        raise ConfigError(f"{where}: no input given; set io.input=PATH (a WAV file, a list, or a directory)")
    files: list[Path] = []
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in AUDIO_SUFFIXES)
            if not found:
                raise ConfigError(f"{where}: directory {p} has no audio files ({', '.join(sorted(AUDIO_SUFFIXES))})")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"{where}: input file {p} does not exist; set io.input=PATH to an existing file")
    for f in files:
        stat = f.stat()
        problem = _audio_problem(str(f), stat.st_mtime_ns, stat.st_size)
        if problem:
            raise ConfigError(f"{where}: {f} {problem}")
    return files


@functools.lru_cache(maxsize=65536)
def _audio_problem(path: str, mtime_ns: int, size: int) -> str:
    """What makes a file unplayable ('' if nothing), read once per version of the file: every file
    of a batch is a session on a fresh instance of the graph, whose source checks its input again."""
    import soundfile as sf

    try:
        info = sf.info(path)
    except Exception as exc:
        return f"is not a readable audio file ({exc}); give a WAV/FLAC/OGG file libsndfile can read"
    return "is empty (0 audio frames); record or pick another file" if info.frames == 0 else ""


class WavSource(Node):
    """Plays audio files as microphone-like 20 ms chunks at the pipeline rate."""

    outputs = {"audio": AudioChunk}
    # A file can wait for a slow consumer; live audio would drop instead.
    port_rings = {"audio": (64, "block")}

    def __init__(self, *, input: str | list[str] | None = None, corpus: Mapping[str, Any] | None = None,
                 rate: int = 16000, chunk_ms: int = 20, realtime: bool = False, tail_silence_s: float = 1.0):
        """``corpus``: a ``bench`` block (conf/bench/latency.yaml) whose spoken prompts are played
        instead of ``input``; checked here, synthesized by its voice (once, then cached) in ``setup()``."""
        if rate not in (8000, 16000, 22050, 24000, 44100, 48000):
            raise ConfigError(f"io.rate={rate} is not a supported pipeline rate (16000 or 8000 for VAD)")
        if not 5 <= chunk_ms <= 200:
            raise ConfigError(f"io.chunk_ms={chunk_ms} must be between 5 and 200 ms")
        self.rate, self.chunk = rate, rate * chunk_ms // 1000
        self.realtime, self.tail_silence_s = realtime, tail_silence_s
        self._bench: dict[str, Any] | None = None
        self._voice: Node | None = None
        self.corpus_dir: Path | None = None  # the benchmark corpus played, once setup() found or made it
        self.files: list[Path] = []
        if corpus is None:
            self.files = _input_files(input, "io.input")
        elif input is not None:
            raise ConfigError(f"io.input={input!r} and bench=latency both name the audio to play: drop "
                              "io.input to play the benchmark corpus, or drop bench=latency to play the files")
        else:
            self._bench = bench_corpus.check(corpus)
            voice, options = bench_corpus.voice(self._bench)
            self._voice = voice(**options)  # cheap, like every node's __init__; set up only to synthesize
        self._names = self._unique_names(self.files)

    def setup(self) -> None:
        if self._bench is not None:
            self.ctx.progress("benchmark corpus (synthesized on first use, then cached)")
            self.corpus_dir = bench_corpus.build(self._bench, self._speak)
            self.files = bench_corpus.files(self.corpus_dir, self._bench["repeat"])
            self._names = self._unique_names(self.files)

    def _speak(self, texts: Sequence[str]) -> Iterator[tuple[np.ndarray, int]]:
        """The corpus voice at work, each text as one reply; runs only when the corpus is not cached."""
        voice = self._voice
        assert voice is not None
        voice.ctx = Context(f"{self.ctx.name}.voice", self.ctx.run_dir, stopping=self.ctx.stopping,
                            progress=self.ctx.progress)
        try:
            voice.setup()
            for turn, text in enumerate(texts, 1):
                audio = [m for m in voice.process("text", TextDelta(turn=turn, text=text, end=True)) or ()
                         if isinstance(m, AudioOut) and len(m.pcm)]
                yield (np.concatenate([m.pcm for m in audio]), audio[0].rate) if audio else (np.zeros(0), 0)
        finally:
            voice.close()

    @staticmethod
    def _unique_names(files: list[Path]) -> list[str]:
        names: list[str] = []
        for f in files:
            name, n = f.stem, 2
            while name in names:
                name, n = f"{f.stem}_{n}", n + 1
            names.append(name)
        return names

    def port_rate(self, port: str) -> int | None:
        return self.rate

    def sessions(self) -> list[str]:
        return list(self._names)

    def read(self, path: Path) -> np.ndarray:
        """The whole file as float32 mono at the pipeline rate."""
        import soundfile as sf

        try:
            pcm, rate = sf.read(str(path), dtype="float32", always_2d=True)
        except Exception as exc:
            raise ConfigError(f"io.input: cannot decode {path} ({exc})") from None
        return resample(to_mono(pcm), rate, self.rate)

    def produce(self) -> Iterator[AudioChunk]:
        path = self.files[self._names.index(self.ctx.conversation)] if self.ctx.conversation else self.files[0]
        pcm = self.read(path)
        pcm = np.concatenate([pcm, np.zeros(int(self.tail_silence_s * self.rate), np.float32)])
        step = self.chunk / self.rate
        t0 = time.monotonic()
        self.ctx.record("playback", conversation=self.ctx.conversation)  # its stream's time 0, for the metrics
        for i, start in enumerate(range(0, len(pcm), self.chunk)):
            if self.realtime:
                delay = t0 + (i + 1) * step - time.monotonic()  # a chunk exists once fully "recorded"
                if delay > 0 and self.ctx.stopping.wait(delay):
                    return
            yield AudioChunk(pcm=pcm[start:start + self.chunk], rate=self.rate, start=start / self.rate)


@dataclass
class _Turn(TurnText):
    audio: list[np.ndarray] = field(default_factory=list)
    audio_done: bool = False
    interrupted: bool = False


class WavSink(Node):
    """Writes each reply to ``<conversation>/turn_NNN.wav`` and a row to ``transcript.jsonl``."""

    inputs = {"audio": AudioOut, "user": Transcript, "agent": TextDelta}
    optional_inputs = frozenset({"audio"})
    taps = frozenset({"user", "agent"})

    def __init__(self, *, output_dir: str | None = None, rate: int | None = None):
        self.output_dir, self.rate = output_dir, rate
        check_output_dir(output_dir)
        self._turns: dict[int, _Turn] = {}
        self._heard: dict[int, str] = {}  # a speculative turn's transcript, until its turn is written
        self._stale_before = 0
        self._rows: TranscriptFile | None = None

    def setup(self) -> None:
        self.dir = Path(self.output_dir).expanduser() if self.output_dir else self.ctx.run_dir
        self._rows = TranscriptFile(self.dir)

    def process(self, port: str, msg: Message) -> None:
        if getattr(msg, "speculative", False):
            # a speculative turn's transcript: no row of its own (a withdrawn turn has none); a
            # confirmed turn's reply can arrive in one burst from the gate before the confirmed
            # transcript does, and its row takes the words from here
            self._heard[msg.turn] = msg.text  # type: ignore[attr-defined]
            return
        assert self._rows is not None
        if self._rows.written(self.ctx.conversation or "conversation", msg.turn):
            return  # late words of a turn whose row is out (its reply was complete first)
        turn = self._turns.setdefault(msg.turn, _Turn())
        if isinstance(msg, AudioOut):
            if len(msg.pcm):
                pcm = msg.pcm if self.rate is None else resample(msg.pcm, msg.rate, self.rate)
                turn.audio.append(pcm)
                self.rate = self.rate or msg.rate
            turn.audio_done |= msg.end
        else:
            turn.note(msg)
        self._write_ready()

    def _complete(self, turn: _Turn) -> bool:
        wants_audio = "audio" in self.ctx.inputs_connected
        return turn.agent_done and (turn.audio_done or not wants_audio)

    def _write_ready(self, everything: bool = False) -> None:
        for n in sorted(self._turns):
            turn = self._turns[n]
            if everything or self._complete(turn) or 0 < n < self._stale_before:
                turn.interrupted = not self._complete(turn)
                self._write(n, self._turns.pop(n))

    def _write(self, n: int, turn: _Turn) -> None:
        import soundfile as sf

        if turn.user is None:
            turn.user = self._heard.get(n)
        self._heard = {t: text for t, text in self._heard.items() if t > n}
        conv = self.ctx.conversation or "conversation"
        wav = None
        if turn.audio:
            path = self.dir / conv / f"turn_{n:03d}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(str(path), np.concatenate(turn.audio), self.rate, subtype="PCM_16")
            wav = str(path.relative_to(self.dir))
        row = {"conversation": conv, "turn": n, "user": turn.user, "agent": turn.reply,
               "reply_wav": wav, "reply_audio_s": round(sum(map(len, turn.audio)) / (self.rate or 1), 3),
               "interrupted": turn.interrupted}
        assert self._rows is not None
        self._rows.write(row)

    def on_interrupt(self, turn: int) -> None:
        self._stale_before = turn  # written as interrupted when the sink next runs

    def finish(self) -> None:
        self._write_ready(everything=True)

    def close(self) -> None:
        if self._rows is not None:
            if self._turns:
                self._write_ready(everything=True)
            self._rows.close()
            self._rows = None
