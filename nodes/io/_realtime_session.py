"""A Realtime session: the bridge between one connection's asyncio side and its graph's threads.

It holds what the protocol knows of the conversation (items, responses, client tool calls, user
messages waiting for ``response.create``). It is also the session its graph's nodes ask through
``ctx.session`` (the node contract's ``SessionHooks``): which user turns the LLM answers by
themselves (not the ``holds`` ones), which replies are spoken (responses with audio), and what the
LLM sees of its history (deleted items left out, a response's own instructions).
nodes/io/realtime.py's source and sink, and the server in nodes/io/_realtime_app.py, share one
Session per connection.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nodes._playback import Playback
from nodes.io._realtime_events import ProtocolError, SessionConfig, error_event, message_item, new_id
from nodes.llm._conversation import Exchange
from s2s_flow.messages import Speech
from s2s_flow.node import SessionHooks

__all__ = ["Session", "Response", "Pending", "ClientCall"]

_INBOX = 512  # client events waiting for the source thread (20 ms of audio each, typically)
_REMEMBERED_TURNS = 256  # per-turn bookkeeping kept for the most recent turns only
#: the voices of OpenAI's Realtime API: a stock client sends one; they stand for the server's own voice
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")


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
    instructions: str | None = None  # response.create's: the system prompt of this response only
    inputs: list[Pending] = field(default_factory=list)  # the user messages it answers (response.create)
    dispatched: bool = False  # handed to the source, which begins it

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
class Pending:
    """A user message waiting for ``response.create``: typed text, or a spoken turn that is not
    answered by itself (``create_response: false``, manual turns), whose transcript may still
    be on its way from the STT."""

    item_id: str
    turn: int = 0  # the spoken turn it is (0: typed)
    text: str | None = None
    speech: Speech | None = None  # the audio itself, when the LLM hears audio (stt=none)
    ready: bool = False


@dataclass
class ClientCall:
    """A call of a client-declared tool, waiting for the client's ``function_call_output``."""

    call_id: str
    name: str
    arguments: str
    turn: int
    item_id: str = field(default_factory=lambda: new_id("item"))
    output: str | None = None
    output_item: str | None = None  # the client's function_call_output item
    answered: threading.Event = field(default_factory=threading.Event)


