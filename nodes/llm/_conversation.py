"""What every LLM backend shares, remote or local: the bounded conversation and the
sentence splitter that turns a token stream into TextDeltas TTS can speak at once.

Backend-neutral on purpose: a backend supplies the reply as an iterator of text pieces
(tokens from an HTTP stream or from a local ``generate`` loop) and renders user turns its
own way (plain text, or an audio content part); the rest is here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from s2s_flow.messages import TextDelta

__all__ = ["Exchange", "ToolCall", "ToolRound", "Conversation", "SentenceSplitter", "reply_deltas"]


@dataclass(slots=True)
class ToolCall:
    """One call the model asked for, and what running it gave back (always text, errors included)."""

    id: str
    name: str
    arguments: str  # the JSON text the model wrote, kept as written
    result: str | None = None

    def chat(self) -> dict[str, Any]:
        """The call as Chat Completions writes it in an assistant message. Arguments that are not
        JSON (a call cut by ``max_tokens``) go back as ``{}``: the result already tells the model
        what it wrote, and a server that parses the history (llama-server) would refuse every later
        request of the conversation with HTTP 500."""
        arguments = self.arguments if self.arguments.strip() and isinstance(self.parsed_arguments(), dict) else "{}"
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}

    def parsed_arguments(self) -> Any:
        """The arguments as JSON values (chat templates want a mapping); the raw text if unparsable."""
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return self.arguments


@dataclass(slots=True)
class ToolRound:
    """The model stopped to call tools: the text it said first, and the calls."""

    text: str
    calls: list[ToolCall]


@dataclass(slots=True)
class Exchange:
    """One user turn and the assistant text actually produced for it.

    ``reply`` is everything said in the turn, tool rounds included (it is what TTS spoke and
    what a barge-in cuts); each round's ``text`` is the part of it said before that round's calls.
    """

    user: Any  # str, or whatever a backend stores for an audio turn
    turn: int
    reply: str = ""
    rounds: list[ToolRound] = field(default_factory=list)


class Conversation:
    """System prompt + at most the last ``max_turns`` exchanges; every request resends it whole.

    Stateless requests keep servers interchangeable and make a dropped reply harmless; the
    bound keeps the prompt (and its prefill time) from growing without limit. A full window
    drops its older half at once (``max_turns // 2 + 1`` exchanges stay, the new one included),
    not one exchange a turn: a server's prompt cache (llama-server, a provider's prefix cache)
    serves each request from the previous one's whenever the prompt only grew, and a prompt
    whose start moved costs it more. llama-server shifts the kept turns in its KV cache, and the
    shift runs over every slot's cells (the recipe's -np 5: +250 ms to that turn's first token, all
    sessions' generation waiting meanwhile): once every ``max_turns // 2`` turns, not every turn.
    """

    def __init__(self, system_prompt: str | None, max_turns: int) -> None:
        self.system_prompt = system_prompt or None
        self.max_turns = max_turns
        self.exchanges: list[Exchange] = []
        self.unconfirmed: set[int] = set()  # turns opened on a speculative transcript

    def add_user(self, user: Any, turn: int, *, speculative: bool = False) -> Exchange:
        """Open a new exchange; past ``max_turns`` the older half of the window falls out."""
        exchange = Exchange(user=user, turn=turn)
        self.exchanges.append(exchange)
        if len(self.exchanges) > self.max_turns:
            del self.exchanges[: -(self.max_turns // 2 + 1)]
        if speculative:
            self.unconfirmed.add(turn)
        return exchange

    def full(self) -> bool:
        """The window holds ``max_turns`` exchanges: the next turn drops the older half."""
        return len(self.exchanges) >= self.max_turns

    def make_room(self) -> bool:
        """Drop the older half of a full window now, as the next ``add_user`` would (so a server's
        cache can move between turns, not in the next turn's request); True if it did."""
        if len(self.exchanges) < self.max_turns:
            return False
        del self.exchanges[: len(self.exchanges) - self.max_turns // 2]
        return True

    def settle(self, turn: int, speculative: bool, played: Callable[[int], bool] = lambda turn: False) -> bool:
        """Speculative turns (``vad.speculate_ms``): True when this user message of ``turn`` only
        confirms a turn already answered on its speculative transcript (no second reply).
        Otherwise a new user turn begins, and each speculative turn never confirmed is
        forgotten first: the user went on, and the whole utterance comes again as this turn.
        A turn whose reply was ``played`` was confirmed, even if its confirming transcript never
        came (a barge-in made it stale on its way): only confirmed replies are played."""
        self.unconfirmed -= {t for t in self.unconfirmed if played(t)}
        if not speculative and turn in self.unconfirmed:
            self.unconfirmed.discard(turn)
            return True
        if self.unconfirmed:
            self.exchanges = [e for e in self.exchanges if e.turn not in self.unconfirmed]
            self.unconfirmed.clear()
        return False

    def record_reply(self, exchange: Exchange, text: str) -> None:
        """Keep the reply as produced (possibly partial: an interrupt or a broken stream)."""
        exchange.reply = text

    def truncate_last_reply(self, text: str) -> None:
        """Cut the last reply to what the user really heard (set by the live-audio path)."""
        if self.exchanges:
            self.exchanges[-1].reply = text

    def messages(self, render_user: Callable[[Exchange, int], Any] | None = None) -> list[dict[str, Any]]:
        """Chat messages, oldest first: system, then each turn's user message, its tool rounds
        (an assistant message with ``tool_calls``, then one ``tool`` message per call) and its
        reply; the open turn last, with the rounds it made so far.

        ``render_user(exchange, age)`` gives a user message's content; ``age`` is 0 for
        the newest turn (a backend keeps audio for the newest few and summarizes older).
        A turn interrupted before it said anything leaves no assistant message; its user
        message is joined to the next one, so roles still alternate for strict templates.
        """
        out: list[dict[str, Any]] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        last = len(self.exchanges) - 1
        for i, ex in enumerate(self.exchanges):
            content = render_user(ex, last - i) if render_user else ex.user
            if out and out[-1]["role"] == "user":
                out[-1]["content"] = _joined(out[-1]["content"], content)
            else:
                out.append({"role": "user", "content": content})
            rest = ex.reply if i < last else None  # the open turn's reply is not known yet
            for r in ex.rounds:
                said = r.text if rest is None else rest[: len(r.text)]
                rest = None if rest is None else rest[len(r.text):]
                out.append({"role": "assistant", "content": said or None, "tool_calls": [c.chat() for c in r.calls]})
                out += [{"role": "tool", "tool_call_id": c.id, "content": c.result or ""} for c in r.calls]
            if rest:
                out.append({"role": "assistant", "content": rest})
        return out


def _joined(first: Any, second: Any) -> Any:
    """Two user messages in a row as one: text joined by a newline, content parts concatenated."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n{second}"

    def parts(content: Any) -> list[Any]:
        return list(content) if isinstance(content, list) else [{"type": "text", "text": str(content)}]

    return parts(first) + parts(second)


# -- sentence splitting ---------------------------------------------------------------

_TERMINATORS = ".!?\u2026\u3002\uff01\uff1f"  # . ! ? … 。 ！ ？
_CJK_TERMINATORS = "\u3002\uff01\uff1f"
_CLOSERS = "\"')]}\u201d\u2019\u00bb*_"  # closing quotes/brackets/markdown that belong to the sentence
# Never end a sentence: titles and Latin abbreviations that usually continue it.
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "cf", "eg", "ie", "e.g", "i.e",
    "approx", "dept", "est", "fig", "vol", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep",
    "sept", "oct", "nov", "dec", "inc", "ltd", "co", "corp", "a.m", "p.m",
})
# End a sentence only when the next word starts with a capital: "etc. The" vs "etc. and".
_SOFT_ABBREVIATIONS = frozenset({"etc", "al"})
_LIST_MARKER = re.compile(r"(?:^|\n)[ \t]*\d{1,3}$")


class SentenceSplitter:
    """Marks sentence ends in a token stream as early as they are certain.

    Text is released as it arrives, except a trailing terminator (".", "!", "...") whose
    meaning depends on what follows: "3.5", "example.com", "Dr. Smith", "e.g. this",
    "Well... no". That tail waits for one more character (rarely one more word), so the
    first sentence goes to TTS one token after its full stop, never batched with the next.
    A newline also ends a sentence. Sentences with fewer than ``min_chars`` letters and
    digits ("Ok.", "1.", "A.") merge into the next: TTS is not woken for a syllable.
    """

    def __init__(self, min_chars: int = 3) -> None:
        self.min_chars = min_chars
        self._sentence = ""  # released text of the open sentence
        self._held = ""  # text not released yet: its boundary is undecided

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """Pieces ``(text, sentence_end)`` to release now; their concatenation is lossless."""
        if not text:
            return []
        s = self._sentence + self._held + text
        start = len(self._sentence)  # s[:start] is released already
        base = 0  # s[base:] is the open sentence
        pieces: list[tuple[str, bool]] = []
        i = start
        while i < len(s):
            if s[i] == "\n":
                end, nxt = i + 1, i + 1
            elif s[i] in _TERMINATORS:
                end, nxt = self._boundary(s, base, i)
                if nxt is None:  # undecided: hold from the terminator on
                    if i > start:
                        pieces.append((s[start:i], False))
                    self._sentence, self._held = s[base:i], s[i:]
                    return pieces
            else:
                i += 1
                continue
            if end is not None and self._long_enough(s[base:end]):
                pieces.append((s[start:end], True))
                base = start = end
            i = nxt
        if len(s) > start:
            pieces.append((s[start:], False))
        self._sentence, self._held = s[base:], ""
        return pieces

    def flush(self) -> list[tuple[str, bool]]:
        """End of the reply: release what was held; the last sentence ends here."""
        text, self._held = self._held, ""
        had_text = bool((self._sentence + text).strip())
        self._sentence = ""
        return [(text, True)] if had_text else ([(text, False)] if text else [])

    def _long_enough(self, sentence: str) -> bool:
        return sum(c.isalnum() for c in sentence) >= self.min_chars

    def _boundary(self, s: str, base: int, i: int) -> tuple[int | None, int | None]:
        """Judge the terminator at ``s[i]``: ``(end, next)`` for a sentence ending at ``end``,
        ``(None, next)`` for none, ``(None, None)`` when the text so far cannot tell."""
        j = i
        while j < len(s) and s[j] in _TERMINATORS:
            j += 1
        while j < len(s) and s[j] in _CLOSERS:
            j += 1
        if j == len(s):
            return None, None
        cluster = s[i:j].rstrip(_CLOSERS)
        if any(c in _CJK_TERMINATORS for c in cluster):
            return j, j
        if not s[j].isspace():  # "3.5", "example.com", "e.g.", "?!" inside a word
            return None, j
        quoted = any(c in "\"'\u201d\u2019\u00bb" for c in s[i:j])
        if ("!" in cluster or "?" in cluster) and not quoted:
            return j, j
        before = s[base:i]
        word = before.rsplit(None, 1)[-1] if before.strip() else ""
        bare = word.lstrip("\"'([{\u201c\u2018*_").lower()
        ellipsis = cluster != "."
        if not ellipsis and not quoted:
            if bare in _ABBREVIATIONS or (len(bare) == 1 and bare.isalpha()):
                return None, j  # "Dr. Smith", "J. K. Rowling"
            if bare.isdigit() and _LIST_MARKER.search(before):
                return None, j  # "1. Rome" at the start of a line
            if bare not in _SOFT_ABBREVIATIONS:
                return j, j
        # "Well... I see", "etc. The", '"Hi!" he said': a sentence ends before a capital or newline
        k = j
        while k < len(s) and s[k].isspace():
            k += 1
        if k == len(s):
            return None, None
        return (j, j) if s[k].isupper() or "\n" in s[j:k] else (None, j)


def reply_deltas(
    pieces: Iterable[str],
    *,
    turn: int,
    conversation: Conversation,
    exchange: Exchange,
    log: logging.Logger,
    interrupted: Callable[[], bool] = lambda: False,
    min_sentence_chars: int = 3,
) -> Iterator[TextDelta]:
    """Stream a reply as TextDeltas with sentence marks, then ``TextDelta("", end=True)``.

    The reply is recorded in ``conversation`` as far as it was produced, whatever stops it:
    the end, an error, or the engine closing this generator on barge-in. An error still
    emits the end marker first (with the error), so TTS and sinks close the turn before the graph stops.
    """
    splitter = SentenceSplitter(min_sentence_chars)
    produced: list[str] = []
    source = iter(pieces)
    try:
        closes_sentence = False
        for chunk in source:
            for text, sentence_end in splitter.feed(chunk):
                produced.append(text)
                yield TextDelta(turn=turn, text=text, sentence_end=sentence_end)
        for text, sentence_end in splitter.flush():
            if text:
                produced.append(text)
                yield TextDelta(turn=turn, text=text, sentence_end=sentence_end)
            else:  # everything was released already: the end marker closes the sentence
                closes_sentence = sentence_end
        if not "".join(produced).strip() and not interrupted():
            log.warning("turn %d: the model returned an empty reply", turn)
        yield TextDelta(turn=turn, text="", sentence_end=closes_sentence, end=True)
    except Exception as exc:
        yield TextDelta(turn=turn, text="", end=True, error=str(exc) or type(exc).__name__)
        raise
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # at once: a generator over an HTTP stream closes its connection
        conversation.record_reply(exchange, "".join(produced))
