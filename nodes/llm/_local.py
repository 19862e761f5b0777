"""The part the in-process LLMs (``llm=transformers``, ``llm=mlx``) share: sampling options,
the chat template, tool calls written in the model's text, and the key/value cache kept between
turns; the turn around a generation is every LLM's (``_base.py``). A subclass loads the model
once per process (``load_model``, through the node contract's shared resources) and implements
``generate`` (prompt token ids -> text pieces); each session's node keeps its own history and cache.
Each generation holds a slot of the model's scheduler (``inference_key()``, s2s_flow/inference.py)
from its prompt to its last token: a confirmed turn's reply goes before a speculative one's.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nodes._hub import model_path
from nodes.llm._base import LLMBase, check_range
from nodes.llm._conversation import Conversation, Exchange, ToolCall
from nodes.llm._tools import forces_call
from s2s_flow.errors import ConfigError
from s2s_flow.inference import Cancelled, Shed
from s2s_flow.messages import Transcript

__all__ = ["LocalLLM", "SharedModel", "split_tool_calls"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
THINK_START, THINK_END = "<think>", "</think>"
THINKING_SWITCH = re.compile(r"\benable_thinking\b")  # a chat template that reads the switch
WARMUP_TEXT = "Hello."
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"  # Qwen3 / Hermes: a JSON call between the tags
_NAMED_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:(?P<arguments>.*)$', re.S)


@dataclass
class SharedModel:
    """What the sessions of a process share: the weights and the tokenizer, warmed up (a holder:
    a tuple cannot be weakly referenced). Nothing a session changes lives here."""

    model: Any
    tokenizer: Any


class LocalLLM(LLMBase):
    """Shared body of the in-process LLMs: a subclass loads a model and tokenizer in
    :meth:`load_model` and implements :meth:`generate` (prompt token ids -> text pieces)."""

    inputs = {"text": Transcript}

    backend: ClassVar[str]  # "llm=transformers", for messages

    def __init__(
        self,
        *,
        model: str,
        max_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 0.8,
        seed: int | None = None,
        enable_thinking: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prompt_cache: bool = True,
        **options: Any,
    ) -> None:
        """``options``: the conversation and tool options of every LLM (``LLMBase``)."""
        if not model:
            raise ConfigError(f"llm.model is empty: give a hub id or a local model directory ({self.backend})")
        check_range(max_tokens >= 1, "max_tokens", max_tokens, "at least 1")
        check_range(0 <= temperature <= 2, "temperature", temperature, "0 (greedy) to 2")
        check_range(0 < top_p <= 1, "top_p", top_p, "in (0, 1]; 1 turns it off")
        super().__init__(**options)
        self.model = model_path(model)
        self.max_tokens, self.temperature, self.top_p, self.seed = max_tokens, float(temperature), top_p, seed
        self.enable_thinking = enable_thinking
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._shared: SharedModel | None = None  # the process's model: held, so it stays loaded
        self._model: Any = None
        self._tokenizer: Any = None
        self._prompt_opens_thinking = False
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

    def load_model(self) -> SharedModel:
        """Load the weights and tokenizer (once per process per ``shared_key()``)."""
        raise NotImplementedError

    def generate(self, prompt_ids: list[int], stop: threading.Event) -> Generator[str, None, None]:
        """Reply text pieces for the prompt; stop at the next token once ``stop`` is set,
        and also when the generator is closed. Sets ``last_reply_tokens`` and ``last_stop``."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------

    def setup(self) -> None:
        """Take the process's model (the first session loads and warms it up), check it against
        this session's options (every session is told what is wrong with it), then prime this
        session's prompt cache."""
        self.bind(self.shared())
        self.check_chat_template()
        self.prime()

    def prime(self) -> None:
        """Run the system prompt through the model into this session's own cache, while the
        session starts (the user is still speaking): its first turn then prefills only its own
        words, as every later turn does."""
        if not self.prompt_cache:
            return
        start = time.monotonic()
        self._first_steps()
        self.ctx.log.info("prompt cache primed: %d tokens in %.2f s", len(self._cache_ids), time.monotonic() - start)

    def load_shared(self) -> SharedModel:
        loaded = self.load_model()
        self.bind(loaded)
        if self.has_chat_template():  # without one, setup() says so, to every session
            self.warm_up()
        return loaded

    def bind(self, loaded: SharedModel) -> None:
        """Use ``loaded`` for this session's generations."""
        self._shared, self._model, self._tokenizer = loaded, loaded.model, loaded.tokenizer

    def chat_prompt(self, messages: list[dict[str, Any]], tool_choice: str = "none") -> list[int]:
        """Token ids of the conversation in the model's chat template, ready for the reply.

        ``enable_thinking`` goes to templates that read it (Qwen3 and friends); thinking is
        off by default because a voice agent would otherwise think aloud before answering.
        Tools go to the template's own ``tools`` support; a required (or named) tool choice
        opens the call in the prompt, so the model can only write one (see :meth:`call_prefill`).
        """
        kwargs = self.template_kwargs()
        if self.toolbox and tool_choice != "none":
            kwargs["tools"] = [tool.chat_schema() for tool in self.toolbox.tools.values()]
        text = self._tokenizer.apply_chat_template(
            template_messages(messages), tokenize=False, add_generation_prompt=True, **kwargs)
        self._prompt_opens_thinking = text.rstrip().endswith(THINK_START)
        text += self.call_prefill(tool_choice)[0]
        return list(self._tokenizer.encode(text, add_special_tokens=False))  # the template has the BOS

    def call_prefill(self, tool_choice: str) -> tuple[str, str]:
        """(text appended to the prompt, the part of it inside the call) that forces a call:
        ``<tool_call>`` for ``required``, and the function's name too for a named choice."""
        if not forces_call(tool_choice) or not self.toolbox:
            return "", ""
        inside = "" if tool_choice == "required" else f'\n{{"name": "{tool_choice}", "arguments": '
        return TOOL_START + inside, inside

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template: the thinking switch where the template reads it."""
        kwargs: dict[str, Any] = {}
        if THINKING_SWITCH.search(str(self._tokenizer.chat_template or "")):
            kwargs["enable_thinking"] = self.enable_thinking
        return {**kwargs, **self.chat_template_kwargs}

    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def check_chat_template(self) -> None:
        if not self.has_chat_template():
            raise ConfigError(
                f"llm.model={self.model!r} has no chat template (a base model?): choose an instruct "
                f"or chat model, e.g. the default of {self.backend}"
            )
        self.check_tool_template()

    def check_tool_template(self) -> None:
        """Tools reach the model only through its chat template: say so when it ignores them."""
        source = str(self._tokenizer.chat_template or "")
        if self.toolbox and not re.search(r"\btools\b", source):
            raise ConfigError(
                f"llm.tools is set but the chat template of llm.model={self.model!r} never mentions tools, so the "
                f"model would not see them: choose a model that calls tools (e.g. Qwen3), or drop llm.tools"
            )
        if self.toolbox and TOOL_START not in source:
            self.ctx.log.warning("the chat template of %s does not write %s: its tool calls may not be "
                                 "recognised (llm=%s reads Qwen3 / Hermes-style calls)", self.model, TOOL_START,
                                 self.backend.removeprefix("llm="))

    def warm_up(self) -> None:
        """One short generation, once per process (``load_shared``): the first turn of every
        session then pays no allocation or kernel-selection cost."""
        self.ctx.progress(f"warming up {self.model}")
        start = time.monotonic()
        self._first_steps()
        self._cache, self._cache_ids = None, []  # the process's warm-up: no session's cache
        self.ctx.log.info("warm-up: %.2f s", time.monotonic() - start)

    def _first_steps(self) -> None:
        """Prefill a short exchange under the system prompt and take the first decoding steps."""
        messages = Conversation(self.conversation.system_prompt, 1)
        messages.add_user(WARMUP_TEXT, 0)
        with self.inference_slot("first"):  # a session priming its cache while another generates
            pieces = self.generate(self.chat_prompt(messages.messages()), threading.Event())
            next(pieces, None)
            pieces.close()

    def stop_reply(self) -> None:
        stop = self._stop
        if stop is not None:
            stop.set()

    def _hold_slot(self, held: contextlib.ExitStack, turn: int) -> bool:
        """Take a slot of the shared model for the whole generation (a speculative reply's is shed
        under load: it waits for its turn's confirmation); False: the turn went stale meanwhile."""
        stop = self._stop
        cancelled = lambda: (self.stale(turn) or self.ctx.stopping.is_set()  # noqa: E731
                             or (stop is not None and stop.is_set()))
        while True:
            try:
                held.enter_context(self.inference_slot("first", turn=turn, cancelled=cancelled))
            except Cancelled:  # a barge-in while another session's reply was being generated
                self.last_reply_tokens, self.last_stop = 0, "interrupted"
                return False
            except Shed as shed:
                self.ctx.log.debug("turn %d: %s; waiting for its confirmation", turn, shed)
                if not self.ctx.work.wait_confirmed(turn, cancelled):
                    return False
                continue
            if cancelled():
                self.last_reply_tokens, self.last_stop = 0, "interrupted"
                return False
            return True

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

    def respond(self, exchange: Exchange, tool_choice: str) -> Iterator[str | ToolCall]:
        """One generation: text pieces, and with tools the calls it wrote (never spoken)."""
        turn = exchange.turn
        if self.stale(turn):
            return
        prompt_ids = self.chat_prompt(self.ctx.session.history(self.conversation).messages(), tool_choice)
        self._stop, self._turn = threading.Event(), turn
        if self.stale(turn):  # interrupted while the prompt was being built
            self._stop, self._turn = None, None
            return
        start = time.monotonic()
        with contextlib.ExitStack() as held:
            if not self._hold_slot(held, turn):
                self._stop, self._turn = None, None
                return
            generation = self.generate(prompt_ids, self._stop)
            try:
                pieces: Iterable[str] = generation
                if self.enable_thinking:
                    pieces = _without_thinking(generation, opened=self._prompt_opens_thinking)
                if self.toolbox:
                    opened = self.call_prefill(tool_choice)[1] if forces_call(tool_choice) else None
                    pieces = split_tool_calls(pieces, opened=opened, new_id=lambda: self.toolbox.new_id(turn))
                yield from pieces
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


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as chat templates expect it: a tool call's arguments as a mapping (Qwen3
    accepts text too, Llama 3 and others want the mapping), an empty content as ""."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.parsed_arguments()}}
                     for c in calls]
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        out.append(m)
    return out


