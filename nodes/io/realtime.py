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

    s2s-run recipe=local_cpu io=realtime                    # ws://127.0.0.1:8765/v1/realtime
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nodes._playback import Playback, playback_of
from nodes.io._realtime_events import ProtocolError, SessionConfig, message_item, new_id
from s2s_flow.audio import StreamResampler, to_float32
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, AudioOut, Message, Speech, SpeechStarted, TextDelta, Transcript
from s2s_flow.node import Node

__all__ = ["RealtimeSource", "RealtimeSink", "Session", "API_KEY_ENV"]

API_KEY_ENV = "S2S_REALTIME_API_KEY"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_INBOX = 512  # client events waiting for the source thread (20 ms of audio each, typically)


@dataclass
class Response:
    """One ``response``: the assistant item it makes and what of it was sent."""

    id: str
    turn: int = 0
    modalities: list[str] = field(default_factory=lambda: ["audio"])
    item_id: str = field(default_factory=lambda: new_id("item"))
    started: bool = False  # output_item.added sent
    text: str = ""
    text_done: bool = False
    audio_ms: float = 0.0
    sentences: list[tuple[float, str]] = field(default_factory=list)  # (start ms in the audio, sentence)
    done: bool = False
    cancel_reason: str = "turn_detected"
    speech_end_t: float | None = None
    first_audio: bool = False

    def heard(self, until_ms: float | None = None) -> str:
        """The sentences whose audio began before ``until_ms`` (all sent ones by default)."""
        end = self.audio_ms if until_ms is None else until_ms
        return " ".join(s for start, s in self.sentences if start < end).strip()

    def as_item(self, status: str) -> dict[str, Any]:
        part = ({"type": "output_audio", "transcript": self.text} if "audio" in self.modalities
                else {"type": "output_text", "text": self.text})
        return message_item(self.item_id, "assistant", [part], status)

    def as_response(self, status: str, details: dict[str, Any] | None = None, output: bool = True) -> dict[str, Any]:
        return {"object": "realtime.response", "id": self.id, "status": status, "status_details": details,
                "output": [self.as_item("completed" if status == "completed" else "incomplete")] if output else [],
                "conversation_id": "conv", "output_modalities": self.modalities, "usage": None, "metadata": None}


@dataclass
class ClientCall:
    """A call of a client-declared tool, waiting for the client's ``function_call_output``."""

    call_id: str
    name: str
    arguments: str
    turn: int
    item_id: str = field(default_factory=lambda: new_id("item"))
    output: str | None = None
    answered: threading.Event = field(default_factory=threading.Event)