class Session(SessionHooks):
    """One connection's bridge between the asyncio server and the graph's threads (thread-safe).

    ``send`` hands a server event to the connection (``emit``: thread-safe, bounded by the
    connection); ``inbox`` carries what the client sent to the source's thread.
    """

    def __init__(self, emit: Callable[[str], None], config: SessionConfig, observe: Any = None) -> None:
        self.id = new_id("sess")
        self._emit, self.config = emit, config
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=_INBOX)
        self.lock = threading.Lock()
        self.responses: dict[int, Response] = {}
        self.by_item: dict[str, Response] = {}
        self.user_items: dict[int, str] = {}
        self.items: list[str] = []  # the conversation's items in order (previous_item_id)
        self.playback: Playback | None = None
        self.llm: Any = None  # the session's LLM node: instructions go to its conversation
        self.vad: Any = None  # the session's VAD node: turn_detection's numbers go to it
        self.tts: Any = None  # the session's TTS node: session.update's voice goes to it
        self.hears_audio = False  # the LLM takes the user's audio itself (stt=none)
        self.observe = observe  # metrics callback: (name, value)
        self.closed = False
        self.calls: dict[str, ClientCall] = {}  # client tool calls by call_id
        self.answering: int | None = None  # the user turn the LLM answers now (a tool call belongs to it)
        self.asked: list[Response] = []  # response.create received, not yet begun by the source
        self.pending: list[Pending] = []  # user messages that wait for response.create
        self.deleted: set[str] = set()  # conversation.item.delete: items the LLM no longer sees
        self.turn_items: dict[int, list[tuple[str, str | None]]] = {}  # LLM turn -> its user items
        self._holds: dict[int, bool] = {}
        self._own_tools: dict[str, Any] | None = None  # the LLM's configured llm.tools

    def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        self._emit(json.dumps({"event_id": new_id("event"), **event}))

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

    def continue_item(self, turn: int, continues: int) -> str:
        """A turn that goes on with a withdrawn speculative one is the same user item."""
        with self.lock:
            item_id = self.user_items.setdefault(continues, new_id("item"))
            self.user_items[turn] = item_id
            if continues in self._holds:
                self._holds.setdefault(turn, self._holds[continues])
            return item_id

    def add_item(self, item_id: str) -> str | None:
        """Append an item to the conversation; returns the previous item's id."""
        with self.lock:
            previous = self.items[-1] if self.items else None
            self.items.append(item_id)
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
            if resp.inputs:
                self.turn_items[turn] = [(p.item_id, None if p.speech is not None and not p.text else p.text or "")
                                         for p in resp.inputs]
        self.send({"type": "response.created", "response": resp.as_response("in_progress", output=False)})

    def active(self) -> list[Response]:
        """Responses under way, and those asked for that the source has not begun yet."""
        with self.lock:
            return [r for r in self.responses.values() if not r.done] + list(self.asked)

    # -- which user turns start a reply ---------------------------------------------------

    def holds(self, turn: int) -> bool:
        """Whether the spoken ``turn`` waits for ``response.create`` (manual turns, or
        ``create_response: false``) rather than being answered by itself. Decided once per
        turn, by whoever asks first (the sink at its start, the LLM at its transcript; a
        commit decides its own turn)."""
        with self.lock:
            held = self._holds.get(turn)
            if held is None:
                held = self._holds[turn] = turn not in self.responses and not self.config.auto_response
                for old in list(self._holds)[: -_REMEMBERED_TURNS]:
                    del self._holds[old]
            return held

    def hold(self, turn: int, item_id: str, *, text: str | None = None, speech: Speech | None = None) -> None:
        """A held turn waits in ``pending`` for ``response.create`` from its end on; it is ready once
        its transcript is in (``text``), or at once with its audio for an LLM that hears audio."""
        ready = text is not None or (speech is not None and self.hears_audio)
        with self.lock:
            entry = next((p for p in self.pending + [q for r in self.asked for q in r.inputs] if p.turn == turn), None)
            if entry is None:
                self.pending.append(Pending(item_id, turn, text, speech if self.hears_audio else None, ready))
            else:
                entry.text = text if text is not None else entry.text
                entry.ready = entry.ready or ready
        self.dispatch()

    def ask(self, resp: Response) -> None:
        """``response.create``: answer every user message waiting now, once all are transcribed."""
        with self.lock:
            resp.inputs, self.pending = self.pending, []
            self.asked.append(resp)
        self.dispatch()

    def dispatch(self) -> None:
        """Hand the source every asked-for response whose user messages are all in (in order)."""
        with self.lock:
            ready = []
            for resp in self.asked:
                if resp.dispatched or not all(p.ready for p in resp.inputs):
                    break  # one at a time, in the order asked
                resp.dispatched = True
                ready.append(resp)
        for resp in ready:
            if not self.put(("respond", resp)):
                with self.lock:
                    self.asked.remove(resp)
                self.send(error_event("input_overflow", "the server is behind on this session: the response "
                                      "was not started; send response.create again", type="server_error"))

    def forget_below(self, turn: int) -> None:
        """An interrupt made every turn before ``turn`` stale: their transcripts will not come."""
        with self.lock:
            for p in self.pending + [q for r in self.asked for q in r.inputs]:
                if p.turn and p.turn < turn and not p.ready:
                    p.ready = True
        self.dispatch()

    def commit(self, turn: int, speech: Speech) -> None:
        """``input_audio_buffer.commit`` (manual turns): the buffered audio is the user's turn."""
        with self.lock:
            self._holds[turn] = True
        item_id = self.user_item(turn)
        previous = self.add_item(item_id)
        self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], "completed")
        self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        self.hold(turn, item_id, speech=speech)

    def fail(self, resp: Response, code: str, message: str, kind: str = "invalid_request_error") -> None:
        """A response that cannot be made: ``response.done`` failed, with the reason."""
        with self.lock:
            resp.done = True
        details = {"type": "failed", "error": {"type": kind, "code": code, "message": message}}
        self.send({"type": "response.done", "response": resp.as_response("failed", details, output=False)})

    def fail_unfinished(self, message: str) -> None:
        """The session's graph failed: every response still being made ends failed, with the reason
        (before the error event and the close), so no client waits for a ``response.done``."""
        with self.lock:
            unfinished = [r for r in self.responses.values() if not r.done]
        for resp in unfinished:
            self.fail(resp, "server_error", message, kind="server_error")

    # -- the conversation the LLM sees ----------------------------------------------------

    def use_voice(self, name: str) -> str:
        """``session.update``'s voice: the session's TTS switches to it if it can; OpenAI's own voice
        names (which stock clients send) stand for the server's voice. Returns the voice spoken."""
        tts = self.tts
        if tts is None:  # nothing is spoken (a text-only graph)
            return name
        if tts.use_voice(name):
            return tts.voice_name
        if name.lower() in OPENAI_VOICES:
            return tts.voice_name
        raise ProtocolError("invalid_value", f"voice {name!r} is not one this server's TTS ({type(tts).__name__}) "
                            f"can speak with: it speaks with {tts.voice_name!r}, for which OpenAI's voice names "
                            f"({', '.join(OPENAI_VOICES)}) also stand; another voice is chosen with tts.voice "
                            "when the server starts", param="session.audio.output.voice")

    # -- what the session's nodes ask (ctx.session) -----------------------------------------

    def answers(self, turn: int) -> bool:
        """The LLM answers a user turn by itself unless the session holds it for ``response.create``
        (it is then answered as a turn of its own)."""
        return not self.holds(turn)

    def speaks(self, turn: int) -> bool:
        """Whether the reply to ``turn`` has audio: its response's modalities, or the session's
        for a reply whose response the sink has not made yet."""
        with self.lock:
            resp = self.responses.get(turn)
            return "audio" in (resp.modalities if resp is not None else self.config.output_modalities)

    def history(self, conversation: Any) -> Any:
        """A view of ``conversation`` for one request: deleted items left out, and the system
        prompt of the response being made (``response.create``'s instructions) if it has one."""
        with self.lock:
            deleted, turn_items, user_items = set(self.deleted), dict(self.turn_items), dict(self.user_items)
            no_reply = {r.turn for r in self.by_item.values() if r.item_id in deleted}
            exchanges = list(conversation.exchanges)
            answering = self.responses.get(exchanges[-1].turn) if exchanges else None
        view = copy.copy(conversation)
        if answering is not None and answering.instructions is not None:
            view.system_prompt = answering.instructions or None
        if not deleted:
            return view
        shown: list[Exchange] = []
        for i, ex in enumerate(exchanges):
            last = i == len(exchanges) - 1
            user, user_gone = _user_view(ex, turn_items.get(ex.turn), user_items.get(ex.turn), deleted)
            reply_gone = not last and ex.turn in no_reply
            if user is ex.user and not user_gone and not reply_gone:
                shown.append(ex)
                continue
            reply, rounds = ("", []) if reply_gone else (ex.reply, ex.rounds)
            if user_gone:  # a reply without its question stays, joined to the reply before it
                if shown and reply and not rounds and not last:
                    shown[-1] = replace(shown[-1], reply=f"{shown[-1].reply} {reply}".strip())
                continue
            shown.append(Exchange(user=user, turn=ex.turn, reply=reply, rounds=list(rounds)))
        view.exchanges = shown
        return view

    def delete(self, item_id: str) -> None:
        """``conversation.item.delete``: the item leaves the conversation the LLM sees."""
        with self.lock:
            if item_id not in self.items:
                raise ProtocolError("item_not_found", f"no item {item_id!r} in this conversation", param="item_id")
            if any(item_id in (c.item_id, c.output_item) for c in self.calls.values()):
                raise ProtocolError("unsupported_value", "function call items stay in the conversation: delete the "
                                    "assistant or user message around them instead", param="item_id")
            self.items.remove(item_id)
            self.deleted.add(item_id)
            self.pending = [p for p in self.pending if p.item_id != item_id]
            for resp in self.asked:
                if not resp.dispatched:
                    resp.inputs = [p for p in resp.inputs if p.item_id != item_id]
        self.send({"type": "conversation.item.deleted", "item_id": item_id})
        self.dispatch()

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


def _user_view(ex: Exchange, entries: list[tuple[str, str | None]] | None, item_id: str | None,
               deleted: set[str]) -> tuple[Any, bool]:
    """(user message, gone) of one exchange once the deleted items are left out: typed messages
    answered together lose only the deleted ones; audio goes as a whole."""
    if entries is None:
        return ex.user, item_id is not None and item_id in deleted
    kept = [(i, text) for i, text in entries if i not in deleted]
    if len(kept) == len(entries):
        return ex.user, False
    if not kept or any(text is None for _, text in entries) or not isinstance(ex.user, str):
        return ex.user, True
    text = "\n".join(t for _, t in kept if t)
    return text, not text
