"""``io=realtime``: the graph served over WebSocket with the OpenAI Realtime protocol.

One connection is one session: its own instance of the graph (rings, threads, VAD state,
history), built per connection from the composed config, while the heavy resources (weights,
ONNX / CTranslate2 sessions) are loaded once per process and shared (``Node.shared()``).
The source turns the client's ``input_audio_buffer.append`` audio (PCM16 at the session's
rate) into AudioChunks at the pipeline rate, and its typed-in messages into Transcripts that
join the STT's on their way to the LLM (``Node.joins``). The sink turns the graph's output
into server events: speech started/stopped, the user's transcript, and each reply as
``response.*`` events with base64 PCM16 audio at the session's output rate. User speech during
a reply interrupts it (``response.done`` cancelled); the history keeps what was sent, or what
the client says was heard (``conversation.item.truncate``).

Turns: with ``turn_detection`` server_vad (the default) the session's own VAD ends each turn,
with the client's threshold, silence and padding; ``create_response: false`` holds a turn's
reply until ``response.create``; ``turn_detection: null`` leaves the VAD out and the client
ends each turn with ``input_audio_buffer.commit``. The session decides which user messages
start a reply (``Session.holds``), which replies are spoken and what of the conversation the
LLM sees (deleted items, per-response instructions); the graph's nodes ask it through
``ctx.session`` (the node contract's ``SessionHooks``): see nodes/io/_realtime_session.py.

    s2s-run recipe=local_cpu io=realtime                    # ws://127.0.0.1:8765/v1/realtime
"""

from __future__ import annotations

import base64
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from nodes._playback import playback_of
from nodes.io._realtime_events import ProtocolError, message_item
from nodes.io._realtime_session import Response, Session
from s2s_flow.audio import StreamResampler, to_float32
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.node import Node

__all__ = ["RealtimeSource", "RealtimeSink", "Session", "Response", "API_KEY_ENV", "LowLatencyResampler",
           "vad_turn_settings", "fit_vad_settings", "apply_vad_settings"]

API_KEY_ENV = "S2S_REALTIME_API_KEY"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_REMEMBERED_TURNS = 256  # per-turn bookkeeping kept for the most recent turns only


# -- turn_detection on the session's VAD -----------------------------------------------------

_VAD_SETTINGS = {"threshold": "threshold", "silence_duration_ms": "min_silence_ms",
                 "prefix_padding_ms": "speech_pad_ms"}  # turn_detection's names -> SileroVAD's


def vad_turn_settings(vad: Any) -> dict[str, Any] | None:
    """turn_detection's numbers as the session's VAD has them (None: a VAD that takes none)."""
    if vad is None or not callable(getattr(vad, "set_turn_detection", None)):
        return None
    return {key: getattr(vad, attr) for key, attr in _VAD_SETTINGS.items()}