class Session:
    """One connection's bridge between the asyncio server and the graph's threads (thread-safe).

    ``send`` queues a server event for the connection's sender task; ``inbox`` carries what
    the client sent to the source's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, config: SessionConfig,
                 observe: Any = None) -> None:
        self.id = new_id("sess")
        self.loop, self._out, self.config = loop, out, config
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=_INBOX)
        self.lock = threading.Lock()
        self.responses: dict[int, Response] = {}
        self.by_item: dict[str, Response] = {}
        self.user_items: dict[int, str] = {}
        self.last_item: str | None = None
        self.playback: Playback | None = None
        self.llm: Any = None  # the session's LLM node: instructions go to its conversation
        self.observe = observe  # metrics callback: (name, value)
        self.closed = False
        self.calls: dict[str, ClientCall] = {}  # client tool calls by call_id
        self.answering: int | None = None  # the user turn the LLM answers now (a tool call belongs to it)
        self.asked: list[Response] = []  # response.create received, not yet begun by the source
        self._own_tools: dict[str, Any] | None = None  # the LLM's configured llm.tools

    def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        text = json.dumps({"event_id": new_id("event"), **event})
        try:
            self.loop.call_soon_threadsafe(self._out.put_nowait, text)
        except RuntimeError:  # the server's loop is gone: nobody to tell
            self.closed = True

    def put(self, item: Any) -> bool:
        """Hand a client event to the source thread; False if it is too far behind."""
        try:
            self.inbox.put_nowait(item)
            return True
        except queue.Full:
            return False

    def close_input(self) -> None:
        """No more client events: the source's produce() returns (room is made if needed)."""
        while True:
            try:
                self.inbox.put_nowait(None)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.inbox.get_nowait()

    def user_item(self, turn: int) -> str:
        with self.lock:
            return self.user_items.setdefault(turn, new_id("item"))

    def add_item(self, item_id: str) -> str | None:
        """Append an item to the conversation; returns the previous item's id."""
        with self.lock:
            previous, self.last_item = self.last_item, item_id
            return previous

    def response(self, turn: int, create: bool = True) -> Response | None:
        """The response answering ``turn``; a new one (``response.created`` sent) if none yet."""
        with self.lock:
            resp = self.responses.get(turn)
            if resp is not None or not create:
                return resp
            resp = self.responses[turn] = Response(new_id("resp"), turn, list(self.config.output_modalities))
            self.by_item[resp.item_id] = resp
        self.send({"type": "response.created", "response": resp.as_response("in_progress", output=False)})
        return resp

    def begin(self, turn: int, resp: Response) -> None:
        """A response asked for with ``response.create`` answers ``turn``."""
        with self.lock:
            resp.turn = turn
            self.answering = turn
            if resp in self.asked:
                self.asked.remove(resp)
            self.responses[turn] = resp
            self.by_item[resp.item_id] = resp
        self.send({"type": "response.created", "response": resp.as_response("in_progress", output=False)})

    def active(self) -> list[Response]:
        """Responses under way, and those asked for that the source has not begun yet."""
        with self.lock:
            return [r for r in self.responses.values() if not r.done] + list(self.asked)

    # -- client tools -----------------------------------------------------------------

    def set_tools(self, tools: Any, choice: Any) -> None:
        """``session.tools``: the client's functions join the LLM's toolbox; a call goes to the
        client (function-call events) and waits for its ``function_call_output`` + ``response.create``."""
        toolbox = getattr(self.llm, "toolbox", None)
        if toolbox is None:
            raise ProtocolError("unsupported_value", "the chosen llm backend takes no tools", param="session.tools")
        from nodes.llm._tools import NAME, TOOL_CHOICES, Tool

        client = {}
        for i, spec in enumerate(tools if tools is not None else []):
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or spec.get("type", "function") != "function" or not isinstance(name, str) \
                    or not NAME.match(name) or not isinstance(spec.get("parameters", {}), dict):
                raise ProtocolError("invalid_value", "a tool is {'type': 'function', 'name': <letters, digits, _ or "
                                    "->, 'description': ..., 'parameters': <JSON schema>}", param=f"session.tools[{i}]")
            client[name] = Tool(name, str(spec.get("description") or ""),
                                spec.get("parameters") or {"type": "object", "properties": {}},
                                func=lambda _name=name, **arguments: self._call_client(_name, arguments),
                                path="the realtime client")
        if isinstance(choice, dict):
            choice = choice.get("name")
        if self._own_tools is None:
            self._own_tools = dict(toolbox.tools)
        merged = {**self._own_tools, **client}
        if choice is not None and choice not in TOOL_CHOICES and choice not in merged:
            raise ProtocolError("invalid_value", f"tool_choice={choice!r} is neither auto, none, required nor a "
                                "declared tool", param="session.tool_choice")
        toolbox.tools = merged
        if choice is not None:
            toolbox.choice = choice

    def _call_client(self, name: str, arguments: dict[str, Any]) -> str:
        """Runs on one of the LLM's tool threads (one per call of the round): the first to arrive
        sends every client call of the round in one response; each waits for its output."""
        text = json.dumps(arguments)
        with self.lock:  # looked up and registered at once: the round's calls arrive together
            turn = self.answering
            mine = self._waiting(turn, name, text)
            fresh = []
            if mine is None and turn is not None:
                for n, a in self._round_calls(name, text):
                    if self._waiting(turn, n, a) is None:
                        call = ClientCall(new_id("call"), n, a, turn)
                        self.calls[call.call_id] = call
                        fresh.append(call)
                mine = self._waiting(turn, name, text)
        if mine is None or turn is None:
            return "error: no turn is being answered"
        if fresh:
            self._announce(turn, fresh)
        mine.answered.wait()
        return mine.output or ""

    def _waiting(self, turn: int | None, name: str, arguments: str) -> ClientCall | None:
        return next((c for c in self.calls.values() if (c.turn, c.name, c.arguments) == (turn, name, arguments)
                     and not c.answered.is_set()), None)

    def _round_calls(self, name: str, text: str) -> list[tuple[str, str]]:
        """The distinct client calls of the LLM's current round (the model may write one twice)."""
        found = [(name, text)]
        try:
            calls = self.llm.conversation.exchanges[-1].rounds[-1].calls
        except (AttributeError, IndexError):
            return found
        client = set(self.llm.toolbox.tools) - set(self._own_tools or ())
        for call in calls:
            arguments = call.parsed_arguments()
            if call.name in client and isinstance(arguments, dict):
                key = (call.name, json.dumps(arguments))
                if key not in found:
                    found.append(key)
        return found

    def _announce(self, turn: int, calls: list[ClientCall]) -> None:
        """One response that ends with the calls (``response.done``): the client answers them."""
        resp = self.response(turn)
        assert resp is not None
        if resp.done:  # a later round of the same turn: a response of its own
            resp = Response(new_id("resp"), turn, list(self.config.output_modalities))
            self.begin(turn, resp)
        with self.lock:
            resp.done = True
        done = resp.as_response("completed", output=resp.started)
        for index, call in enumerate(calls, start=len(done["output"])):
            item = {"id": call.item_id, "object": "realtime.item", "type": "function_call", "status": "completed",
                    "name": call.name, "call_id": call.call_id, "arguments": call.arguments}
            ids = {"response_id": resp.id, "output_index": index}
            self.send({"type": "response.output_item.added", **ids, "item": {**item, "status": "in_progress",
                                                                              "arguments": ""}})
            self.send({"type": "conversation.item.added", "previous_item_id": self.add_item(call.item_id),
                       "item": item})
            parts = {**ids, "item_id": call.item_id, "call_id": call.call_id}
            self.send({"type": "response.function_call_arguments.delta", **parts, "delta": call.arguments})
            self.send({"type": "response.function_call_arguments.done", **parts, "name": call.name,
                       "arguments": call.arguments})
            self.send({"type": "response.output_item.done", **ids, "item": item})
            self.send({"type": "conversation.item.done", "previous_item_id": None, "item": item})
            done["output"].append(item)
        self.send({"type": "response.done", "response": done})

    def waiting_calls(self) -> list[ClientCall]:
        with self.lock:
            return [c for c in self.calls.values() if c.output is not None and not c.answered.is_set()]

    def release_calls(self, output: str | None = None) -> None:
        """The client answered (``response.create``), or left: every waiting call returns."""
        with self.lock:
            calls = [c for c in self.calls.values() if not c.answered.is_set()]
        for call in calls:
            if output is not None and call.output is None:
                call.output = output
            if call.output is not None:
                call.answered.set()

    def set_instructions(self, text: str | None) -> None:
        conversation = getattr(self.llm, "conversation", None)
        if conversation is not None:
            conversation.system_prompt = text or None


