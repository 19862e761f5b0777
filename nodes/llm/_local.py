"""The part the in-process LLMs (``llm=transformers``, ``llm=mlx``) share: options, the
bounded history, the chat template, turn handling and interrupts. A subclass loads a
model in ``setup()`` and implements ``generate`` (prompt token ids -> text pieces).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from typing import Any, ClassVar

from nodes._hub import model_path
from nodes._playback import truncate_to_heard
from nodes._remote import RemoteLLM, check_range
from nodes.llm._conversation import Conversation, Exchange, reply_deltas
from s2s_flow.errors import ConfigError
from s2s_flow.messages import Message, TextDelta, Transcript
from s2s_flow.node import Node

__all__ = ["LocalLLM"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
THINK_START, THINK_END = "<think>", "</think>"
THINKING_SWITCH = re.compile(r"\benable_thinking\b")  # a chat template that reads the switch
WARMUP_TEXT = "Hello."


class LocalLLM(Node):
    """Shared body of the in-process LLMs: a subclass loads a model and tokenizer in
    ``setup()`` and implements :meth:`generate` (prompt token ids -> text pieces)."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    backend: ClassVar[str]  # "llm=transformers", for messages
    DEFAULT_SYSTEM_PROMPT: ClassVar[str] = RemoteLLM.DEFAULT_SYSTEM_PROMPT

    def __init__(
        self,
        *,
        model: str,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        max_history_turns: int = 8,
        max_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 0.8,
        seed: int | None = None,
        enable_thinking: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prompt_cache: bool = True,
    ) -> None:
        if not model:
            raise ConfigError(f"llm.model is empty: give a hub id or a local model directory ({self.backend})")
        check_range(max_history_turns >= 1, "max_history_turns", max_history_turns, "at least 1")
        check_range(max_tokens >= 1, "max_tokens", max_tokens, "at least 1")
        check_range(0 <= temperature <= 2, "temperature", temperature, "0 (greedy) to 2")
        check_range(0 < top_p <= 1, "top_p", top_p, "in (0, 1]; 1 turns it off")
        self.model = model_path(model)
        self.max_tokens, self.temperature, self.top_p, self.seed = max_tokens, float(temperature), top_p, seed
        self.enable_thinking = enable_thinking
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.conversation = Conversation(system_prompt, max_history_turns)
        self._tokenizer: Any = None
        self._prompt_opens_thinking = False
        self._stale_below = -(2**62)  # turns below this were interrupted
        self._turn: int | None = None  # the turn being generated
        self._stop: threading.Event | None = None  # set: the reply in progress stops at its next token
        #: keep the model's key/value cache between turns: a turn then only encodes what follows
        #: the longest prefix it shares with the previous prompt and reply (history, system prompt)
        self.prompt_cache = prompt_cache
        self._cache: Any = None  # the key/value cache kept between turns
        self._cache_ids: list[int] = []  # the tokens it holds
        self.last_prompt_reused = 0  # prompt tokens the last reply took from the cache
        self.last_reply_tokens = 0  # tokens generated for the last reply (logs, tests)
        self.last_stop = ""  # why it ended: "eos", "length" or "interrupted"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r})"

    # -- what a subclass provides -----------------------------------------------------

    def generate(self, prompt_ids: list[int], stop: threading.Event) -> Generator[str, None, None]:
        """Reply text pieces for the prompt; stop at the next token once ``stop`` is set,
        and also when the generator is closed. Sets ``last_reply_tokens`` and ``last_stop``."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation in the model's chat template, ready for the reply.

        ``enable_thinking`` goes to templates that read it (Qwen3 and friends); thinking is
        off by default because a voice agent would otherwise think aloud before answering.
        """
        kwargs = self.template_kwargs()
        text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        self._prompt_opens_thinking = text.rstrip().endswith(THINK_START)
        return list(self._tokenizer.encode(text, add_special_tokens=False))  # the template has the BOS

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template: the thinking switch where the template reads it."""
        kwargs: dict[str, Any] = {}
        if THINKING_SWITCH.search(str(self._tokenizer.chat_template or "")):
            kwargs["enable_thinking"] = self.enable_thinking
        return {**kwargs, **self.chat_template_kwargs}

    def check_chat_template(self) -> None:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ConfigError(
                f"llm.model={self.model!r} has no chat template (a base model?): choose an instruct "
                f"or chat model, e.g. the default of {self.backend}"
            )

    def warm_up(self) -> None:
        """One short generation: the first turn then pays no allocation or kernel-selection cost."""
        self.ctx.progress(f"warming up {self.model}")
        start = time.monotonic()
        messages = Conversation(self.conversation.system_prompt, 1)
        messages.add_user(WARMUP_TEXT, 0)
        pieces = self.generate(self.chat_prompt(messages.messages()), threading.Event())
        next(pieces, None)  # prefill and the first decoding steps
        pieces.close()
        self.ctx.log.info("warm-up: %.2f s", time.monotonic() - start)

    def reset(self) -> None:
        self.conversation = Conversation(self.conversation.system_prompt, self.conversation.max_turns)

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        text = getattr(msg, "text", "")
        if not getattr(msg, "final", True):
            return  # partial transcripts: wait for the final one
        if not text.strip():
            self.ctx.log.info("turn %d: empty transcript, no reply", msg.turn)
            return
        truncate_to_heard(self.ctx, self.conversation)  # after a barge-in: keep what was heard
        exchange: Exchange = self.conversation.add_user(text, msg.turn)
        yield from reply_deltas(
            self._reply(msg.turn), turn=msg.turn, conversation=self.conversation, exchange=exchange,
            log=self.ctx.log, interrupted=lambda: msg.turn < self._stale_below,
        )

    def on_interrupt(self, turn: int) -> None:
        self._stale_below = max(self._stale_below, turn)
        stop, current = self._stop, self._turn
        if stop is not None and current is not None and current < turn:
            stop.set()

    def close(self) -> None:
        stop = self._stop
        if stop is not None:
            stop.set()

    # -- the prompt cache: the backend trims and makes caches, the rest is shared ---------

    def reusable_cache(self, prompt_ids: list[int]) -> tuple[Any, int]:
        """(cache, prompt tokens it already holds): the kept cache cut back to what this prompt
        shares with it, or a fresh one; (None, 0) when prompt_cache is off or the model's cache
        cannot be cut (sliding windows, recurrent state)."""
        self.last_prompt_reused = 0
        if not self.prompt_cache:
            return None, 0
        cache, self._cache, cached = self._cache, None, self._cache_ids  # in use: never shared
        if cache is not None:
            keep = shared_prefix(cached, prompt_ids)
            if keep > 0 and self.trim_cache(cache, len(cached) - keep):
                self.last_prompt_reused = keep
                return cache, keep
        return self.new_cache(), 0

    def trim_cache(self, cache: Any, drop: int) -> bool:
        """Drop the last ``drop`` tokens from ``cache``; False when it cannot be cut."""
        raise NotImplementedError

    def new_cache(self) -> Any:
        """An empty cache for this model, or None when it could not be cut later."""
        raise NotImplementedError

    def _reply(self, turn: int) -> Iterator[str]:
        if turn < self._stale_below:
            return
        prompt_ids = self.chat_prompt(self.conversation.messages())
        self._stop, self._turn = threading.Event(), turn
        if turn < self._stale_below:  # interrupted while the prompt was being built
            self._stop, self._turn = None, None
            return
        start = time.monotonic()
        generation = self.generate(prompt_ids, self._stop)
        try:
            if self.enable_thinking:
                yield from _without_thinking(generation, opened=self._prompt_opens_thinking)
            else:
                yield from generation
        finally:
            generation.close()  # stops the generation now, whichever way the reply ended
            self._stop, self._turn = None, None
        self.ctx.log.debug(
            "turn %d: %d prompt tokens (%d from the cache), %d generated in %.2f s (%s)",
            turn, len(prompt_ids), self.last_prompt_reused, self.last_reply_tokens, time.monotonic() - start,
            self.last_stop,
        )
        if self.last_stop == "length":
            self.ctx.log.warning("the reply hit the token limit (llm.max_tokens=%d) and was cut", self.max_tokens)


# -- helpers ------------------------------------------------------------------------


def shared_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many leading prompt tokens a cache of ``cached`` tokens already holds. One token is
    always left to encode: generation needs the logits of the prompt's last token."""
    n = 0
    for a, b in zip(cached, prompt, strict=False):  # lengths differ
        if a != b:
            break
        n += 1
    return min(n, len(prompt) - 1)


def _without_thinking(pieces: Iterator[str], *, opened: bool) -> Iterator[str]:
    """Drop the ``<think>...</think>`` section a thinking model writes before its answer.

    ``opened``: the chat template already opened the section in the prompt. A reply that
    does not start with one passes through untouched; thoughts never closed are not spoken.
    """
    held: str | None = ""  # None once the answer streams through
    thinking = opened
    for piece in pieces:
        if held is None:
            yield piece
            continue
        held += piece
        if not thinking:
            head = held.lstrip()
            if head.startswith(THINK_START):
                thinking = True
            elif THINK_START.startswith(head):
                continue  # may still become "<think>"
            else:
                out, held = held, None
                yield out
                continue
        if THINK_END in held:
            rest, held, thinking = held.split(THINK_END, 1)[1].lstrip(), None, False
            if rest:
                yield rest
    if held and not thinking:
        yield held
