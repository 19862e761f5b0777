"""The source and the sink of a Realtime session's graph (``io=realtime``).

The source turns what the client sends into the graph's messages: ``input_audio_buffer.append``
audio (PCM16 at the session's rate) into AudioChunks at the pipeline rate (or, with manual
turns, the ``Speech`` the client commits), and the user messages a ``response.create`` answers
into a Transcript that joins the STT's on its way to the LLM (class data ``joins``, read by
``s2s_flow.node.joined_ports``). The sink turns the graph's output into the session's events:
the user's speech started and stopped, their transcript, and each reply's words and audio
(resampled to the session's output rate). User speech during a reply interrupts it. Both take
their session from ``ctx.session``: the server gives every session's graph its own (server.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from nodes._playback import playback_of
from nodes.io.realtime import protocol as events
from nodes.io.realtime.response import Response
from nodes.io.realtime.session import Session
from nodes.io.realtime.twilio import TWILIO_TOKEN_ENV
from s2s_flow.audio import LowLatencyResampler, StreamResampler, to_float32
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.node import Node

log = logging.getLogger(__name__)

__all__ = ["RealtimeSource", "RealtimeSink", "API_KEY_ENV"]

API_KEY_ENV = "S2S_REALTIME_API_KEY"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_REMEMBERED_TURNS = 256  # per-turn bookkeeping kept for the most recent turns only


def _check_rate(rate: int) -> None:
    if rate not in (8000, 16000):
        raise ConfigError(f"io.rate={rate}: the pipeline runs at the VAD's rate, 16000 (or 8000)")



def _ice_servers(servers: Any) -> list[dict[str, Any]]:
    """``io.webrtc.ice_servers``: STUN/TURN servers as the browser's RTCIceServer dicts, checked."""
    out = []
    for i, server in enumerate(servers or ()):
        urls = server.get("urls") if isinstance(server, Mapping) else None
        urls = [urls] if isinstance(urls, str) else list(urls or ())
        if not urls or not all(isinstance(u, str) and u.split(":")[0] in ("stun", "stuns", "turn", "turns")
                               for u in urls):
            raise ConfigError(f"io.webrtc.ice_servers[{i}]={server!r}: each entry is {{urls: 'stun:HOST:PORT'}} or "
                              "{urls: 'turn:HOST:PORT', username: ..., credential: ...} (urls: one or a list)")
        if any(u.startswith("turn") for u in urls) and not (server.get("username") and server.get("credential")):
            raise ConfigError(f"io.webrtc.ice_servers[{i}]: a TURN server needs its username and credential")
        out.append({"urls": urls if len(urls) > 1 else urls[0], "username": server.get("username"),
                    "credential": server.get("credential")})
    return out