def _check_rate(rate: int) -> None:
    if rate not in (8000, 16000):
        raise ConfigError(f"io.rate={rate}: the pipeline runs at the VAD's rate, 16000 (or 8000)")


class RealtimeSource(Node):
    """A session's input: client audio as AudioChunks, typed-in messages as Transcripts.

    The source also carries the server's settings (it is what ``s2s-run`` serves with):
    host, port, key, limits. They are checked here, at compose time.
    """

    outputs = {"audio": AudioChunk, "text": Transcript}
    joins = frozenset({"text"})
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

    def produce(self) -> Iterator[Message]:
        session = self.session
        assert session is not None, "the server binds a session before the graph runs"
        chunk = self.rate * self.chunk_ms // 1000
        pending = np.zeros(0, np.float32)
        pos, rate, resample = 0, None, None
        while not self.ctx.stopping.is_set():
            item = session.inbox.get()
            if item is None:
                return
            kind = item[0]
            if kind == "audio":
                _, raw, in_rate, t = item
                if in_rate != rate:
                    rate, resample = in_rate, StreamResampler(in_rate, self.rate)
                pcm = resample(to_float32(np.frombuffer(raw, "<i2")))
                pending = np.concatenate([pending, pcm]) if len(pending) else pcm
                while len(pending) >= chunk:  # stamped as if each arrived in real time
                    piece, pending = pending[:chunk], pending[chunk:]
                    yield AudioChunk(pcm=piece, rate=self.rate, start=pos / self.rate,
                                     t=t - len(pending) / self.rate)
                    pos += chunk
            elif kind == "clear":
                pending, rate = np.zeros(0, np.float32), None
            elif kind == "respond":
                _, text, resp = item
                turn = self.ctx.new_turn()
                session.begin(turn, resp)
                yield ("text", Transcript(turn=turn, text=text))
            elif kind == "cancel":
                for resp in session.active():
                    if not resp.turn:
                        continue  # asked for after the cancel: it goes ahead
                    resp.cancel_reason = "client_cancelled"
                    self.ctx.interrupt(resp.turn + 1, "response.cancel")

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

    def setup(self) -> None:
        assert self.session is not None, "the server binds a session before the graph runs"
        self.session.playback = playback_of(self.ctx)

    def process(self, port: str, msg: Message) -> None:
        assert self.session is not None
        handle = {"started": self._started, "speech": self._speech, "user": self._transcript,
                  "partial": self._delta, "agent": self._text, "audio": self._audio}[port]
        handle(self.session, msg)  # type: ignore[operator]

    # -- the user's side ---------------------------------------------------------------

    def _started(self, session: Session, msg: SpeechStarted) -> None:
        item_id = session.user_item(msg.turn)
        session.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": round(msg.start * 1000),
                      "item_id": item_id})
        detection = session.config.turn_detection or {}
        with self._lock:
            busy = any(t < msg.turn for t in self._open_turns)
            self._open_turns.add(msg.turn)  # a user turn is under way: its reply will follow
        if busy and detection.get("interrupt_response", True):
            self.ctx.interrupt(msg.turn, "barge-in")

    def _speech(self, session: Session, msg: Speech) -> None:
        item_id = session.user_item(msg.turn)
        with self._lock:
            self._open_turns.add(msg.turn)
            self._speech_end[msg.turn] = msg.speech_end_t
        session.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": round(msg.end * 1000),
                      "item_id": item_id})
        previous = session.add_item(item_id)
        session.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "completed")
        session.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})

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
        if not msg.final:
            return
        item_id = session.user_item(msg.turn)
        base = {"item_id": item_id, "content_index": 0}
        said = self._said.pop(msg.turn, "")
        rest = msg.text[len(said):] if msg.text.startswith(said) else ""
        if rest:
            session.send({"type": "conversation.item.input_audio_transcription.delta", **base, "delta": rest})
        session.send({"type": "conversation.item.input_audio_transcription.completed", **base,
                      "transcript": msg.text, "usage": None})
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": msg.text}], "completed")
        session.send({"type": "conversation.item.done", "previous_item_id": None, "item": item})
        if not msg.text:
            with self._lock:
                self._open_turns.discard(msg.turn)  # nothing to answer
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
                resp.speech_end_t = self._speech_end.get(turn)
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
