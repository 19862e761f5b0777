"""The node both remote LLM APIs build on (``llm=chat``, ``llm=responses``): the options of a
model server and of what each request carries, the HTTP client (``nodes/_http.py``), and one
request per tool round, streamed or not; the turn around it is every LLM's (``_base.py``).

A subclass names its endpoint and fills in three pieces: the request body, how text and tool
calls come out of its stream events, and how they come out of a non-streamed answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from types import MappingProxyType
from typing import Any, ClassVar

from nodes._http import DEFAULT_BASE_URL, Aborted, HttpPolicy, RemoteClient, RemoteError, RemoteRefused
from nodes._playback import playback_of
from nodes.llm._base import LLMBase, check_range
from nodes.llm._conversation import Exchange, SentenceSplitter, ToolCall
from nodes.llm._slots import SessionSlot
from nodes.llm._tools import forces_call
from s2s_flow import inference
from s2s_flow.errors import ConfigError

__all__ = ["RemoteLLM"]

EMPTY: Mapping[str, Any] = MappingProxyType({})


class RemoteLLM(LLMBase):
    """Shared body of ``llm=chat`` and ``llm=responses``: server and request options, the client."""

    shared_safety = ("per session: one keep-alive connection each, which a barge-in cuts by its socket; "
                     "the weights live on the model server, shared by every session")

    secret_params = frozenset({"api_key"})

    path: ClassVar[str]
    api_name: ClassVar[str]
    hint_404: ClassVar[str] = ""
    #: a request can go on with a reply cut short (:meth:`continued`): what ``lead_s`` needs
    continues_replies: ClassVar[bool] = False

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        model: str | None = None,
        api_key: str | None = None,
        stream: bool = True,
        temperature: float | None = None,
        max_tokens: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        reasoning_effort: str | None = None,
        enable_thinking: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = EMPTY,
        extra_body: Mapping[str, Any] | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_retries: int = 2,
        tool_call_prefill: str | None = None,
        lead_s: float | None = None,
        **options: Any,
    ) -> None:
        """``options``: the conversation and tool options of every LLM (``LLMBase``)."""
        check_range(lead_s is None or lead_s > 0, "lead_s", lead_s, "null (off) or seconds > 0, e.g. 4")
        if lead_s is not None and not self.continues_replies:  # a recipe's setting, kept for llm=chat
            logging.getLogger("s2s_flow.llm").warning(
                "llm.lead_s=%s is not used: the %s cannot go on with a reply cut short, so replies are written "
                "at once (llm=chat with llama-server writes them just in time)", lead_s, self.api_name)
            lead_s = None
        check_range(temperature is None or 0 <= temperature <= 2, "temperature", temperature, "0 to 2")
        check_range(top_p is None or 0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        check_range(max_tokens is None or max_tokens >= 1, "max_tokens", max_tokens, "at least 1")
        check_range(reasoning_effort is None or bool(reasoning_effort), "reasoning_effort", reasoning_effort,
                    "null or an effort such as low, medium, high")
        super().__init__(**options)
        self.model = model or None
        self.stream = stream
        self.temperature, self.max_tokens, self.top_p, self.seed = temperature, max_tokens, top_p, seed
        self.reasoning_effort = reasoning_effort
        self.enable_thinking = enable_thinking
        self.chat_template_kwargs = None if chat_template_kwargs is None else dict(chat_template_kwargs)
        if reasoning_effort is not None and "enable_thinking" in (self.chat_template_kwargs or {}):
            raise ConfigError(
                "llm.chat_template_kwargs.enable_thinking and llm.reasoning_effort are both set: a server "
                "such as vLLM then ignores the effort; keep one of them"
            )
        self.extra_body = dict(extra_body or {})
        self.client = RemoteClient(
            group="llm",
            base_url=base_url,
            api_key=api_key,
            policy=HttpPolicy(connect_timeout, read_timeout, max_retries),
            start_hint="llama-server -m model.gguf --port 8080",
        )
        if not self.model and not self.client.loopback:
            raise ConfigError(
                f"llm.model is not set and llm.base_url points at {self.client.host}, a remote server: name "
                f"the model (OpenAI answers 400 without one), e.g. llm.model=gpt-4.1-mini or one that "
                f"{self.client.base_url}/models lists; only a server on this machine may pick its own"
            )
        #: opens the assistant's turn when a call is required: llama-server's required choice still
        #: lets a model talk first (and a small one never stops); with the template's call tag
        #: (Qwen / Hermes: "<tool_call>\n") the model can only write the call, which the server parses
        self.tool_call_prefill = tool_call_prefill or None
        #: a spoken reply is written no further than this ahead of its listener (paced sinks only): the
        #: request is cut at a sentence end and continued when the listener catches up; None: at once
        self.lead_s = lead_s
        self._pace: _Pacer | None = None  # the last reply's pacing: its margin carries on to the next
        #: the server's slot this session keeps its conversation in, when this process runs the server
        self.slot = SessionSlot(self.client.base_url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.client.base_url!r}, model={self.model!r})"

    # -- what a subclass provides -----------------------------------------------------

    def request_body(self, tool_choice: str = "auto") -> dict[str, Any]:
        """The JSON body for the conversation as it stands; ``tool_choice`` when tools are declared."""
        raise NotImplementedError

    def stream_texts(self, events: Iterator[tuple[str, Any]]) -> Iterator[str | ToolCall]:
        """Reply text pieces out of the SSE events, then the tool calls they carried;
        raise RemoteError on an error event."""
        raise NotImplementedError

    def full_reply(self, answer: Any) -> list[str | ToolCall]:
        """Reply text and tool calls out of a non-streamed answer."""
        raise NotImplementedError

    def explain(self, exc: RemoteError) -> RemoteError:
        """Backend knowledge added to an error before it stops the graph: a strict server that
        refuses ``chat_template_kwargs`` (a field only servers of one's own read) names the fix."""
        rejected = exc.status is not None and exc.status < 500 and exc.status != 429
        if rejected and not isinstance(exc, RemoteRefused) and "chat_template_kwargs" in exc.detail:
            return type(exc)(f"{exc}; this server takes no chat_template_kwargs: set llm.chat_template_kwargs=null",
                             status=exc.status, detail=exc.detail)
        return exc

    def log_reply(self, *, usage: Any, reasoning: int, stop: Any, spoke: bool) -> None:
        """One line per reply; a warning when the answer was cut or never came."""
        log = self.ctx.log
        log.debug("reply done: stop=%s usage=%s reasoning_deltas=%d", stop, usage, reasoning)
        if isinstance(usage, dict) and self._turn is not None:
            self.ctx.session.usage(self._turn, usage)
        if stop in ("length", "max_output_tokens"):
            log.warning("the reply hit the token limit (llm.max_tokens=%s) and was cut", self.max_tokens)
        if reasoning and not spoke:
            log.warning(
                "the model spent the reply on reasoning (%d deltas) and said nothing: set "
                "llm.enable_thinking=false or llm.reasoning_effort=low, or raise llm.max_tokens",
                reasoning,
            )

    # -- what both APIs send alike -----------------------------------------------------

    def generation_options(self) -> dict[str, Any]:
        """Options both APIs spell alike; ``extra_body`` is merged over the body last."""
        body: dict[str, Any] = {"model": self.model} if self.model else {}
        for key in ("temperature", "top_p", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        kwargs = self.template_kwargs()
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self.slot.id is not None:
            body["id_slot"] = self.slot.id
        return body

    def prefill(self, tool_choice: str) -> str | None:
        """The text the assistant's turn starts with in this request (``tool_call_prefill``), if any."""
        return self.tool_call_prefill if self.toolbox and forces_call(tool_choice) else None

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs``: the thinking switch only for servers of one's own (llama.cpp
        and vLLM read it; api.openai.com rejects the field) and never next to an explicit
        ``reasoning_effort`` (vLLM would then ignore the effort); the configured mapping as is."""
        if self.chat_template_kwargs is None:
            return {}
        if self.reasoning_effort is None and self.client.private:
            return {"enable_thinking": self.enable_thinking, **self.chat_template_kwargs}
        return dict(self.chat_template_kwargs)

    # -- the node --------------------------------------------------------------------

    def setup(self) -> None:
        self.client.log = self.ctx.log
        if self.slot.take() is not None:
            self.client.move_to(self.slot.url(self.client.base_url))  # its replica (server.replicas)
            self.ctx.log.debug("the conversation keeps slot %d of the server at %s", self.slot.id, self.client.base_url)
        self.ctx.progress(f"connecting to {self.client.base_url}")
        try:
            models = self.client.open()
        except RemoteError as exc:
            if not self.ctx.live:
                raise self.explain(exc) from None
            # a live session outlives a server that is down (a managed one being restarted) or that
            # refuses it: each turn asks again, says the fallback reply and tells why (an error event)
            self.ctx.log.warning("%s: the session starts, each turn asks again", self.explain(exc))
            models = []
        if self.model and models and self.model not in models:
            self.ctx.log.warning(
                "llm.model=%r is not among the models %s lists (%s); the request may fail",
                self.model, self.client.base_url, ", ".join(models[:5]),
            )

    def stop_reply(self) -> None:
        self.client.abort()

    def close(self) -> None:
        super().close()
        self.client.close()
        self.slot.give_back()

    def respond(self, exchange: Exchange, tool_choice: str) -> Iterator[str | ToolCall]:
        """One request: text as it streams, then the tool calls asked for. Before the first
        word of a turn a failure raises (after a silent tool round too: the listener has heard
        nothing, so a live run says its fallback); after it, the reply ends where it broke
        (logged): an answer is never replayed from the start. With ``lead_s`` the request is cut
        at a sentence end once the reply is that far ahead of its listener, and continued (the
        reply so far as the assistant's message) when the listener catches up."""
        turn = exchange.turn
        if self.stale(turn):
            return
        body = self.request_body(tool_choice)
        produced = any(r.text for r in exchange.rounds)  # words said before a tool round
        self.client.begin()
        self._turn = turn
        hold = ExitStack()
        try:
            if self.stale(turn):  # interrupted while the request was being built
                return
            if not self.stream:
                yield from self.full_reply(
                    self.client.post_json(self.path, body, api=self.api_name, hint_404=self.hint_404)
                )
                return
            pace, first = self._pacer(turn, body), body
            # a turn's first sentence, confirmed or speculative, is the machine's critical path
            # (s2s_flow/inference.py: CriticalPath)
            opening = SentenceSplitter() if not produced else None
            if opening is not None:
                hold.enter_context(inference.critical.holding())
            while True:
                stream = self.client.post_stream(self.path, body, api=self.api_name, hint_404=self.hint_404)
                with stream as events:
                    for text in self.stream_texts(events):
                        if self.stale(turn):
                            return
                        if pace is not None and isinstance(text, str) and not (text := pace.new(text)):
                            continue
                        produced = True
                        if opening is not None and isinstance(text, str) and any(e for _, e in opening.feed(text)):
                            opening = None
                            hold.close()  # the first sentence is out: later work may go on
                        yield text
                        if pace is not None and isinstance(text, str) and pace.cut(text):
                            break  # leaving the block closes the connection: the server stops generating
                    else:
                        return
                if not pace.resume(lambda: self.stale(turn) or self.ctx.stopping.is_set()):
                    return
                body = self.continued(first, pace.said)
                if self.max_tokens is not None:
                    body["max_tokens"] = self.max_tokens - pace.pieces
        except RemoteError as exc:
            if self.stale(turn) or isinstance(exc, Aborted):
                return  # barge-in closed the stream on purpose
            if produced:
                self.ctx.log.error("turn %d: reply cut short, keeping the text so far: %s", turn, exc)
                return
            raise self.explain(exc) from None
        finally:
            hold.close()
            self._turn = None

    def continued(self, body: dict[str, Any], said: str) -> dict[str, Any]:
        """The request that goes on with a reply cut after ``said`` (``continues_replies`` backends)."""
        raise NotImplementedError

    def _pacer(self, turn: int, body: dict[str, Any]) -> _Pacer | None:
        """A reply written just in time (``lead_s``): a spoken reply to a listener at its own pace,
        in a request that offers no tools (a cut could split the server's reading of a call)."""
        playback = playback_of(self.ctx)
        if self.lead_s is None or not playback.paced or not self.ctx.session.speaks(turn) or body.get("tools"):
            return None
        self._pace = _Pacer(playback, turn, self.lead_s, self.max_tokens, self.ctx,
                            margin_s=self._pace.margin_s if self._pace is not None else 0.0)
        return self._pace


class _Pacer:
    """The reply of one request as it streams, cut at a sentence end once it is ``lead_s`` ahead of
    its listener (nodes/_playback.py: what was made of it and not heard, and its text not yet
    spoken), or half of that while another session's first words are being made (the server's
    cores go to them); it resumes when the listener is that close again.

    The lead grows with what a continuation takes on this machine now: twice the slowest wait for
    a continuation's first new words (a loaded server answers later), fading by a fifth per
    continuation when it answers quickly again, kept by the node from one reply to the next."""

    def __init__(self, playback: Any, turn: int, lead_s: float, max_tokens: int | None, ctx: Any,
                 margin_s: float = 0.0) -> None:
        self.playback, self.turn, self.lead_s, self.max_tokens, self.ctx = playback, turn, lead_s, max_tokens, ctx
        self.margin_s = margin_s  # added to the lead: what continuations have taken lately
        self.said = ""  # the reply so far, across its requests
        self.pieces = 0  # streamed pieces so far: tokens, as llama-server sends them
        self._splitter = SentenceSplitter()
        self._echo: str | None = None  # a continuation's text until it is known whether it echoes ``said``
        self._resumed: float | None = None  # when the continuation in flight was sent

    def new(self, text: str) -> str:
        """What of a streamed piece is new: llama-server streams a continued reply from its start
        (the reply so far, then the new tokens), another server only the new tokens. A continuation's
        text is held until it either covers the reply so far (dropped) or differs from it (all new)."""
        if self._echo is None:
            return text
        got, said = self._echo + text, self.said
        if said.startswith(got):
            self._echo = got
            return ""
        self._echo = None
        if self._resumed is not None:  # the continuation's first new words: how long they took
            waited, self._resumed = time.monotonic() - self._resumed, None
            self.margin_s = max(0.8 * self.margin_s, 2 * waited)
        return got[len(said):] if got.startswith(said) else got

    def cut(self, text: str) -> bool:
        """Whether to stop the request after ``text``: a sentence just ended and the reply is ahead."""
        self.said += text
        self.pieces += 1
        if self.max_tokens is not None and self.pieces >= self.max_tokens:
            return False  # its last token: the server ends it
        if not any(end for _, end in self._splitter.feed(text)):
            return False
        ahead = self.playback.ahead_s(self.turn, len(self.said))
        # another session's first words are being made: stop here too while this reply has slack;
        # the request goes on once they are out or the slack is used up (resume)
        return ahead > self.lead_s + self.margin_s or (inference.critical.busy() and ahead > self.slack_s())

    def slack_s(self) -> float:
        """How far ahead of its listener the reply may wait for other sessions' first words: half
        the lead, and what a continuation takes on this machine now (the margin), or the listener
        would run out before the continuation's words are spoken."""
        return self.lead_s / 2 + self.margin_s

    def resume(self, cancelled: Any) -> bool:
        """Wait for the listener; False when the turn is over meanwhile (a barge-in, the end)."""
        self.ctx.record("llm_paused", turn=self.turn, chars=len(self.said))
        outcome = self.playback.wait_ahead(self.turn, len(self.said), self.lead_s + self.margin_s, cancelled)
        if outcome == "due":  # another session's first words go first while this reply has slack
            inference.critical.yield_to(lambda: self.playback.ahead_s(self.turn, len(self.said)) > self.slack_s(),
                                        cancelled)
        if outcome == "stalled":
            self.ctx.log.info("turn %d: nothing of the reply was played for a while: it is written on without "
                              "waiting for its listener", self.turn)
            self.lead_s = float("inf")
        self._echo, self._resumed = "", time.monotonic()
        return outcome != "cancelled"
