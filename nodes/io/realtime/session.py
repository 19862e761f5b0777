"""A Realtime session: one connection's conversation and responses, shared by its asyncio side
(the transport, the client-event handlers) and its graph's threads (the source and the sink).

It owns what the protocol knows of the conversation: its items in order, the user messages that
wait for ``response.create``, deleted items, client tool calls. It owns every response's
lifecycle, and sends all of it from here: ``response.created``, the output item and its content
part added, the deltas, the part and the item done, ``response.done``. A response that ends
early (cancelled, cut by the user's speech, failed, or ended by tool calls) first closes every
part it opened.

The graph's nodes ask it through ``ctx.session`` (the node contract's ``SessionHooks``): which
user turns the LLM answers by itself, which replies are spoken, what the LLM sees of its history.
Its own nodes' settings (turn detection, voice, instructions, tools) it changes through
``nodes`` (node_settings.py) and ``tools`` (client_tools.py), by the node contract's interfaces.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nodes._playback import Playback
from nodes.io.realtime import protocol as events
from nodes.io.realtime.client_tools import ClientCall, ClientTools
from nodes.io.realtime.history import conversation_view
from nodes.io.realtime.node_settings import NodeSettings
from nodes.io.realtime.protocol import ProtocolError, SessionConfig, new_id
from nodes.io.realtime.response import Pending, Response
from s2s_flow.messages import Speech
from s2s_flow.node import SessionHooks

__all__ = ["Session"]

_INBOX = 512  # client events waiting for the source thread (20 ms of audio each, typically)
_REMEMBERED_TURNS = 256  # per-turn bookkeeping kept for the most recent turns only


class Session(SessionHooks):
    """One connection's conversation and responses (thread-safe: every change under ``lock``).

    ``send`` hands a server event to the connection (``emit``: thread-safe, bounded by the
    connection); ``inbox`` carries what the client sent to the source's thread.
    """

    def __init__(self, emit: Callable[[str], None], config: SessionConfig, observe: Any = None) -> None:
        self.id = new_id("sess")
        self._emit, self.config = emit, config
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=_INBOX)
        self.lock = threading.RLock()  # also held while a response's events are sent: they keep their order
        self.responses: dict[int, Response] = {}
        self.by_item: dict[str, Response] = {}
        self.user_items: dict[int, str] = {}
        self.items: list[str] = []  # the conversation's items in order (previous_item_id)
        self.playback: Playback | None = None
        self.observe = observe  # metrics callback: (name, value)
        self.closed = False
        self.tools = ClientTools(self.lock, lambda: self.answering, self.end_with_calls)
        self.nodes = NodeSettings(config, self.tools)  # the session's own VAD, TTS and LLM
        self.answering: int | None = None  # the user turn the LLM answers now (a tool call belongs to it)
        self.asked: list[Response] = []  # response.create received, not yet begun by the source
        self.pending: list[Pending] = []  # user messages that wait for response.create
        self.deleted: set[str] = set()  # conversation.item.delete: items the LLM no longer sees
        self.turn_items: dict[int, list[tuple[str, str | None]]] = {}  # LLM turn -> its user items
        self._holds: dict[int, bool] = {}
        self._replying: set[int] = set()  # user turns whose reply is not done (a barge-in cuts them)
        self._speech_end: dict[int, float] = {}  # per user turn: when its speech really ended

    # -- the connection ---------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        self._emit(events.encode(event))

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

    def user_audio(self, turn: int, end_s: float, speech_end_t: float) -> str:
        """The VAD ended a user turn: its audio is committed as the user's item."""
        item_id = self.user_item(turn)
        with self.lock:
            self._speech_end[turn] = speech_end_t
            for old in list(self._speech_end)[: -_REMEMBERED_TURNS]:
                del self._speech_end[old]
        self.send(events.speech_stopped(item_id, round(end_s * 1000)))
        self._committed(item_id)
        return item_id

    def commit(self, turn: int, speech: Speech) -> None:
        """``input_audio_buffer.commit`` (manual turns): the buffered audio is the user's turn."""
        with self.lock:
            self._holds[turn] = True
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
        self.send(events.transcription_completed(item_id, text))
        self.send(events.item_done(events.user_audio_item(item_id, text)))
        with self.lock:
            if not text or held:
                self._replying.discard(turn)  # nothing to answer, or not now
            else:
                self.answering = turn

    def user_text(self, item_id: str, text: str) -> None:
        """``conversation.item.create`` of a user message: it waits for ``response.create``."""
        previous = self.add_item(item_id)
        with self.lock:
            self.pending.append(Pending(item_id, text=text, ready=True))
        item = events.user_text_item(item_id, text)
        self.send(events.item_added(item, previous))
        self.send(events.item_done(item, previous))

    def tool_output(self, call_id: Any, output: Any, item_id: str) -> None:
        """A client's ``function_call_output``: the call's result, and an item of the conversation."""
        call = self.tools.answer(call_id, output, item_id)
        item = events.function_call_output_item(item_id, call.call_id, call.output or "")
        previous = self.add_item(item_id)
        self.send(events.item_added(item, previous))
        self.send(events.item_done(item, previous))

    def delete(self, item_id: str) -> None:
        """``conversation.item.delete``: the item leaves the conversation the LLM sees."""
        with self.lock:
            if item_id not in self.items:
                raise ProtocolError("item_not_found", f"no item {item_id!r} in this conversation", param="item_id")
            if self.tools.owns(item_id):
                raise ProtocolError("unsupported_value", "function call items stay in the conversation: delete the "
                                    "assistant or user message around them instead", param="item_id")
            self.items.remove(item_id)
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

    def expect_reply(self, turn: int) -> bool:
        """A user turn is under way: its reply will follow, unless the session holds it. Returns
        whether an earlier turn's reply is still under way (the new speech barges in on it)."""
        with self.lock:
            busy = any(t < turn for t in self._replying)
            if not self.holds(turn):
                self._replying.add(turn)
            return busy

    def hold(self, turn: int, item_id: str, *, text: str | None = None, speech: Speech | None = None) -> None:
        """A held turn waits in ``pending`` for ``response.create`` from its end on; it is ready once
        its transcript is in (``text``), or at once with its audio for an LLM that hears audio."""
        hears = self.nodes.hears_audio
        ready = text is not None or (speech is not None and hears)
        with self.lock:
            entry = next((q for q in self.pending + [q for r in self.asked for q in r.inputs] if q.turn == turn), None)
            if entry is None:
                self.pending.append(Pending(item_id, turn, text, speech if hears else None, ready))
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
                if resp.dispatched or not all(q.ready for q in resp.inputs):
                    break  # one at a time, in the order asked
                resp.dispatched = True
                ready.append(resp)
        for resp in ready:
            if not self.put(("respond", resp)):
                with self.lock:
                    self.asked.remove(resp)
                self.send(events.error("input_overflow", "the server is behind on this session: the response was "
                                       "not started; send response.create again", type="server_error"))

    def forget_below(self, turn: int) -> None:
        """An interrupt made every turn before ``turn`` stale: their transcripts will not come."""
        with self.lock:
            for q in self.pending + [q for r in self.asked for q in r.inputs]:
                if q.turn and q.turn < turn and not q.ready:
                    q.ready = True
        self.dispatch()

    # -- a response's lifecycle ---------------------------------------------------------------

    def response(self, turn: int) -> Response:
        """The response answering ``turn``; a new one (``response.created`` sent) if none yet."""
        with self.lock:
            resp = self.responses.get(turn)
            if resp is None:
                resp = self.responses[turn] = Response(new_id("resp"), turn, list(self.config.output_modalities))
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
                self.turn_items[turn] = [(q.item_id, None if q.speech is not None and not q.text else q.text or "")
                                         for q in resp.inputs]
            self.send(events.response_created(resp.as_response("in_progress")))

    def active(self) -> list[Response]:
        """Responses under way, and those asked for that the source has not begun yet."""
        with self.lock:
            return [r for r in self.responses.values() if not r.done] + list(self.asked)

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
                previous = self.add_item(resp.item_id)
                self.send(events.output_item_added(resp.id, 0, resp.as_item("in_progress")))
                self.send(events.item_added(resp.as_item("in_progress"), previous))
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
            self._replying.discard(turn)  # no reply is waited for
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
                resp = Response(new_id("resp"), turn, list(self.config.output_modalities))
                self.begin(turn, resp)
            self._end(resp, "completed", calls=calls)

    def _end(self, resp: Response, status: str, details: dict[str, Any] | None = None,
             calls: Sequence[ClientCall] = ()) -> None:
        """The one place a response ends: its open parts done, its calls, ``response.done``."""
        with self.lock:
            if resp.done:
                return
            resp.done = True
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
        """What the LLM sends of ``conversation`` for one request: the client's edits applied
        (nodes/io/realtime/history.py)."""
        with self.lock:
            exchanges = conversation.exchanges
            answering = self.responses.get(exchanges[-1].turn) if exchanges else None
            deleted = set(self.deleted)
            return conversation_view(
                conversation, instructions=answering.instructions if answering is not None else None,
                deleted=deleted, turn_items=dict(self.turn_items), user_items=dict(self.user_items),
                no_reply={r.turn for r in self.by_item.values() if r.item_id in deleted})
