"""The node every LLM backend builds on, remote or in-process: the options of the conversation
and its tools (with the range checks of all LLM options), and the turn itself: which messages
get a reply, the bounded history, the tool rounds, the reply as TextDeltas, and barge-in.

A backend adds its own options (its ``__init__`` passes the rest on as ``**options``) and two
methods: :meth:`LLMBase.respond`, one request to a server or one local generation (text pieces,
then the tool calls it asked for), and :meth:`LLMBase.stop_reply`, which cuts that short from
another thread. Everything around a turn is here, once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from nodes._http import RemoteError
from nodes._live import turn_failed
from nodes._playback import playback_of, truncate_to_heard
from nodes.llm._conversation import Conversation, Exchange, ToolCall, reply_deltas
from nodes.llm._session import SessionLLM
from nodes.llm._tools import Toolbox, answer_with_tools
from s2s_flow.errors import ConfigError
from s2s_flow.messages import Message, TextDelta
from s2s_flow.node import Node

__all__ = ["LLMBase", "DEFAULT_SYSTEM_PROMPT", "check_range"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful voice assistant. Answer briefly in plain spoken sentences, "
    "without lists, markdown or emojis."
)


def check_range(ok: bool, option: str, value: Any, expected: str) -> None:
    """A ConfigError naming ``llm.<option>``, its value and what it accepts, unless ``ok``."""
    if not ok:
        raise ConfigError(f"llm.{option}={value!r} is out of range: expected {expected}")


class LLMBase(Node, SessionLLM):
    """The turn handling of every LLM node: a backend implements :meth:`respond` and
    :meth:`stop_reply`, and may say what a user message stores (:meth:`user_content`)."""

    outputs = {"text": TextDelta}

    def __init__(
        self,
        *,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        max_history_turns: int = 8,
        tools: Sequence[str] | None = None,
        tool_choice: str = "auto",
        tool_timeout_s: float = 10.0,
        max_tool_rounds: int = 3,
        tool_filler: str | None = None,
        tool_filler_after_s: float = 1.0,
        fallback_reply: str | None = None,
    ) -> None:
        check_range(max_history_turns >= 1, "max_history_turns", max_history_turns, "at least 1")
        #: said instead of the reply when the endpoint fails before its first token, in live runs
        #: (io=mic, io=realtime); None or empty: the turn fails (a file run always fails)
        self.fallback_reply = (fallback_reply or "").strip() or None
        self.conversation = Conversation(system_prompt, max_history_turns)
        self.toolbox = Toolbox(tools, choice=tool_choice, timeout_s=tool_timeout_s, max_rounds=max_tool_rounds,
                               filler=tool_filler, filler_after_s=tool_filler_after_s)
        self._stale_below = -(2**62)  # turns below this were interrupted
        self._turn: int | None = None  # the turn whose reply respond() is making
        self._answered: tuple[int, str] | None = None  # (turn, port) of the last reply
        self._written: int | None = None  # the last turn whose reply the endpoint wrote to its end

    # -- what a backend provides -----------------------------------------------------

    def respond(self, exchange: Exchange, tool_choice: str) -> Iterator[str | ToolCall]:
        """One request or generation on the conversation as it stands (the exchange's tool rounds
        so far included): text pieces as they come, then the tool calls asked for. It sets
        ``_turn`` while the reply is in flight, so that an interrupt knows whether to stop it."""
        raise NotImplementedError

    def stop_reply(self) -> None:
        """Cut the reply in flight short, from any thread: close its stream, stop its generation."""
        raise NotImplementedError

    def user_content(self, port: str, msg: Message) -> Any:
        """What a user turn stores in the history (its text); None: no reply."""
        text = getattr(msg, "text", "")
        if not text.strip():
            self.ctx.log.info("turn %d: empty transcript, no reply", msg.turn)
            return None
        return text

    # -- the turn --------------------------------------------------------------------

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        if not self.ctx.session.answers(msg.turn):
            return  # the session starts this reply later (a server's client asks for it)
        if not getattr(msg, "final", True):
            return  # partial transcripts: wait for the final one
        last = self._answered
        if last is not None and last[0] == msg.turn and last[1] != port:
            self.ctx.log.debug("turn %d was answered from %r already; %r ignored", msg.turn, last[1], port)
            return  # both text and audio wired: one reply per turn
        speculative = getattr(msg, "speculative", False)
        playback = playback_of(self.ctx)
        if self.conversation.settle(msg.turn, speculative, played=lambda t: playback.heard(t) is not None):
            return  # confirmed: its reply already went out on the speculative transcript
        user = self.user_content(port, msg)
        if user is None:
            return
        self._answered = (msg.turn, port)
        truncate_to_heard(self.ctx, self.conversation)  # after a barge-in: keep what was heard
        exchange = self.conversation.add_user(user, msg.turn, speculative=speculative)
        try:
            yield from reply_deltas(
                self._or_fallback(exchange), turn=msg.turn, conversation=self.conversation, exchange=exchange,
                log=self.ctx.log, interrupted=lambda: self.stale(msg.turn),
            )
        except RemoteError as exc:  # no fallback: the reply's end went out with the error (it fails)
            if not turn_failed(self.ctx, "llm", msg.turn, exc):
                raise
            return
        # a speculative turn's reply is often written before its confirmation reaches this node,
        # but not before the VAD has confirmed it (ctx.work); a withdrawn one is never confirmed
        if self._written == msg.turn and not self.stale(msg.turn) and self.ctx.work.kind("first", msg.turn) == "first":
            self.after_reply(exchange)

    def after_reply(self, exchange: Exchange) -> None:
        """Work for the next turn once this one's reply is written, while its listener hears it (a
        backend's prompt cache: nodes/llm/chat.py); nothing by default."""

    def stale(self, turn: int) -> bool:
        """Whether a barge-in has made ``turn``'s reply unwanted."""
        return turn < self._stale_below

    def reset(self) -> None:
        """An empty history (a benchmark talking to one node; the engine gives every conversation
        a node of its own)."""
        self.conversation = Conversation(self.conversation.system_prompt, self.conversation.max_turns)
        self._answered = None

    def on_interrupt(self, turn: int) -> None:
        self._stale_below = max(self._stale_below, turn)
        current = self._turn
        if current is not None and current < turn:
            self.stop_reply()
        self.toolbox.wake()  # a wait for tools checks whether its turn is stale
        playback_of(self.ctx).wake()  # so does a reply waiting for its listener (llm.lead_s)

    def close(self) -> None:
        self.stop_reply()
        self.toolbox.wake()

    def _or_fallback(self, exchange: Exchange) -> Iterator[str]:
        """The reply; in a live run, ``fallback_reply`` instead when the endpoint failed before
        the reply's first words (refused, 5xx after the retries, a timeout, a server gone)."""
        spoke = False
        try:
            for piece in self._pieces(exchange):
                spoke = spoke or bool(piece)
                yield piece
            self._written = exchange.turn  # the endpoint's own reply, not a fallback
        except RemoteError as exc:
            if spoke:  # a tool's filler was said, then the next round failed: the reply ends there
                self.ctx.log.error("turn %d: reply cut short, keeping the text so far: %s", exchange.turn, exc)
                return
            if not self.fallback_reply or self.stale(exchange.turn):
                raise
            if not turn_failed(self.ctx, "llm", exchange.turn, exc, fallback=self.fallback_reply):
                raise
            yield self.fallback_reply

    def _pieces(self, exchange: Exchange) -> Iterator[str]:
        """The reply's text; with tools, the rounds of calls it takes to get there."""
        turn = exchange.turn
        if not self.toolbox:
            yield from (p for p in self.respond(exchange, "none") if isinstance(p, str))
            return
        yield from answer_with_tools(
            lambda choice: self.respond(exchange, choice), toolbox=self.toolbox, exchange=exchange,
            cancelled=lambda: self.stale(turn) or self.ctx.stopping.is_set(), record=self.ctx.record,
            log=self.ctx.log,
        )