def fit_vad_settings(vad: Any, old: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
    """The turn_detection the session's VAD will use for ``new``: refused (ProtocolError) where it
    cannot take it, the prefix padding lowered to what a speculating VAD allows."""
    if new is None:
        return None
    changed = [k for k in _VAD_SETTINGS if old is None or new.get(k) != old.get(k)]
    if not changed:
        return new
    where = "session.audio.input.turn_detection"
    if vad_turn_settings(vad) is None:
        raise ProtocolError("unsupported_value", f"turn_detection.{changed[0]}: the server's vad "
                            f"({type(vad).__name__ if vad is not None else 'none'}) takes no turn settings from "
                            "the client; leave them out, or serve with vad=silero", param=f"{where}.{changed[0]}")
    silence = new["silence_duration_ms"]
    speculate = getattr(vad, "speculate_ms", 0) or 0
    if speculate and silence <= speculate:
        raise ProtocolError("invalid_value", f"turn_detection.silence_duration_ms={silence}: this server starts a "
                            f"reply after vad.speculate_ms={speculate} ms of silence, before the turn ends; use more "
                            "than that", param=f"{where}.silence_duration_ms")
    if getattr(vad, "turn_detector", "silence") == "smart_turn" and silence >= vad.max_silence_ms:
        raise ProtocolError("invalid_value", f"turn_detection.silence_duration_ms={silence}: this server's turn model "
                            f"ends a turn after vad.max_silence_ms={vad.max_silence_ms} ms anyway; use less",
                            param=f"{where}.silence_duration_ms")
    if speculate and new["prefix_padding_ms"] > speculate:  # the padding also closes the utterance
        new = {**new, "prefix_padding_ms": speculate}  # session.updated shows what is in effect
    return new


def apply_vad_settings(vad: Any, settings: dict[str, Any]) -> None:
    """Point the session's own VAD at the client's turn_detection (from the source's thread)."""
    if vad_turn_settings(vad) is None:
        return
    vad.set_turn_detection(threshold=float(settings["threshold"]), min_silence_ms=int(settings["silence_duration_ms"]),
                           speech_pad_ms=int(settings["prefix_padding_ms"]))


class LowLatencyResampler:
    """Streaming polyphase resampler (Kaiser-windowed sinc) for the client's audio on its way to
    the VAD: about 1 ms of delay, where soxr's stream mode holds back 20-40 ms per block (its
    output comes in bursts), which the end of every turn would wait for. Flat to 0.375 x the
    lower rate (6 kHz at 16 kHz), -6 dB at 0.45 x: made for speech going to a VAD and STT."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        g = math.gcd(rate_in, rate_out)
        self.up, self.down = rate_out // g, rate_in // g
        self.taps = k = round(32 * max(1.5, rate_in / rate_out))  # input samples per output sample
        cutoff = 0.45 * min(rate_in, rate_out) / (rate_in * self.up)  # -6 dB, cycles per upsampled sample
        n = np.arange(k * self.up) - (k * self.up - 1) / 2
        h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(k * self.up, 8.0) * self.up
        self._bank = np.ascontiguousarray(h.reshape(k, self.up).T[:, ::-1], np.float32)  # [phase, oldest tap first]
        self._history = np.zeros(k - 1, np.float32)
        self._next = 0  # index of the next output sample
        self._seen = 0  # input samples so far

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, pcm.astype(np.float32, copy=False)])
        self._seen += len(pcm)
        self._history = x[len(x) - (self.taps - 1):]
        last = (self._seen * self.up - 1) // self.down  # the newest output whose inputs are all here
        if last < self._next:
            return np.zeros(0, np.float32)
        pos = np.arange(self._next, last + 1) * self.down
        newest = pos // self.up - (self._seen - len(x))  # each output's newest input, as an index in x
        window = x[newest[:, None] + np.arange(1 - self.taps, 1)]
        self._next = last + 1
        return np.einsum("ij,ij->i", window, self._bank[pos % self.up]).astype(np.float32, copy=False)


def _check_rate(rate: int) -> None:
    if rate not in (8000, 16000):
        raise ConfigError(f"io.rate={rate}: the pipeline runs at the VAD's rate, 16000 (or 8000)")


class RealtimeSource(Node):
    """A session's input: client audio as AudioChunks (or, with manual turns, as the ``Speech``
    the client commits), the user messages a ``response.create`` answers as a Transcript (or
    their audio, for an LLM that hears it); both join the VAD's and STT's on their way.

    The source also carries the server's settings (it is what ``s2s-run`` serves with):
    host, port, key, limits. They are checked here, at compose time.
    """

    outputs = {"audio": AudioChunk, "text": Transcript, "speech": Speech}
    joins = frozenset({"text", "speech"})
    # A client may send audio faster than real time (a file, a burst after a stall): hold it back
    # rather than drop it, as a microphone's freshest-wins ring would when the VAD falls behind.
    port_rings = {"audio": (128, "block")}
    secret_params = frozenset({"api_key"})

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        api_key: str | None = None,
        allow_public: bool = False,
        max_sessions: int = 8,
        idle_timeout_s: float = 300.0,
        max_frame_bytes: int = 1 << 20,
        max_queued_bytes: int = 8 << 20,
        rate: int = 16000,
        chunk_ms: int = 20,
    ) -> None:
        _check_rate(rate)
        if not 0 <= port <= 65535:
            raise ConfigError(f"io.port={port} is not a TCP port (0-65535; 0 picks a free one)")
        if max_sessions < 1:
            raise ConfigError(f"io.max_sessions={max_sessions} must be >= 1")
        if idle_timeout_s <= 0:
            raise ConfigError(f"io.idle_timeout_s={idle_timeout_s} must be > 0 (seconds without a client event)")
        if max_frame_bytes < 4096:
            raise ConfigError(f"io.max_frame_bytes={max_frame_bytes} is too small: a 20 ms append is ~1.3 kB "
                              "of base64; use at least 4096 (default 1 MiB)")
        if max_queued_bytes < 65536:
            raise ConfigError(f"io.max_queued_bytes={max_queued_bytes} is too small: a client that reads keeps "
                              "several audio events in flight; use at least 65536 (default 8 MiB)")
        if not 5 <= chunk_ms <= 200:
            raise ConfigError(f"io.chunk_ms={chunk_ms} must be between 5 and 200 ms")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        if host not in _LOOPBACK and not self.api_key and not allow_public:
            raise ConfigError(
                f"io.host={host} accepts connections from other machines, and no key is set: anyone who "
                f"reaches it can talk to your models. Set io.api_key (or ${API_KEY_ENV}), bind io.host="
                "127.0.0.1, or io.allow_public=true if that is what you mean")
        self.host, self.port, self.allow_public = host, port, allow_public
        self.max_sessions, self.idle_timeout_s, self.max_frame_bytes = max_sessions, idle_timeout_s, max_frame_bytes
        self.max_queued_bytes = max_queued_bytes
        self.rate, self.chunk_ms = rate, chunk_ms
        self.session: Session | None = None

    @property
    def serves(self) -> str:
        """Where clients connect (shown by dry_run=true)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}/v1/realtime (page: http://{host}:{self.port}/)"

    def port_rate(self, port: str) -> int | None:
        return self.rate if port == "audio" else None

    def serve(self, make_graph: Any, run_dir: Any, **options: Any) -> dict[str, Any]:
        """Serve until SIGINT/SIGTERM: one graph from ``make_graph()`` per connection."""
        from nodes.io._realtime_app import RealtimeServer

        server = RealtimeServer(make_graph, self, run_dir, **options)
        return server.run()

    def produce(self) -> Iterator[Any]:
        session = self.session
        assert session is not None, "the server binds a session before the graph runs"
        chunk = self.rate * self.chunk_ms // 1000
        pending = np.zeros(0, np.float32)
        pos, rate, resample = 0, None, None
        manual: list[np.ndarray] | None = [] if session.config.manual else None  # the uncommitted buffer
        while not self.ctx.stopping.is_set():
            item = session.inbox.get()
            if item is None:
                return
            kind = item[0]
            if kind == "audio":
                _, raw, in_rate, t = item
                if in_rate != rate:
                    rate = in_rate
                    resample = LowLatencyResampler(in_rate, self.rate) if in_rate != self.rate else None
                pcm = to_float32(np.frombuffer(raw, "<i2"))
                pcm = resample(pcm) if resample is not None else pcm
                if manual is not None:
                    manual.append(pcm)
                    continue
                pending = np.concatenate([pending, pcm]) if len(pending) else pcm
                while len(pending) >= chunk:  # stamped as if each arrived in real time
                    piece, pending = pending[:chunk], pending[chunk:]
                    yield AudioChunk(pcm=piece, rate=self.rate, start=pos / self.rate,
                                     t=t - len(pending) / self.rate)
                    pos += chunk
            elif kind == "turns":  # session.update's turn_detection, in order with the audio
                settings = item[1]
                if settings is None:
                    manual = [] if manual is None else manual
                else:
                    manual = None
                    apply_vad_settings(session.vad, settings)
            elif kind == "commit" and manual:
                pcm, manual = np.concatenate(manual), []
                turn = self.ctx.new_turn()
                speech = Speech(turn=turn, pcm=pcm, rate=self.rate, start=pos / self.rate,
                                end=(pos + len(pcm)) / self.rate, speech_end_t=time.monotonic())
                pos += len(pcm)
                session.commit(turn, speech)
                yield ("speech", speech)
            elif kind == "clear":
                pending, rate = np.zeros(0, np.float32), None
                manual = [] if manual is not None else None
            elif kind == "respond":
                yield from self._respond(session, item[1])
            elif kind == "cancel":
                for resp in session.active():
                    if not resp.turn:
                        continue  # asked for after the cancel: it goes ahead
                    resp.cancel_reason = "client_cancelled"
                    self.ctx.interrupt(resp.turn + 1, "response.cancel")

    def _respond(self, session: Session, resp: Response) -> Iterator[Any]:
        """Begin a ``response.create``'s response as a new turn: its user messages, typed and
        spoken, go to the LLM as one message (their audio, when the LLM hears audio)."""
        turn = self.ctx.new_turn()
        session.begin(turn, resp)
        texts = [p.text for p in resp.inputs if p.text]
        audio = [p.speech.pcm for p in resp.inputs if p.speech is not None and not p.text]
        if audio and session.hears_audio:
            pcm = np.concatenate(audio)
            yield ("speech", Speech(turn=turn, pcm=pcm, rate=self.rate, start=0.0, end=len(pcm) / self.rate,
                                    speech_end_t=time.monotonic()))
        elif texts:
            yield ("text", Transcript(turn=turn, text="\n".join(texts)))
        else:  # nothing was said (silence, or the transcripts were lost to an interrupt)
            session.fail(resp, "empty_input", "the user messages this response was to answer have no words")

    def close(self) -> None:
        if self.session is not None:
            self.session.close_input()


class RealtimeSink(Node):
    """A session's output: the graph's messages as Realtime server events."""

    inputs = {
        "audio": AudioOut,
        "started": SpeechStarted,
        "speech": Speech,
        "user": Transcript,
        "partial": Transcript,  # live partial transcripts (nodes.stt.partials, io.partials.interval_ms)
        "agent": TextDelta,
    }
    optional_inputs = frozenset({"audio", "started", "speech", "partial"})
    taps = frozenset({"started", "speech", "user", "agent"})

    def __init__(self) -> None:
        self.session: Session | None = None
        self._lock = threading.Lock()  # responses: interrupts come from other threads
        self._resamplers: dict[int, StreamResampler] = {}
        self._speech_end: dict[int, float] = {}
        self._open_turns: set[int] = set()  # user turns whose reply is not done
        self._said: dict[int, str] = {}  # per user turn: the transcript sent so far as deltas
        self._announced: dict[int, None] = {}  # user turns whose speech_started went out (recent ones)

    def setup(self) -> None:
        assert self.session is not None, "the server binds a session before the graph runs"
        self.session.playback = playback_of(self.ctx)

    def process(self, port: str, msg: Message) -> None:
        assert self.session is not None
        handle = {"started": self._started, "speech": self._speech, "user": self._transcript,
                  "partial": self._delta, "agent": self._text, "audio": self._audio}[port]
        handle(self.session, msg)  # type: ignore[operator]

    # -- the user's side ---------------------------------------------------------------
    # Speculative turns (vad.speculate_ms): the VAD's early Speech and its transcript are for the
    # LLM only; the user's side shows the confirmed copies, and a turn that goes on after a
    # withdrawn speculation is the same user item (the gate before this sink holds the replies).

    def _started(self, session: Session, msg: SpeechStarted) -> None:
        with self._lock:
            announced = msg.continues in self._announced
            self._announced[msg.turn] = None
            for old in list(self._announced)[: -_REMEMBERED_TURNS]:
                del self._announced[old]
        # the same utterance, going on: no new item, no new barge-in. Unless its start was never
        # announced: the withdrawal's interrupt flushed that SpeechStarted before it got here
        if msg.continues and announced:
            session.continue_item(msg.turn, msg.continues)
            with self._lock:
                if msg.continues in self._said:
                    self._said[msg.turn] = self._said.pop(msg.continues)
                if not session.holds(msg.turn):
                    self._open_turns.add(msg.turn)
            return
        item_id = session.user_item(msg.turn)
        session.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": round(msg.start * 1000),
                      "item_id": item_id})
        detection = session.config.turn_detection or {}
        with self._lock:
            busy = any(t < msg.turn for t in self._open_turns)
            if not session.holds(msg.turn):
                self._open_turns.add(msg.turn)  # a user turn is under way: its reply will follow
        if busy and detection.get("interrupt_response", True):
            self.ctx.interrupt(msg.turn, "barge-in")

    def _speech(self, session: Session, msg: Speech) -> None:
        if msg.speculative:
            return
        item_id = session.user_item(msg.turn)
        held = session.holds(msg.turn)
        with self._lock:
            if not held:
                self._open_turns.add(msg.turn)
            self._speech_end[msg.turn] = msg.speech_end_t
            for old in list(self._speech_end)[: -_REMEMBERED_TURNS]:
                del self._speech_end[old]
        session.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": round(msg.end * 1000),
                      "item_id": item_id})
        previous = session.add_item(item_id)
        session.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "completed")
        session.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        if held:  # waits for response.create from now on (its transcript may follow)
            session.hold(msg.turn, item_id, speech=msg)

    def _delta(self, session: Session, msg: Transcript) -> None:
        """A partial transcript while the user speaks: its new words as a transcription delta (a
        partial that rewrites earlier words sends nothing; the completed event has the final text)."""
        said = self._said.get(msg.turn, "")
        text = msg.text.strip()
        if not text.startswith(said) or len(text) == len(said) or msg.turn < self.ctx.epoch:
            return
        self._said[msg.turn] = text
        session.send({"type": "conversation.item.input_audio_transcription.delta",
                      "item_id": session.user_item(msg.turn), "content_index": 0, "delta": text[len(said):]})

    def _transcript(self, session: Session, msg: Transcript) -> None:
        if not msg.final:  # the STT's stable words while the user speaks (stt.stream_ms): deltas
            self._delta(session, msg)
            return
        if msg.speculative or msg.turn in session.turn_items:
            return  # a partial, a speculative one, or the typed message a response.create sent
        item_id = session.user_item(msg.turn)
        held = session.holds(msg.turn)
        if held:  # before the client hears of it: a response.create may follow at once
            session.hold(msg.turn, item_id, text=msg.text)
        base = {"item_id": item_id, "content_index": 0}
        said = self._said.pop(msg.turn, "")
        rest = msg.text[len(said):] if msg.text.startswith(said) else ""
        if rest:
            session.send({"type": "conversation.item.input_audio_transcription.delta", **base, "delta": rest})
        session.send({"type": "conversation.item.input_audio_transcription.completed", **base,
                      "transcript": msg.text, "usage": None})
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": msg.text}], "completed")
        session.send({"type": "conversation.item.done", "previous_item_id": None, "item": item})
        if not msg.text or held:
            with self._lock:
                self._open_turns.discard(msg.turn)  # nothing to answer, or not now
        else:
            with session.lock:
                session.answering = msg.turn

    # -- the assistant's side -----------------------------------------------------------

    def _response(self, session: Session, turn: int) -> Response | None:
        with self._lock:
            if turn < self.ctx.epoch:
                return None
            resp = session.response(turn)
            assert resp is not None
            if resp.done:
                return None
            if resp.speech_end_t is None:
                resp.speech_end_t = self._speech_end.pop(turn, None)
            self._open_turns.add(turn)
            if not resp.started:
                resp.started = True
                previous = session.add_item(resp.item_id)
                ids = {"response_id": resp.id, "output_index": 0}
                session.send({"type": "response.output_item.added", **ids, "item": resp.as_item("in_progress")})
                session.send({"type": "conversation.item.added", "previous_item_id": previous,
                              "item": resp.as_item("in_progress")})
                part = {"type": "audio", "transcript": ""} if "audio" in resp.modalities else {"type": "text",
                                                                                                "text": ""}
                session.send({"type": "response.content_part.added", **ids, "item_id": resp.item_id,
                              "content_index": 0, "part": part})
            return resp

    def _send_unless_done(self, session: Session, resp: Response, event: dict[str, Any]) -> bool:
        """Send a delta unless an interrupt has cancelled the response meanwhile: checked under the
        lock on_interrupt() marks it under, so no delta follows its ``response.done``."""
        with self._lock:
            if resp.done:
                return False
            session.send(event)  # only queues it for the connection's loop: cheap under the lock
            return True

    def _ids(self, resp: Response) -> dict[str, Any]:
        return {"response_id": resp.id, "item_id": resp.item_id, "output_index": 0, "content_index": 0}

    def _text(self, session: Session, msg: TextDelta) -> None:
        resp = self._response(session, msg.turn)
        if resp is None:
            return
        if msg.text:
            resp.text += msg.text
            kind = "response.output_audio_transcript.delta" if "audio" in resp.modalities else \
                "response.output_text.delta"
            if not self._send_unless_done(session, resp, {"type": kind, **self._ids(resp), "delta": msg.text}):
                return
        if msg.end:
            resp.text_done = True
            if "audio" not in resp.modalities or "audio" not in self.ctx.inputs_connected:
                self._finish(session, resp)

    def _audio(self, session: Session, msg: AudioOut) -> None:
        resp = self._response(session, msg.turn)
        if resp is None:
            return
        if "audio" not in resp.modalities:
            if msg.end and resp.text_done:
                self._finish(session, resp)
            return
        resample = self._resamplers.get(msg.turn)
        if resample is None:
            resample = self._resamplers[msg.turn] = StreamResampler(msg.rate, session.config.output_rate)
        pcm = resample(msg.pcm) if len(msg.pcm) else np.zeros(0, np.float32)
        if msg.end:
            tail = resample(np.zeros(0, np.float32), last=True)
            pcm = np.concatenate([pcm, tail]) if len(tail) else pcm
            self._resamplers.pop(msg.turn, None)
        if len(pcm):
            if msg.text and (not resp.sentences or resp.sentences[-1][1] != msg.text):
                resp.sentences.append((resp.audio_ms, msg.text))
            data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
            if not self._send_unless_done(session, resp, {"type": "response.output_audio.delta", **self._ids(resp),
                                                          "delta": base64.b64encode(data).decode("ascii")}):
                return
            resp.audio_ms += 1000 * len(pcm) / session.config.output_rate
            if not resp.first_audio:
                resp.first_audio = True
                if resp.speech_end_t is not None and session.observe is not None:
                    session.observe("voice_to_voice_s", time.monotonic() - resp.speech_end_t)
        if msg.end:
            self._finish(session, resp)

    def _finish(self, session: Session, resp: Response) -> None:
        with self._lock:
            if resp.done:
                return
            resp.done = True
            self._open_turns.discard(resp.turn)
        ids = self._ids(resp)
        if "audio" in resp.modalities:
            session.send({"type": "response.output_audio.done", **ids})
            session.send({"type": "response.output_audio_transcript.done", **ids, "transcript": resp.text})
            part = {"type": "audio", "transcript": resp.text}
        else:
            session.send({"type": "response.output_text.done", **ids, "text": resp.text})
            part = {"type": "text", "text": resp.text}
        session.send({"type": "response.content_part.done", **ids, "part": part})
        item = resp.as_item("completed")
        session.send({"type": "response.output_item.done", "response_id": resp.id, "output_index": 0, "item": item})
        session.send({"type": "conversation.item.done", "previous_item_id": None, "item": item})
        session.send({"type": "response.done", "response": resp.as_response("completed")})
        if session.observe is not None:
            session.observe("turn", 1)

    def on_interrupt(self, turn: int) -> None:
        """Cut every reply before ``turn``: no more audio, ``response.done`` cancelled, and the
        history keeps what was sent (until the client truncates it to what it played)."""
        session = self.session
        if session is None:
            return
        now = time.monotonic()
        session.forget_below(turn)
        with self._lock:
            self._open_turns = {t for t in self._open_turns if t >= turn}
            cut = [r for r in session.active() if r.turn < turn]
            for resp in cut:
                resp.done = True
            for t in [t for t in self._resamplers if t < turn]:
                del self._resamplers[t]
        for resp in cut:
            if session.playback is not None:
                session.playback.set_heard(resp.turn, resp.heard(), played_s=resp.audio_ms / 1000, t=now)
            if resp.started:
                item = resp.as_item("incomplete")
                session.send({"type": "response.output_item.done", "response_id": resp.id, "output_index": 0,
                              "item": item})
            details = {"type": "cancelled", "reason": resp.cancel_reason}
            session.send({"type": "response.done", "response": resp.as_response("cancelled", details,
                                                                                output=resp.started)})
