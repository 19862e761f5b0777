"""Which user turns start a reply, and what a Realtime session's graph nodes ask it (the node
contract's ``SessionHooks``, through ``ctx.session``): which user turns the LLM answers by itself,
which replies are spoken, what the LLM sees of its history, whether a failed reply ends only its
response, the token counts of its requests. A part of ``Session`` (session.py), on its state and
under its lock.
"""

from __future__ import annotations

import threading
from typing import Any

from nodes.io.realtime import protocol as events
from nodes.io.realtime.history import conversation_view
from nodes.io.realtime.response import Pending, Response
from s2s_flow.messages import Speech
from s2s_flow.node import SessionHooks

__all__ = ["NodeHooks", "trim"]

_REMEMBERED_TURNS = 256  # per-turn bookkeeping kept for the most recent turns only


def trim(*per_turn: dict[int, Any]) -> None:
    """Keep the most recent turns' entries only."""
    for mapping in per_turn:
        for old in list(mapping)[: -_REMEMBERED_TURNS]:
            del mapping[old]


class NodeHooks(SessionHooks):
    """The hooks of ``Session``; the state they read is the session's."""

    lock: threading.RLock
    config: Any
    responses: dict[int, Response]
    by_item: dict[str, Response]
    asked: list[Response]
    pending: list[Pending]
    deleted: set[str]
    turn_items: dict[int, list[tuple[str, str | None, tuple[str, ...]]]]
    user_items: dict[int, str]
    answering: int | None
    out_of_band: set[int]
    closed: bool
    _holds: dict[int, bool]
    _awaiting: set[int]
    _replying: set[int]
    _heard: dict[int, str]
    _usage: dict[int, dict[str, int]]
    nodes: Any

    def user_item(self, turn: int) -> str:
        raise NotImplementedError

    def put(self, item: Any) -> bool:
        raise NotImplementedError

    def send(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

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
                trim(self._holds)
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
        if self.config.kind == "transcription":
            return  # a transcription session answers nothing: no turn waits for a response
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

    def ask(self, resp: Response, inputs: list[Pending] | None = None) -> None:
        """``response.create``: answer every user message waiting now, once all are transcribed
        (or, with ``input``, those messages only)."""
        with self.lock:
            if inputs is None:
                resp.inputs, self.pending = self.pending, []
            else:
                resp.inputs = inputs
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

    def usage(self, turn: int, usage: dict[str, Any]) -> None:
        """A request's token counts (a turn with tool rounds makes several): its response reports them."""
        with self.lock:
            total = self._usage.setdefault(turn, {"prompt_tokens": 0, "completion_tokens": 0})
            for key in total:
                total[key] += int(usage.get(key) or 0)
            trim(self._usage)

    def answers(self, turn: int) -> bool:
        """The LLM answers a user turn by itself unless the session holds it for ``response.create``
        (it is then answered as a turn of its own). A spoken turn whose reply would run beside a
        response the client asked for before the turn was committed waits too: one response at a
        time (the LLM asks once per turn, at its transcript)."""
        with self.lock:
            if self.holds(turn):
                return False
            if not (self.asked or any(not r.done and r.turn > turn for r in self.responses.values())):
                return True
            self._holds[turn] = True
            self._awaiting.discard(turn)
            self._replying.discard(turn)
            if self.answering == turn:
                self.answering = None
            text = self._heard.get(turn)
        self.hold(turn, self.user_item(turn), text=text)
        return False

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
            view = conversation_view(
                conversation, instructions=answering.instructions if answering is not None else None,
                deleted=deleted, turn_items=dict(self.turn_items), user_items=dict(self.user_items),
                no_reply={r.turn for r in self.by_item.values() if r.item_id in deleted})
            if answering is not None and answering.own_context:  # response.create's input: its context only
                view.exchanges = view.exchanges[-1:]
            elif self.out_of_band:  # out-of-band responses and their input are no part of the conversation
                last = view.exchanges[-1:]
                view.exchanges = [ex for ex in view.exchanges[:-1] if ex.turn not in self.out_of_band] + last
            return view
