"""``llm=chat``: any OpenAI Chat Completions server, streamed; the one LLM that hears audio.

With ``stt=none`` the user's ``Speech`` goes to the model as a WAV content part, for
audio-capable models (llama-server with an audio ``--mmproj``, vLLM, OpenAI audio models).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nodes._http import DEFAULT_BASE_URL, HttpPolicy, RemoteClient, RemoteError
from nodes._turn_text import ServerScorer, scoring_messages, turn_text_of
from nodes.llm._conversation import Exchange, ToolCall
from nodes.llm._remote import RemoteLLM
from nodes.llm._slots import scorer_slot
from nodes.llm._tools import named_tool
from s2s_flow import inference
from s2s_flow.audio import wav_bytes
from s2s_flow.errors import ConfigError
from s2s_flow.messages import Message, Speech, SpeechStarted, TextDelta, Transcript

AUDIO_CONTENT_TYPES = ("input_audio", "audio_url")
AUDIO_PLACEHOLDER = "[user audio]"
#: the most a prepared prompt waits for other sessions' first words (ChatCompletionsLLM.after_reply)
PREPARE_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class AudioTurn:
    """A spoken user turn, encoded once: base64 of a 16-bit mono WAV."""

    b64: str
    seconds: float


class ChatCompletionsLLM(RemoteLLM):
    """``POST {base_url}/chat/completions`` with SSE streaming; text or audio user turns."""

    inputs = {"text": Transcript, "audio": Speech, "started": SpeechStarted}
    optional_inputs = frozenset({"text", "audio", "started"})
    taps = frozenset({"started"})  # the VAD's: the user speaks again (after_reply)
    outputs = {"text": TextDelta}

    path = "/chat/completions"
    api_name = "Chat Completions API"
    hint_404 = "check llm.base_url (it usually ends in /v1)"
    continues_replies = True

    def __init__(
        self,
        *,
        audio_content_type: str = "input_audio",
        audio_prompt: str | None = None,
        keep_audio_turns: int = 1,
        vision: bool = False,
        **options: Any,
    ) -> None:
        """``options``: those of every remote LLM (``RemoteLLM``: base_url, model, api_key ...) and of
        every LLM (``LLMBase``: system_prompt, tools ...)."""
        super().__init__(**options)
        if audio_content_type not in AUDIO_CONTENT_TYPES:
            raise ConfigError(
                f"llm.audio_content_type={audio_content_type!r} is not known: use input_audio "
                f"(llama.cpp, OpenAI) or audio_url (vLLM)"
            )
        if keep_audio_turns < 1:
            raise ConfigError(
                f"llm.keep_audio_turns={keep_audio_turns} must be at least 1 (the turn being answered)"
            )
        self.audio_content_type = audio_content_type
        self.audio_prompt = audio_prompt or None
        self.keep_audio_turns = keep_audio_turns
        #: the model takes images: a Realtime client's input_image parts go as image_url parts
        self.vision = bool(vision)
        # vad.turn=text|hybrid: the end-of-turn score comes from the server's own endpoints at its
        # root (llama-server: /apply-template, /completion), beside the API under base_url
        root = str(options.get("base_url", DEFAULT_BASE_URL)).rstrip("/").removesuffix("/v1")
        policy = HttpPolicy(connect_timeout=options.get("connect_timeout", 5.0),
                            read_timeout=options.get("read_timeout", 60.0), max_retries=0)
        self._scorer = ServerScorer(RemoteClient(group="llm", base_url=root, api_key=options.get("api_key"),
                                                 policy=policy))
        self._scoring: Any = None  # the thread the scores are made on
        self._scored: Any = None  # the last score's future
        # after_reply: the prompt prepared once the user speaks again, on a connection of its own
        self._preparer = RemoteClient(group="llm", base_url=str(options.get("base_url", DEFAULT_BASE_URL)),
                                      api_key=options.get("api_key"), policy=policy)
        self._preparer_open = False
        self._prepare_after: int | None = None  # the turn whose trimmed prompt waits for the user's next words
        self._prepared_turn = -(2**62)  # the last turn whose reply's trim was pending or sent
        self._preparing: threading.Thread | None = None
        self._asked = threading.Event()  # the next turn's request is made: a prepare not sent yet is dropped

    def setup(self) -> None:
        super().setup()
        turn_text_of(self.ctx).scorer = "llm=chat"  # until the server shows it has no such endpoints
        self._scorer.client.log = self.ctx.log
        self._scorer.client.move_to(self.slot.url(self._scorer.client.base_url))  # the session's replica
        self._preparer.move_to(self.slot.url(self._preparer.base_url))
        self._scorer.slot = scorer_slot(self.client.base_url)

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        if isinstance(msg, SpeechStarted):
            self._prepare_when_spoken()
            return
        if msg.turn > self._prepared_turn:  # a new turn (not the confirmation of the one answered)
            self._asked.set()
            self._prepare_after = None  # one the VAD did not announce (typed): its request trims
        if isinstance(msg, Transcript) and msg.speculative and msg.final:
            self._score_end_of_turn(msg)  # beside the reply, on a connection (and a server slot) of its own
        yield from super().process(port, msg)

    def _score_end_of_turn(self, msg: Transcript) -> None:
        """Start scoring the chance that the user is done (vad.turn=text|hybrid); the score goes to
        the VAD when it comes. It runs on a thread of its own, so the reply does not wait for it:
        with one server slot (llama-server -np 1) the two requests take turns, with two (the recipe)
        they run together."""
        board = turn_text_of(self.ctx)
        if not board.wanted or board.scorer is None:
            return
        messages = scoring_messages(self.conversation.messages(self.render_user), msg.text)
        if self._scoring is None:  # its own connection and thread, made once a VAD asks for scores
            from concurrent.futures import ThreadPoolExecutor

            self._scorer.client.open(warm_up=False)
            self._scoring = ThreadPoolExecutor(1, thread_name_prefix=f"{self.ctx.name}-turn-text")
        self._scored = self._scoring.submit(self._score, msg.turn, messages)

    def _score(self, turn: int, messages: list[dict[str, Any]]) -> None:
        board = turn_text_of(self.ctx)
        try:
            p = self._scorer.probability(messages)
        except RemoteError as exc:
            board.scorer = None
            self.ctx.log.warning(
                "no end-of-turn score from %s (%s): vad.turn=hybrid goes on the audio alone, vad.turn=text waits "
                "for vad.max_silence_ms; the score needs llama-server (its /apply-template and /completion)",
                self._scorer.client.base_url, exc)
            return
        if p is None:
            board.scorer = None
            self.ctx.log.warning("the model's chat template shows no end-of-turn token after the user's "
                                 "words: no end-of-turn score (vad.turn=hybrid goes on the audio alone, "
                                 "vad.turn=text waits for vad.max_silence_ms)")
            return
        board.post(turn, p)
        self.ctx.record("turn_text", turn=turn, probability=round(p, 4))

    def scored(self) -> None:
        """Wait for the end-of-turn score under way, if any (a test or benchmark in stream time)."""
        if self._scored is not None:
            self._scored.result()

    def close(self) -> None:
        super().close()
        self._asked.set()
        self._preparer.close()  # a prepare in flight returns at once (the server still shifts)
        if self._scoring is not None:
            self._scoring.shutdown(wait=True, cancel_futures=True)
            self._scorer.client.close()

    # -- request ----------------------------------------------------------------------

    def user_content(self, port: str, msg: Message) -> Any:
        if isinstance(msg, Transcript) and msg.images:  # words and images: content parts, as they go
            text = [{"type": "text", "text": msg.text}] if msg.text.strip() else []
            return [*text, *({"type": "image_url", "image_url": {"url": url}} for url in msg.images)]
        if not isinstance(msg, Speech):
            return super().user_content(port, msg)
        if len(msg.pcm) == 0:
            self.ctx.log.info("turn %d: empty speech, no reply", msg.turn)
            return None
        b64 = base64.b64encode(wav_bytes(msg.pcm, msg.rate)).decode("ascii")
        return AudioTurn(b64=b64, seconds=len(msg.pcm) / msg.rate)

    def render_user(self, exchange: Exchange, age: int) -> Any:
        """Text as is; audio as a content part for the newest turns, a placeholder before."""
        if not isinstance(exchange.user, AudioTurn):
            return exchange.user
        if age >= self.keep_audio_turns:
            return AUDIO_PLACEHOLDER
        if self.audio_content_type == "input_audio":
            part = {"type": "input_audio", "input_audio": {"data": exchange.user.b64, "format": "wav"}}
        else:
            part = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{exchange.user.b64}"}}
        return [{"type": "text", "text": self.audio_prompt}, part] if self.audio_prompt else [part]

    def request_body(self, tool_choice: str = "auto") -> dict[str, Any]:
        body = self.generation_options()
        body["messages"] = self.ctx.session.history(self.conversation).messages(self.render_user)
        if self.toolbox:
            # a named choice goes as "required" with that one tool: llama-server (and others) refuse
            # the object form {"type": "function", "function": {"name": ...}}, and it means the same
            name = named_tool(tool_choice)
            tools = [t for t in self.toolbox.tools.values() if t.name == name] if name else self.toolbox.tools.values()
            body["tools"] = [tool.chat_schema() for tool in tools]
            body["tool_choice"] = "required" if name else tool_choice
            if self.prefill(tool_choice):
                body["messages"].append({"role": "assistant", "content": self.prefill(tool_choice)})
        body["stream"] = self.stream
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.reasoning_effort is not None:
            body["reasoning_effort"] = self.reasoning_effort
        return {**body, **self.extra_body}

    def continued(self, body: dict[str, Any], said: str) -> dict[str, Any]:
        """The reply so far as the last, assistant message, which llama-server goes on with (its
        prompt cache holds the reply's tokens: only the last few are read again)."""
        messages = [*body["messages"], {"role": "assistant", "content": said}]
        return {**body, "messages": messages}

    def after_reply(self, exchange: Exchange) -> None:
        """A full window drops its older half with the next turn, which moves the prompt's start, and
        llama-server then shifts the kept turns in its KV cache: over every slot's cells, +250 ms to
        that turn's first token with the recipe's 5 slots, +420 ms with 9 (benchmarks/bench_history.py).
        On the session's own slot of a server this process runs, it happens before that turn instead:
        the window is trimmed and its prompt sent with one token to write, after any other session's
        first words in flight, so the next turn's prompt only extends it. With a VAD in the graph that
        is when the user speaks again (its ``SpeechStarted``): a question takes seconds, time enough
        for the shift, and a call that ends after this reply never pays for it; without one, now,
        while the listener hears the reply. Text turns only (an audio turn is summarized once it is
        no longer the newest, which changes the prompt anyway)."""
        if (self.slot.id is None or exchange.rounds or not exchange.reply or not isinstance(exchange.user, str)
                or not self.conversation.full()):
            return
        self._prepare_after = self._prepared_turn = exchange.turn
        if "started" not in self.ctx.inputs_connected:
            self._prepare_when_spoken(background=False)

    def _prepare_when_spoken(self, background: bool = True) -> None:
        """Trim the window and send its prompt; while the user speaks, on a thread of its own, which
        the next turn's request never waits for: once that request is made (``_asked``) a prepare not
        sent yet is dropped (the request shifts the cache itself), and one in flight is simply ahead
        of it on the server's slot."""
        turn, self._prepare_after = self._prepare_after, None
        if (turn is None or (self._preparing is not None and self._preparing.is_alive())
                or not self.conversation.make_room()):
            return
        body = self.request_body("auto")  # the tools of the next request (no forced call's prefill)
        body["messages"].append({"role": "assistant", "content": self.conversation.exchanges[-1].reply})
        body.update(max_tokens=1, stream=False)
        body.pop("stream_options", None)
        if not self._preparer_open:  # the session's first prepare: its connection
            self._preparer.log = self.ctx.log
            self._preparer.open(warm_up=False)
            self._preparer_open = True
        self._asked.clear()
        if not background:
            self._prepare(turn, body)
            return
        self._preparing = threading.Thread(target=self._prepare, args=(turn, body), daemon=True,
                                           name=f"{self.ctx.name}-prepare")
        self._preparing.start()

    def _prepare(self, turn: int, body: dict[str, Any]) -> None:
        until = time.monotonic() + PREPARE_WAIT_S
        dropped = lambda: self._asked.is_set() or self.ctx.stopping.is_set()  # noqa: E731
        inference.critical.yield_to(lambda: time.monotonic() < until, dropped)
        if dropped():
            self.ctx.log.debug("turn %d: the next turn came before its prompt was prepared", turn)
            return
        try:
            self._preparer.post_json(self.path, body, api=self.api_name, hint_404=self.hint_404)
        # the next turn reads its prompt as it would have: no harm done. RuntimeError: the session
        # closed the connection as this was sent (httpx: "the client has been closed")
        except (RemoteError, RuntimeError) as exc:
            self.ctx.log.debug("turn %d: the next turn's prompt was not prepared: %s", turn, exc)

    # -- answer -----------------------------------------------------------------------

    def stream_texts(self, events: Iterator[tuple[str, Any]]) -> Iterator[str | ToolCall]:
        reasoning, usage, finish, spoke = 0, None, None, False
        calls: dict[int, dict[str, str]] = {}  # tool calls stream in pieces, keyed by their index
        for _, data in events:
            if data == "[DONE]":
                continue  # read on to the end of the body: the connection stays reusable
            if not isinstance(data, dict):
                continue
            if "error" in data:
                raise RemoteError(f"the server at {self.client.base_url} reported an error: {data['error']}")
            usage = data.get("usage") or usage
            for choice in data.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    reasoning += 1  # thinking is not spoken
                if delta.get("content"):
                    spoke = True
                    yield delta["content"]
                for piece in delta.get("tool_calls") or ():
                    call = calls.setdefault(piece.get("index", len(calls)), {"id": "", "name": "", "arguments": ""})
                    function = piece.get("function") or {}
                    call["id"] = piece.get("id") or call["id"]
                    call["name"] += function.get("name") or ""
                    call["arguments"] += function.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        self.log_reply(usage=usage, reasoning=reasoning, stop=finish, spoke=spoke or bool(calls))
        yield from self._calls(calls[i] for i in sorted(calls))

    def _calls(self, calls: Iterable[dict[str, Any]]) -> Iterator[ToolCall]:
        """``{id, name, arguments}`` as the server sent them; one without a name is its fault."""
        return self.toolbox.from_server(calls, turn=self._turn or 0, sender=f"the server at {self.client.base_url}",
                                        error=RemoteError)

    def full_reply(self, answer: Any) -> list[str | ToolCall]:
        try:
            message = answer["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise RemoteError(
                f"the server at {self.client.base_url} answered without choices[0].message: "
                f"{str(answer)[:200]}"
            ) from None
        text = message.get("content") or ""
        calls = [{"id": c.get("id"), **(c.get("function") or {})} for c in message.get("tool_calls") or ()]
        self.log_reply(
            usage=answer.get("usage"), reasoning=int(bool(message.get("reasoning_content"))),
            stop=answer["choices"][0].get("finish_reason"), spoke=bool(text or calls),
        )
        return [text, *self._calls(calls)]

    def explain(self, exc: RemoteError) -> RemoteError:
        """A server that cannot take the audio or image part: say which model or stage to use instead."""
        exc = super().explain(exc)
        last = self.conversation.exchanges[-1] if self.conversation.exchanges else None
        detail = (exc.detail or "").lower()
        if last is not None and _has_image(last.user) and exc.status is not None and (
                "image" in detail or "mmproj" in detail or "multimodal" in detail):
            return RemoteError(
                f"{exc}. The model at {self.client.base_url} takes no images: serve a vision model (llama-server "
                f"-m model.gguf --mmproj mmproj.gguf, or one behind vLLM or OpenAI), or set llm.vision=false so "
                f"that clients are told at once that images are refused",
                status=exc.status, detail=exc.detail,
            )
        if last is None or not isinstance(last.user, AudioTurn) or exc.status is None:
            return exc
        if "audio" in detail or "multimodal" in detail or "mmproj" in detail or "content" in detail:
            return RemoteError(
                f"{exc}. The model at {self.client.base_url} has no audio input: serve a model with "
                f"an audio projector (llama-server -m model.gguf --mmproj mmproj.gguf, or vLLM with "
                f"an audio model), or transcribe first with an stt backend (e.g. stt=whisper) instead "
                f"of stt=none",
                status=exc.status, detail=exc.detail,
            )
        return exc


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)