def split_tool_calls(
    pieces: Iterable[str], *, opened: str | None = None, new_id: Callable[[], str],
) -> Iterator[str | ToolCall]:
    """Text pieces with the ``<tool_call>{json}</tool_call>`` sections taken out, then the calls.

    Text that might be the start of a tag is held until the next piece tells, so a call is
    never spoken. ``opened``: the prompt already opened a call, with this text inside it. A
    call the model did not close (it stopped at end of turn) is read up to the end; one that
    is not JSON becomes a call without a name, whose result tells the model so.
    """
    held = "" if opened is None else opened
    inside = opened is not None
    calls: list[ToolCall] = []
    for piece in pieces:
        held += piece
        while True:
            if inside:
                end = held.find(TOOL_END)
                if end < 0:
                    break
                calls.append(_parse_call(held[:end], new_id()))
                held, inside = held[end + len(TOOL_END):], False
                continue
            start = held.find(TOOL_START)
            if start >= 0:
                if held[:start].strip():
                    yield held[:start]
                held, inside = held[start + len(TOOL_START):], True
                continue
            keep = next((n for n in range(min(len(held), len(TOOL_START) - 1), 0, -1)
                         if TOOL_START.startswith(held[-n:])), 0)
            if len(held) > keep and (not calls or held[: len(held) - keep].strip()):
                yield held[: len(held) - keep]
                held = held[len(held) - keep:]
            break
    if inside:
        calls.append(_parse_call(held, new_id()))
    elif held and (not calls or held.strip()):
        yield held
    yield from calls


def _parse_call(text: str, call_id: str) -> ToolCall:
    try:
        data = json.loads(text.strip())
        name, arguments = data["name"], data.get("arguments", data.get("parameters", {}))
        if not isinstance(name, str):
            raise TypeError(name)
    except (ValueError, KeyError, TypeError, AttributeError):
        named = _NAMED_CALL.match(text)  # a name, then arguments that are not JSON: name them in the result
        if named:
            return ToolCall(id=call_id, name=named["name"], arguments=named["arguments"].strip().removesuffix("}"))
        return ToolCall(id=call_id, name="", arguments=text.strip())
    return ToolCall(id=call_id, name=name,
                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


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
