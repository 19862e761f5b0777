"""A Realtime session: one connection's conversation and responses, shared by its asyncio side
(the transport, the client-event handlers) and its graph's threads (the source and the sink).

It owns what the protocol knows of the conversation: its items in order, the user messages that
wait for ``response.create``, deleted items, client tool calls. It owns every response's
lifecycle, and sends all of it from here: ``response.created``, the output item and its content
part added, the deltas, the part and the item done, ``response.done``. A response that ends
early (cancelled, cut by the user's speech, failed, or ended by tool calls) first closes every
part it opened.

The graph's nodes ask it through ``ctx.session`` (the node contract's ``SessionHooks``): which
user turns the LLM answers by itself, which replies are spoken, what the LLM sees of its history
(those hooks, and which user turns start a reply, are hooks.py's part of the class).
Its own nodes' settings (turn detection, voice, instructions, tools) it changes through
``nodes`` (node_settings.py) and ``tools`` (client_tools.py), by the node contract's interfaces.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nodes._playback import Playback
from nodes.io.realtime import protocol as events
from nodes.io.realtime.client_tools import ClientCall, ClientTools
from nodes.io.realtime.hooks import NodeHooks, trim
from nodes.io.realtime.node_settings import NodeSettings
from nodes.io.realtime.protocol import ProtocolError, SessionConfig, new_id
from nodes.io.realtime.response import Pending, Response
from s2s_flow.messages import Speech

__all__ = ["Session"]

_INBOX = 512  # client events waiting for the source thread (20 ms of audio each, typically)


class Session(NodeHooks):
    """One connection's conversation and responses (thread-safe: every change under ``lock``).

    ``send`` hands a server event to the connection (``emit``: thread-safe, bounded by the
    connection); ``inbox`` carries what the client sent to the source's thread.
    """

    def __init__(self, emit: Callable[[str], None], config: SessionConfig, observe: Any = None) -> None:
        self.id = new_id("sess")
        self.conversation_id = new_id("conv")
        self._emit, self.config = emit, config
        # SimpleQueue: its put and get are C, no Python Condition per hop (~50 hops a second a session)
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.RLock()  # also held while a response's events are sent: they keep their order
        self.responses: dict[int, Response] = {}
        self.by_item: dict[str, Response] = {}
        self.user_items: dict[int, str] = {}
        self.items: list[str] = []  # the conversation's items in order (previous_item_id)
        self.item_data: dict[str, dict[str, Any]] = {}  # each item as last sent (conversation.item.retrieve)
        self.playback: Playback | None = None
        self.observe = observe  # metrics callback: (name, value)
        self.closed = False
        self.tools = ClientTools(self.lock, lambda: self.answering, self.end_with_calls)
        self.nodes = NodeSettings(config, self.tools)  # the session's own VAD, TTS and LLM
        self.answering: int | None = None  # the user turn the LLM answers now (a tool call belongs to it)
        self.asked: list[Response] = []  # response.create received, not yet begun by the source
        self.pending: list[Pending] = []  # user messages that wait for response.create
        self.deleted: set[str] = set()  # conversation.item.delete: items the LLM no longer sees
        self.turn_items: dict[int, list[tuple[str, str | None, tuple[str, ...]]]] = {}  # LLM turn -> its user items
        self._holds: dict[int, bool] = {}
        self._replying: set[int] = set()  # user turns whose reply is not done (a barge-in cuts them)
        self._awaiting: set[int] = set()  # spoken turns committed, answered by themselves, no response yet
        self._unheard: set[int] = set()  # turns whose STT failed (maybe before the VAD's commit reached us)
        self._heard: dict[int, str] = {}  # per spoken turn: its transcript (a turn held late needs it)
        self._speech_end: dict[int, float] = {}  # per user turn: when its speech really ended
        self._seconds: dict[int, float] = {}  # per user turn: how long its audio is (the transcript's usage)
        self._usage: dict[int, dict[str, int]] = {}  # per turn: the LLM's token counts so far
        self.out_of_band: set[int] = set()  # turns of conversation "none" responses: later requests skip them

    # -- the connection ---------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        if event["type"] in ("conversation.item.added", "conversation.item.done"):
            with self.lock:  # the item as the client last heard of it: what a retrieve answers
                self.item_data[event["item"]["id"]] = event["item"]
        if self.closed:
            return
        self._emit(events.encode(event))

    def put(self, item: Any) -> bool:
        """Hand a client event to the source thread; False if it is too far behind."""
        if self.inbox.qsize() >= _INBOX:  # a bound on lag: two puts at once may pass it by one
            return False
        self.inbox.put_nowait(item)
        return True

    def close_input(self) -> None:
        """No more client events: the source's produce() returns (after what came before)."""
        self.inbox.put_nowait(None)

    # -- the conversation's items -------------------------------------------------------------

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

    def user_audio(self, turn: int, speech: Speech) -> str:
        """The VAD ended a user turn: its audio is committed as the user's item."""
        item_id = self.user_item(turn)
        end_s = speech.end
        with self.lock:
            self._speech_end[turn] = speech.speech_end_t
            self._seconds[turn] = speech.end - speech.start
            trim(self._speech_end, self._seconds)
            if not self.holds(turn) and turn not in self.responses and turn not in self._unheard:
                self._awaiting.add(turn)  # its reply is on its way: a response.create now is refused
        self.send(events.speech_stopped(item_id, round(end_s * 1000)))
        self._committed(item_id)
        return item_id

    def commit(self, turn: int, speech: Speech) -> None:
        """``input_audio_buffer.commit`` (manual turns): the buffered audio is the user's turn."""
        with self.lock:
            self._holds[turn] = True
            self._seconds[turn] = len(speech.pcm) / speech.rate
        item_id = self.user_item(turn)
        self._committed(item_id)
        self.hold(turn, item_id, speech=speech)

    def _committed(self, item_id: str) -> None:
        previous = self.add_item(item_id)
        self.send(events.audio_committed(item_id, previous))
        self.send(events.item_added(events.user_audio_item(item_id), previous))

    def transcribed(self, turn: int, text: str, rest: str) -> None:
        """A spoken turn's final transcript (``rest``: the words no delta has sent yet). The LLM
        answers it now, unless it has no words or the session holds it for ``response.create``."""
        item_id = self.user_item(turn)
        held = self.holds(turn)
        if held:  # before the client hears of it: a response.create may follow at once
            self.hold(turn, item_id, text=text)
        if rest:
            self.send(events.transcription_delta(item_id, rest))
        with self.lock:
            seconds = self._seconds.pop(turn, 0.0)
        self.send(events.transcription_completed(item_id, text, seconds))
        self.send(events.item_done(events.user_audio_item(item_id, text)))
        with self.lock:
            self._heard[turn] = text
            trim(self._heard)
            if not text or held or self._holds.get(turn):
                self._replying.discard(turn)  # nothing to answer, or not now
                self._awaiting.discard(turn)
            elif not (turn in self.responses and self.responses[turn].done):
                # a reply released at a speculative turn's confirmation may be done already: the
                # transcript comes after it then (the protocol allows either order)
                self.answering = turn

    def user_text(self, item_id: str, text: str, images: Sequence[str] = ()) -> None:
        """``conversation.item.create`` of a user message (its words, its images' URLs): it waits for
        ``response.create``."""
        previous = self.add_item(item_id)
        with self.lock:
            self.pending.append(Pending(item_id, text=text, ready=True, images=list(images)))
        item = events.user_text_item(item_id, text, images)
        self.send(events.item_added(item, previous))
        self.send(events.item_done(item, previous))

    def tool_output(self, call_id: Any, output: Any, item_id: str) -> None:
        """A client's ``function_call_output``: the call's result, and an item of the conversation."""
        call = self.tools.answer(call_id, output, item_id)
        item = events.function_call_output_item(item_id, call.call_id, call.output or "")
        previous = self.add_item(item_id)
        self.send(events.item_added(item, previous))
        self.send(events.item_done(item, previous))

    def retrieve(self, item_id: str) -> None:
        """``conversation.item.retrieve``: the item as the client last heard of it."""
        with self.lock:
            item = self.item_data.get(item_id) if item_id in self.items else None
        if item is None:
            raise ProtocolError("item_not_found", f"no item {item_id!r} in this conversation", param="item_id")
        self.send(events.item_retrieved(item))

    def delete(self, item_id: str) -> None:
        """``conversation.item.delete``: the item leaves the conversation the LLM sees."""
        with self.lock:
            if item_id not in self.items:
                raise ProtocolError("item_not_found", f"no item {item_id!r} in this conversation", param="item_id")
            if self.tools.owns(item_id):
                raise ProtocolError("unsupported_value", "function call items stay in the conversation: delete the "
                                    "assistant or user message around them instead", param="item_id")
            self.items.remove(item_id)
            self.item_data.pop(item_id, None)
            self.deleted.add(item_id)
            self.pending = [q for q in self.pending if q.item_id != item_id]
            for resp in self.asked:
                if not resp.dispatched:
                    resp.inputs = [q for q in resp.inputs if q.item_id != item_id]
        self.send(events.item_deleted(item_id))
        self.dispatch()

    def truncate(self, item_id: Any, end_ms: Any) -> None:
        """``conversation.item.truncate``: the client played the reply up to ``end_ms``; the LLM's
        history keeps the sentences whose audio began before it."""
        resp = self.by_item.get(item_id) if isinstance(item_id, str) else None
        if resp is None:
            raise ProtocolError("item_not_found", f"no assistant item {item_id!r} in this conversation",
                                param="item_id")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise ProtocolError("invalid_value", "audio_end_ms must be a whole number of milliseconds >= 0",
                                param="audio_end_ms")
        if end_ms > resp.audio_ms + 1:
            raise ProtocolError("invalid_value", f"audio_end_ms={end_ms} is past the {resp.audio_ms:.0f} ms of "
                                "audio sent for this item", param="audio_end_ms")
        if self.playback is not None:
            self.playback.set_heard(resp.turn, resp.heard(end_ms), played_s=end_ms / 1000, t=time.monotonic())
        self.send(events.item_truncated(resp.item_id, end_ms))

    # -- a response's lifecycle ---------------------------------------------------------------

    def response(self, turn: int) -> Response:
        """The response answering ``turn``; a new one (``response.created`` sent) if none yet."""
        with self.lock:
            resp = self.responses.get(turn)
            if resp is None:
                self._awaiting.discard(turn)
                resp = self.responses[turn] = Response(new_id("resp"), turn, list(self.config.output_modalities),
                                                       conversation_id=self.conversation_id)
                self.by_item[resp.item_id] = resp
                self.send(events.response_created(resp.as_response("in_progress")))
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
                self.turn_items[turn] = [(q.item_id, None if q.speech is not None and not q.text else q.text or "",
                                          tuple(q.images)) for q in resp.inputs]
            self.send(events.response_created(resp.as_response("in_progress")))

    def active(self) -> bool:
        """Whether a response is under way, asked for and not begun yet, or on its way for a spoken
        turn the VAD committed (one response at a time, as OpenAI's server keeps it)."""
        with self.lock:
            return bool(self._awaiting or self.asked or any(not r.done for r in self.responses.values()))

    def output(self, turn: int, epoch: int) -> Response | None:
        """The response answering ``turn`` with its output open (its item and content part added,
        once); None once it is done or ``turn`` is stale (below ``epoch``)."""
        with self.lock:
            if turn < epoch:
                return None
            resp = self.response(turn)
            if resp.done:
                return None
            if resp.speech_end_t is None:
                resp.speech_end_t = self._speech_end.pop(turn, None)
            self._replying.add(turn)
            if not resp.started:
                resp.started = True
                self.send(events.output_item_added(resp.id, 0, resp.as_item("in_progress")))
                if not resp.out_of_band:  # conversation "none": the item is the response's only
                    self.send(events.item_added(resp.as_item("in_progress"), self.add_item(resp.item_id)))
                ids = events.part_ids(resp.id, resp.item_id)
                self.send(events.content_part_added(ids, events.content_part(resp.audio, "")))
            return resp

    def reply_text(self, resp: Response, text: str, *, last: bool, audio_follows: bool) -> None:
        """The reply's words: the transcript of its audio, or its text; ``last`` ends them (and the
        response, unless its audio is still to come: ``audio_follows``, the graph's TTS speaks it)."""
        with self.lock:
            if resp.done:
                return
            if text:
                resp.text += text
                ids = events.part_ids(resp.id, resp.item_id)
                delta = events.output_audio_transcript_delta if resp.audio else events.output_text_delta
                self.send(delta(ids, text))
            if last:
                resp.text_done = True
                if resp.audio_done or not (resp.audio and audio_follows):
                    self._end(resp, "completed")

    def reply_audio(self, resp: Response, pcm: np.ndarray, sentence: str | None, *, last: bool) -> None:
        """The reply's audio at the session's output rate (``sentence``: the text it speaks); ``last``
        ends it (a text-only response's too: the TTS passes its end on)."""
        with self.lock:
            if resp.done:
                return
            if len(pcm) and resp.audio:
                if sentence and (not resp.sentences or resp.sentences[-1][1] != sentence):
                    resp.sentences.append((resp.audio_ms, sentence))
                data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
                self.send(events.output_audio_delta(events.part_ids(resp.id, resp.item_id), data, self.config))
                resp.audio_ms += 1000 * len(pcm) / self.config.output_rate
                if not resp.first_audio:
                    resp.first_audio = True
                    if resp.speech_end_t is not None and self.observe is not None:
                        self.observe("voice_to_voice_s", time.monotonic() - resp.speech_end_t)
            if last:
                resp.audio_done = True
                if resp.text_done:  # the words may come after the audio (another port): both end it
                    self._end(resp, "completed")

    def cut_below(self, turn: int) -> None:
        """An interrupt: every reply before ``turn`` ends cancelled (no more audio), and the history
        keeps what was sent of it (until the client truncates it to what it played)."""
        now = time.monotonic()
        self.forget_below(turn)
        with self.lock:
            self._replying = {t for t in self._replying if t >= turn}
            self._awaiting = {t for t in self._awaiting if t >= turn}
            # not the ones asked for and not begun yet (turn 0): they answer later messages
            for resp in [r for r in self.responses.values() if not r.done and r.turn < turn]:
                if self.playback is not None:
                    self.playback.set_heard(resp.turn, resp.heard(), played_s=resp.audio_ms / 1000, t=now)
                self._end(resp, "cancelled", {"type": "cancelled", "reason": resp.cancel_reason})

    def cancel_asked(self) -> None:
        """``response.cancel`` of the responses asked for that still wait for their transcripts:
        they never start. (The source cuts the ones begun: ``cancel_begun``.)"""
        with self.lock:
            waiting = [r for r in self.asked if not r.dispatched]
            for resp in waiting:
                self.asked.remove(resp)
                self.send(events.response_created(resp.as_response("in_progress")))
                self._end(resp, "cancelled", {"type": "cancelled", "reason": "client_cancelled"})

    def cancel_begun(self) -> list[int]:
        """``response.cancel``, in order with the client's other events: the turns of the responses
        under way, to interrupt (their ``response.done`` says the client cancelled them)."""
        with self.lock:
            for turn in list(self._awaiting):  # a spoken turn's reply on its way: it is cancelled too
                self.response(turn)
            begun = [r for r in self.responses.values() if not r.done and r.turn]
            for resp in begun:
                resp.cancel_reason = "client_cancelled"
            return [r.turn for r in begun]

    def fail(self, resp: Response, code: str, message: str, kind: str = "invalid_request_error") -> None:
        """A response that cannot be made: ``response.done`` failed, with the reason."""
        self._end(resp, "failed", {"type": "failed", "error": {"type": kind, "code": code, "message": message}})

    def fail_turn(self, turn: int, epoch: int, message: str) -> None:
        """The reply to ``turn`` broke off (its LLM failed): its response ends failed, with the reason."""
        with self.lock:
            if turn >= epoch:
                self.fail(self.response(turn), "server_error", message, kind="server_error")

    def fail_unfinished(self, message: str) -> None:
        """The session's graph failed: every response still being made ends failed, with the reason
        (before the error event and the close), so no client waits for a ``response.done``."""
        with self.lock:
            for resp in [r for r in self.responses.values() if not r.done]:
                self.fail(resp, "server_error", message, kind="server_error")

    def stage_failed(self, stage: str, turn: int, message: str) -> None:
        """The session goes on: an ``error`` (``<stage>_failed``); an STT's item: transcription failed."""
        if stage == "stt" and (item_id := self.user_items.get(turn)) is not None:
            with self.lock:
                self._replying.discard(turn)  # no reply is waited for, nor refuses a response.create
                self._awaiting.discard(turn)
                self._unheard = {t for t in self._unheard if t > turn - 16} | {turn}  # a commit still on its way
            self.send(events.transcription_failed(item_id, message))
        if self.observe is not None:
            self.observe("stage_failed", stage)
        self.send(events.error(f"{stage}_failed", message, type="server_error"))

    def end_with_calls(self, turn: int, calls: list[ClientCall]) -> None:
        """The LLM called client tools: one response that ends with the calls (the client answers
        them, then asks for the next response)."""
        with self.lock:
            resp = self.response(turn)
            if resp.done:  # a later round of the same turn: a response of its own
                resp = Response(new_id("resp"), turn, list(self.config.output_modalities),
                                conversation_id=self.conversation_id)
                self.begin(turn, resp)
            self._end(resp, "completed", calls=calls)

    def _end(self, resp: Response, status: str, details: dict[str, Any] | None = None,
             calls: Sequence[ClientCall] = ()) -> None:
        """The one place a response ends: its open parts done, its calls, ``response.done``."""
        with self.lock:
            if resp.done:
                return
            resp.done = True
            self._awaiting.discard(resp.turn)
            resp.usage = events.response_usage(self._usage.pop(resp.turn, None))
            if resp.out_of_band:
                self.out_of_band.add(resp.turn)
            if not calls:  # with calls the turn goes on (after the client's outputs): speech still cuts it
                self._replying.discard(resp.turn)
            output = []
            if resp.started:  # close what was opened, in order: the part, then the item
                ids, item = events.part_ids(resp.id, resp.item_id), resp.as_item(
                    "completed" if status == "completed" else "incomplete")
                if resp.audio:
                    self.send(events.output_audio_done(ids))
                    self.send(events.output_audio_transcript_done(ids, resp.text))
                else:
                    self.send(events.output_text_done(ids, resp.text))
                self.send(events.content_part_done(ids, events.content_part(resp.audio, resp.text)))
                self.send(events.output_item_done(resp.id, 0, item))
                if not resp.out_of_band:
                    self.send(events.item_done(item))
                output.append(item)
            for index, call in enumerate(calls, start=len(output)):
                where = (resp.id, index, call.item_id, call.call_id)
                item = events.function_call_item(call.item_id, call.call_id, call.name, call.arguments)
                self.send(events.output_item_added(resp.id, index, events.function_call_item(
                    call.item_id, call.call_id, call.name, "", "in_progress")))
                self.send(events.item_added(item, self.add_item(call.item_id)))
                self.send(events.function_call_arguments_delta(*where, call.arguments))
                self.send(events.function_call_arguments_done(*where, call.name, call.arguments))
                self.send(events.output_item_done(resp.id, index, item))
                self.send(events.item_done(item))
                output.append(item)
            if status == "completed" and not calls and self.observe is not None:
                self.observe("turn", 1)  # counted before the client hears of it: /metrics agrees with it
            self.send(events.response_done(resp.as_response(status, details, output)))
