"""Live audio: a microphone source and a speaker sink through sounddevice (PortAudio).

The source reads the input device in short chunks (blocking reads: no queue of its own),
resamples them to the pipeline rate and stamps each with the time its last sample
arrived. The sink plays replies in short blocks from a playback thread, so barge-in
silences the agent within one block: when the VAD confirms user speech while a reply is
under way, the sink calls ``ctx.interrupt(turn)``; the engine flushes what is queued and
closes the LLM stream, and the sink records what was really played (``_playback``), so
the LLM keeps only that in its history. Like the WAV sink it writes ``transcript.jsonl``,
and it shows the conversation on the terminal as it goes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nodes._playback import playback_of
from nodes.io._bargein import BargeIn
from nodes.io._console import ConsoleView
from nodes.io._devices import find_device, list_devices, load_sounddevice, stream_rate
from nodes.io._player import Player, Reply
from nodes.io._transcript import TranscriptFile, TurnText, check_output_dir
from s2s_flow.audio import StreamResampler, to_mono
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.node import Node

__all__ = ["MicSource", "SpeakerSink", "list_devices"]

_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


def _check_latency(latency: float | str, option: str) -> None:
    if isinstance(latency, str) and latency not in ("low", "high"):
        raise ConfigError(f"{option}={latency!r}: use low, high, or a number of seconds (e.g. 0.05)")
    if not isinstance(latency, str) and not 0 < latency <= 2:
        raise ConfigError(f"{option}={latency}: give the device latency in seconds, between 0 and 2")


def _check_rate(rate: int | None, option: str) -> None:
    if rate is not None and not 8000 <= rate <= 192_000:
        raise ConfigError(f"{option}={rate} is not an audio rate: give Hz between 8000 and 192000, or null "
                          "for the device's own rate")


def _open(sd: Any, kind: str, device: int, rate: int, block: int, latency: float | str, option: str) -> Any:
    cls = sd.InputStream if kind == "input" else sd.OutputStream
    try:
        return cls(device=device, samplerate=rate, channels=1, dtype="float32", blocksize=block, latency=latency)
    except Exception as exc:  # PortAudioError: busy, unplugged, unsupported
        name = sd.query_devices(device)["name"]
        raise ConfigError(f"{option}: cannot open the {kind} device {name!r} at {rate} Hz ({exc}); pick another "
                          f"device (s2s-run --list-devices) or rate") from None


class MicSource(Node):
    """The microphone as ``chunk_ms`` AudioChunks at ``rate``, until Ctrl-C (or ``duration_s``)."""

    outputs = {"audio": AudioChunk}
    live = True  # someone listens: a failed endpoint costs a turn (llm.fallback_reply), not the run
    list_devices = staticmethod(list_devices)  # `s2s-run --list-devices` asks the io source for it

    def __init__(
        self,
        *,
        device: str | int | None = None,
        rate: int = 16000,
        chunk_ms: int = 20,
        device_rate: int | None = None,
        latency: float | str = "low",
        echo_guard: bool = False,
        echo_tail_ms: int = 300,
        duration_s: float | None = None,
    ) -> None:
        if rate not in _RATES:
            raise ConfigError(f"io.rate={rate} is not a supported pipeline rate (16000, or 8000 for the VAD)")
        if not 5 <= chunk_ms <= 200:
            raise ConfigError(f"io.chunk_ms={chunk_ms} must be between 5 and 200 ms")
        _check_rate(device_rate, "io.source.device_rate")
        _check_latency(latency, "io.latency")
        if echo_tail_ms < 0:
            raise ConfigError(f"io.barge_in.echo_tail_ms={echo_tail_ms} must be >= 0 (ms of room echo after the "
                              "agent's voice stops)")
        if duration_s is not None and duration_s <= 0:
            raise ConfigError(f"io.source.duration_s={duration_s} must be > 0, or null to record until Ctrl-C")
        self.device, self.rate, self.chunk_ms = device, rate, chunk_ms
        self.device_rate, self.latency = device_rate, latency
        self.echo_guard, self.echo_tail_s = echo_guard, echo_tail_ms / 1000
        self.duration_s = duration_s
        self._stream: Any = None
        self.overflows = 0

    def port_rate(self, port: str) -> int | None:
        return self.rate

    def setup(self) -> None:
        sd = load_sounddevice()
        index = find_device(sd, self.device, "input", "io.input_device")
        rate = stream_rate(sd, index, "input", self.device_rate, self.rate, "io.input_device")
        self._block = rate * self.chunk_ms // 1000
        self._stream = _open(sd, "input", index, rate, self._block, self.latency, "io.input_device")
        self._resample = StreamResampler(rate, self.rate)
        self._playback = playback_of(self.ctx)
        self.ctx.log.info("microphone: %s at %d Hz, latency %.0f ms", sd.query_devices(index)["name"], rate,
                          1000 * self._stream.latency)

    def produce(self) -> Iterator[AudioChunk]:
        stream, stopping = self._stream, self.ctx.stopping
        chunk = self.rate * self.chunk_ms // 1000
        pending = np.zeros(0, np.float32)  # resampled audio not yet a whole chunk (soxr works in bursts)
        pos = 0  # samples emitted at the pipeline rate: the stream clock
        stream.start()
        end = None if self.duration_s is None else time.monotonic() + self.duration_s
        try:
            while not stopping.is_set() and (end is None or time.monotonic() < end):
                data, overflowed = stream.read(self._block)
                now = time.monotonic()  # the last sample read has just arrived
                self.overflows += bool(overflowed)
                pcm = self._resample(to_mono(data))
                if self.echo_guard and self._playback.audible(now - self.echo_tail_s):
                    pcm = np.zeros_like(pcm)  # the agent is speaking: keep its voice out of the VAD
                pending = np.concatenate([pending, pcm]) if len(pending) else pcm
                while len(pending) >= chunk:  # each stamped with when its last sample arrived
                    piece, pending = pending[:chunk], pending[chunk:]
                    yield AudioChunk(pcm=piece, rate=self.rate, start=pos / self.rate, t=now - len(pending) / self.rate)
                    pos += chunk
        finally:
            stream.stop()
            if self.overflows:
                self.ctx.log.warning("the microphone overflowed %d time(s): audio was lost (the machine was "
                                     "too busy; raise io.latency)", self.overflows)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.abort()
            self._stream.close()
            self._stream = None


class SpeakerSink(Node):
    """Plays replies on the output device; barge-in; ``transcript.jsonl`` with what was heard."""

    inputs = {
        "audio": AudioOut,
        "started": SpeechStarted,  # the VAD confirmed user speech: barge-in keys on it
        "speech": Speech,  # the utterance ended: a too-short one does not barge in
        "mic": AudioChunk,  # the input stream's clock, for barge_in.min_speech_ms
        "user": Transcript,
        "partial": Transcript,  # live partial transcripts (nodes.stt.partials), shown only
        "agent": TextDelta,
    }
    optional_inputs = frozenset({"audio", "started", "speech", "mic", "partial"})
    taps = frozenset({"started", "speech", "mic", "user", "agent"})

    def __init__(
        self,
        *,
        device: str | int | None = None,
        device_rate: int | None = None,
        block_ms: int = 20,
        latency: float | str = "low",
        barge_in: bool = True,
        barge_in_min_speech_ms: int = 0,
        output_dir: str | None = None,
        console: bool = True,
    ) -> None:
        _check_rate(device_rate, "io.sink.device_rate")
        _check_latency(latency, "io.latency")
        if not 5 <= block_ms <= 100:
            raise ConfigError(f"io.block_ms={block_ms} must be between 5 and 100 ms: barge-in stops the voice "
                              "within one block")
        if barge_in_min_speech_ms < 0:
            raise ConfigError(f"io.barge_in.min_speech_ms={barge_in_min_speech_ms} must be >= 0 (0: interrupt as "
                              "soon as the VAD confirms speech)")
        check_output_dir(output_dir)
        self.device, self.device_rate, self.block_ms, self.latency = device, device_rate, block_ms, latency
        self.output_dir, self.console = output_dir, console
        self.barge_in = BargeIn(enabled=barge_in, min_speech_s=barge_in_min_speech_ms / 1000)
        self._texts: dict[int, TurnText] = {}
        self._resamplers: dict[int, StreamResampler] = {}
        self._lock = threading.Lock()  # rows and texts: the playback thread finishes turns too
        self._player: Player | None = None
        self._rows: TranscriptFile | None = None
        self._view: ConsoleView | None = None

    def setup(self) -> None:
        sd = load_sounddevice()
        index = find_device(sd, self.device, "output", "io.output_device")
        self.rate = stream_rate(sd, index, "output", self.device_rate, 48000, "io.output_device")
        block = self.rate * self.block_ms // 1000
        stream = _open(sd, "output", index, self.rate, block, self.latency, "io.output_device")
        self.playback = playback_of(self.ctx)
        self.playback.paced = True  # the speaker plays at 1x: the TTS keeps a lead on it
        self._rows = TranscriptFile(Path(self.output_dir).expanduser() if self.output_dir else self.ctx.run_dir)
        self._view = ConsoleView() if self.console else None
        self._player = Player(stream, rate=self.rate, block=block, on_sentence=self._sentence_playing,
                              on_done=self._reply_done, on_audible=self.playback.set_audible_until)
        self._player.start()
        self.output_latency_s = float(stream.latency)  # how long a block takes from write() to the device
        self.ctx.log.info("speaker: %s at %d Hz, latency %.0f ms", sd.query_devices(index)["name"], self.rate,
                          1000 * stream.latency)

    # -- messages ------------------------------------------------------------------------

    def process(self, port: str, msg: Message) -> None:
        player = self._player
        assert player is not None
        if player.error is not None:
            raise player.error
        if getattr(msg, "speculative", False) or getattr(msg, "continues", 0):
            return  # a speculative turn (vad.speculate_ms): only its confirmation counts here
        if port == "audio":
            self._play(player, msg)  # type: ignore[arg-type]
        elif port == "mic":
            self._barge(self.barge_in.position(msg.start + msg.duration))  # type: ignore[attr-defined]
        elif port == "started":
            self._barge(self.barge_in.started(msg))  # type: ignore[arg-type]
        elif port == "speech":
            self._barge(self.barge_in.ended(msg))  # type: ignore[arg-type]
        elif port == "partial":
            if self._view is not None:
                self._view.partial(msg.text)  # type: ignore[attr-defined]
        else:
            self._words(player, msg)

    def _play(self, player: Player, msg: AudioOut) -> None:
        if len(msg.pcm):
            resample = self._resamplers.get(msg.turn)
            if resample is None:
                resample = self._resamplers[msg.turn] = StreamResampler(msg.rate, self.rate)
            player.add(msg.turn, resample(msg.pcm), msg.text)
            self.playback.sent(msg.turn, len(msg.pcm) / msg.rate)
        if msg.end:
            resample = self._resamplers.pop(msg.turn, None)
            if resample is not None:
                player.add(msg.turn, resample(np.zeros(0, np.float32), last=True), msg.text)
            player.end(msg.turn)

    def _words(self, player: Player, msg: Message) -> None:
        with self._lock:
            if self._rows is not None and self._rows.written(self.ctx.conversation or "conversation", msg.turn):
                return  # late words of a turn whose row is out
            text = self._texts.setdefault(msg.turn, TurnText())
            text.note(msg)
        if isinstance(msg, Transcript) and self._view is not None:
            # not final: the STT's stable words while the user speaks (stt.stream_ms), shown live
            (self._view.user if msg.final else self._view.partial)(msg.text)
        if not isinstance(msg, TextDelta):
            return
        if "audio" in self.ctx.inputs_connected:
            player.reply(msg.turn)  # a reply is under way: user speech now barges in
        else:  # text only: show sentences as they complete, finish the turn at its end
            if msg.sentence_end and self._view is not None:
                self._view.agent(msg.turn, text.reply.rsplit("\n")[-1])
            if msg.end:
                self._write_row(msg.turn, None)

    def _barge(self, turn: int | None) -> None:
        """Interrupt the reply under way (if any) for the user's new ``turn``."""
        if turn is not None and self._player is not None and self._player.busy_before(turn):
            self.ctx.interrupt(turn, "barge-in")

    # -- playback events (playback thread) and interrupts (any thread) -------------------

    def _sentence_playing(self, turn: int, text: str) -> None:
        self.playback.started(turn, time.monotonic())
        if self._view is not None:
            self._view.agent(turn, text)

    def _reply_done(self, reply: Reply) -> None:
        self._write_row(reply.turn, reply)

    def on_interrupt(self, turn: int) -> None:
        """Stop the voice now and record what was heard of each reply that was cut."""
        if self._player is None:
            return
        now = time.monotonic()
        cut = {r.turn: r for r in self._player.cut(turn)}
        with self._lock:
            waiting = [t for t in self._texts if 0 < t < turn and t not in cut and not self._player.knows(t)]
        for t in waiting:  # a reply that had not reached the speaker yet: nothing was heard
            cut[t] = Reply(t, cut=True)
        for t in sorted(cut):
            reply = cut[t]
            heard = reply.heard()
            self.playback.set_heard(t, heard, played_s=reply.played / self.rate, t=now)
            if self._view is not None and reply.played:
                self._view.interrupted(heard)
            self._write_row(t, reply)
        for t in [t for t in self._resamplers if 0 < t < turn]:
            del self._resamplers[t]

    def _write_row(self, turn: int, reply: Reply | None) -> None:
        with self._lock:
            text = self._texts.pop(turn, TurnText())
            if self._rows is None or (reply is None and text.user is None and not text.agent):
                return
            played = reply.played / self.rate if reply is not None else 0.0
            self._rows.write({
                "conversation": self.ctx.conversation or "conversation", "turn": turn, "user": text.user,
                "agent": text.reply, "heard": reply.heard() if reply is not None else text.reply,
                "reply_audio_s": round(played, 3), "interrupted": bool(reply is not None and reply.cut),
            })

    # -- end -------------------------------------------------------------------------------

    def finish(self) -> None:
        """End of the input: let the last reply play out, then write what is left."""
        if self._player is not None:
            self._player.wait_idle(self.ctx.stopping)
            if self._player.error is not None:
                raise self._player.error
        self._write_rest()

    def _write_rest(self) -> None:
        replies = {r.turn: r for r in self._player.take_unfinished()} if self._player is not None else {}
        with self._lock:
            left = sorted(set(self._texts) | set(replies))
        for turn in left:
            self._write_row(turn, replies.get(turn))

    def close(self) -> None:
        self._write_rest()
        if self._player is not None:
            self._player.stop()
            if self._player.underflows:
                self.ctx.log.warning("the speaker underflowed %d time(s): the agent's voice had gaps (the "
                                     "machine was too busy; raise io.latency)", self._player.underflows)
            self._player = None
        if self._rows is not None:
            self._rows.close()
            self._rows = None
        if self._view is not None:
            self._view.close()