def _strings(key: str, value: Any) -> list[str]:
    """A list of strings from YAML or the command line (``io.allowed_origins=[https://a.example]``)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    items = list(value)
    if not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{key}={items!r}: give a list of strings, e.g. {key}=[https://app.example.com]")
    return items


def _session_of(node: Node) -> Session:
    session = node.ctx.session
    if not isinstance(session, Session):
        raise ConfigError(f"{type(node).__name__} runs inside the io=realtime server, which gives each session's "
                          "graph its own: serve with `s2s-run ... io=realtime`, not as a plain run")
    return session


class RealtimeSource(Node):
    """A session's input: client audio as AudioChunks (or, with manual turns, as the ``Speech`` the
    client commits), the user messages a ``response.create`` answers as a Transcript (or their
    audio, for an LLM that hears it); both join the VAD's and STT's on their way.

    The source also carries the server's settings (it is what ``s2s-run`` serves with):
    host, port, key, limits. They are checked here, at compose time.
    """

    outputs = {"audio": AudioChunk, "text": Transcript, "speech": Speech}
    live = True  # a client listens: a failed endpoint costs a turn (llm.fallback_reply), not the session
    joins = frozenset({"text", "speech"})
    # A client may send audio faster than real time (a file, a burst after a stall): hold it back
    # rather than drop it, as a microphone's freshest-wins ring would when the VAD falls behind.
    port_rings = {"audio": (128, "block")}
    secret_params = frozenset({"api_key", "twilio_auth_token", "webrtc"})  # webrtc: its TURN credentials

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
        max_events_per_s: float = 200.0,
        drain_timeout_s: float = 30.0,
        allowed_origins: Any = (),
        allowed_hosts: Any = (),
        client_limits: Mapping[str, Any] | None = None,
        trusted_proxies: Any = (),
        rate: int = 16000,
        chunk_ms: int = 32,
        webrtc: Mapping[str, Any] | None = None,
        target_ms: float | str | None = "auto",
        admission: str = "refuse",
        admission_wait_s: float = 10.0,
        twilio_voice: str | None = None,
        twilio_instructions: str | None = None,
        twilio_auth_token: str | None = None,
        small_heap: bool = False,
    ) -> None:
        _check_rate(rate)
        from nodes.io.realtime.admission import check

        check(admission, target_ms, admission_wait_s)
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
        if max_events_per_s < 10:
            raise ConfigError(f"io.max_events_per_s={max_events_per_s} is too low: a client streaming 20 ms appends "
                              "sends 50 a second; use at least 10 (default 200)")
        if drain_timeout_s < 0:
            raise ConfigError(f"io.drain_timeout_s={drain_timeout_s} must be >= 0 (seconds live sessions may "
                              "finish after SIGTERM)")
        self.allowed_origins = _strings("io.allowed_origins", allowed_origins)
        self.allowed_hosts = _strings("io.allowed_hosts", allowed_hosts)
        from nodes.io.realtime.clients import settings

        self.client_limits = settings(client_limits, trusted_proxies)
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
        self.max_queued_bytes, self.max_events_per_s = max_queued_bytes, float(max_events_per_s)
        self.drain_timeout_s = float(drain_timeout_s)
        self.rate, self.chunk_ms = rate, chunk_ms
        self.ice_servers = _ice_servers((webrtc or {}).get("ice_servers"))
        self.target_ms, self.admission, self.admission_wait_s = target_ms, admission, admission_wait_s
        self.twilio_voice, self.twilio_instructions = twilio_voice, twilio_instructions
        self.twilio_auth_token = twilio_auth_token or os.environ.get(TWILIO_TOKEN_ENV) or None
        self.small_heap = bool(small_heap)
        self.session: Session | None = None

    @property
    def serves(self) -> str:
        """Where clients connect (shown by dry_run=true)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"ws://{host}:{self.port}/v1/realtime (page: http://{host}:{self.port}/, Twilio Media Streams: "
                f"ws://{host}:{self.port}/v1/twilio, WebRTC: POST http://{host}:{self.port}/v1/realtime/calls)")

    def port_rate(self, port: str) -> int | None:
        return self.rate if port == "audio" else None

    def server(self, make_graph: Any, run_dir: Any, **options: Any) -> Any:
        """The server of these settings, for ``make_graph()``'s graphs (one per connection)."""
        from nodes.io.realtime.server import RealtimeServer

        return RealtimeServer(make_graph, self, run_dir, **options)

    def serve(self, make_graph: Any, run_dir: Any, **options: Any) -> dict[str, Any]:
        """Serve until SIGINT/SIGTERM: one graph from ``make_graph()`` per connection."""
        if self.small_heap:
            from s2s_flow import heap

            if not heap.small():
                log.info("io.small_heap: this C library keeps its own ways (not glibc): left as it is")
        return self.server(make_graph, run_dir, **options).run()

    def setup(self) -> None:
        self.session = _session_of(self)

    def produce(self) -> Iterator[Any]:
        session = self.session
        assert session is not None, "setup() first"
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
                    session.nodes.apply_turns(settings)
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
                for turn in session.cancel_begun():
                    self.ctx.interrupt(turn + 1, "response.cancel")

    def _respond(self, session: Session, resp: Response) -> Iterator[Any]:
        """Begin a ``response.create``'s response as a new turn: its user messages, typed and
        spoken, go to the LLM as one message (their audio, when the LLM hears audio)."""
        turn = self.ctx.new_turn()
        session.begin(turn, resp)
        texts = [q.text for q in resp.inputs if q.text]
        images = tuple(url for q in resp.inputs for url in q.images)
        audio = [q.speech.pcm for q in resp.inputs if q.speech is not None and not q.text]
        if audio and session.nodes.hears_audio:
            pcm = np.concatenate(audio)
            yield ("speech", Speech(turn=turn, pcm=pcm, rate=self.rate, start=0.0, end=len(pcm) / self.rate,
                                    speech_end_t=time.monotonic()))
        elif texts or images:
            yield ("text", Transcript(turn=turn, text="\n".join(texts), images=images))
        else:  # nothing was said (silence, or the transcripts were lost to an interrupt)
            session.fail(resp, "empty_input", "the user messages this response was to answer have no words")

    def close(self) -> None:
        if self.session is not None:
            self.session.close_input()


class RealtimeSink(Node):
    """A session's output: the graph's messages as the session's events."""

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
        self._lock = threading.Lock()  # interrupts come from other threads
        self._resamplers: dict[int, StreamResampler] = {}
        self._said: dict[int, str] = {}  # per user turn: the transcript sent so far as deltas
        self._hypothesis: dict[int, list[str]] = {}  # per user turn: the last partial's words
        self._completed: dict[int, None] = {}  # user turns whose transcript is complete (recent ones)
        self._announced: dict[int, None] = {}  # user turns whose speech_started went out (recent ones)

    def setup(self) -> None:
        self.session = _session_of(self)
        self.session.playback = playback_of(self.ctx)
        self.session.playback.paced = True  # the client plays what it gets at 1x: the TTS keeps a lead on it

    def process(self, port: str, msg: Message) -> None:
        assert self.session is not None, "setup() first"
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
                if msg.continues in self._hypothesis:
                    self._hypothesis[msg.turn] = self._hypothesis.pop(msg.continues)
            session.expect_reply(msg.turn)
            return
        session.send(events.speech_started(session.user_item(msg.turn), round(msg.start * 1000)))
        busy = session.expect_reply(msg.turn)
        if busy and (session.config.turn_detection or {}).get("interrupt_response", True):
            self.ctx.interrupt(msg.turn, "barge-in")

    def _speech(self, session: Session, msg: Speech) -> None:
        if msg.speculative:
            return
        session.expect_reply(msg.turn)
        item_id = session.user_audio(msg.turn, msg)
        if session.holds(msg.turn):  # waits for response.create from now on (its transcript may follow)
            session.hold(msg.turn, item_id, speech=msg)

    def _delta(self, session: Session, msg: Transcript) -> None:
        """A partial transcript while the user speaks. Deltas only append: they carry the words two
        consecutive partials agree on (from their start) that no delta has sent yet; a partial
        that rewrites words already sent sends nothing, and none comes once the transcript is
        complete (the completed event has the final text)."""
        if msg.turn < self.ctx.epoch or msg.turn in self._completed:
            return
        words = msg.text.split()
        before = self._hypothesis.get(msg.turn, [])
        self._hypothesis[msg.turn] = words
        for old in list(self._hypothesis)[: -_REMEMBERED_TURNS]:
            del self._hypothesis[old]
        agreed = []
        for a, b in zip(before, words, strict=False):
            if a != b:
                break
            agreed.append(a)
        said = self._said.get(msg.turn, "")
        sent = said.split()
        if len(agreed) <= len(sent) or agreed[: len(sent)] != sent:
            return
        text = " ".join(agreed)
        self._said[msg.turn] = text
        session.send(events.transcription_delta(session.user_item(msg.turn), text[len(said):]))

    def _transcript(self, session: Session, msg: Transcript) -> None:
        if not msg.final:  # the STT's stable words while the user speaks (stt.stream_ms): deltas
            self._delta(session, msg)
            return
        if msg.speculative or msg.turn in session.turn_items:
            return  # a speculative one, or the typed message a response.create sent
        said = self._said.pop(msg.turn, "")
        self._hypothesis.pop(msg.turn, None)
        self._completed[msg.turn] = None
        for old in list(self._completed)[: -_REMEMBERED_TURNS]:
            del self._completed[old]
        session.transcribed(msg.turn, msg.text, msg.text[len(said):] if msg.text.startswith(said) else "")

    # -- the assistant's side -----------------------------------------------------------

    def _text(self, session: Session, msg: TextDelta) -> None:
        if msg.error is not None:  # the LLM broke off: its response fails, whatever else gets through
            session.fail_turn(msg.turn, self.ctx.epoch, msg.error)
            return
        resp = session.output(msg.turn, self.ctx.epoch)
        if resp is not None:
            session.reply_text(resp, msg.text, last=msg.end, audio_follows="audio" in self.ctx.inputs_connected)

    def _audio(self, session: Session, msg: AudioOut) -> None:
        if len(msg.pcm) and session.playback is not None:  # the clock the TTS paces a reply by
            session.playback.started(msg.turn, time.monotonic())  # the first audio's moment, kept once
            session.playback.sent(msg.turn, len(msg.pcm) / msg.rate)
        resp = session.output(msg.turn, self.ctx.epoch)
        if resp is None:
            return
        pcm = np.zeros(0, np.float32)
        if resp.audio:
            with self._lock:
                resample = self._resamplers.get(msg.turn)
                if resample is None:
                    resample = self._resamplers[msg.turn] = StreamResampler(msg.rate, session.config.output_rate)
            pcm = resample(msg.pcm) if len(msg.pcm) else pcm
            if msg.end:
                tail = resample(np.zeros(0, np.float32), last=True)
                pcm = np.concatenate([pcm, tail]) if len(tail) else pcm
                with self._lock:
                    self._resamplers.pop(msg.turn, None)
        session.reply_audio(resp, pcm, msg.text, last=msg.end)

    def on_interrupt(self, turn: int) -> None:
        """Cut every reply before ``turn``: the session ends them cancelled."""
        session = self.session
        if session is None:
            return
        with self._lock:
            for t in [t for t in self._resamplers if t < turn]:
                del self._resamplers[t]
        session.cut_below(turn)
