"""The text signal of the end of a turn: does what the user said so far read as finished?

``vad.turn=hybrid`` ends a turn early only when the audio (Smart Turn) and the words agree. The
words are the speculative transcript (``vad.speculate_ms``), read by the LLM already loaded:
the probability that the user's message ends here, as LiveKit's turn detector reads it (the
text lower-cased, punctuation removed, the chat template's end-of-turn token cut off; the
probability of what comes next). The LLM node scores each speculative transcript before it
starts the reply (for llama-server the reply's prompt then shares the scored one's cache) and
posts the score here; the VAD reads it at the pause. The record lives in the run-wide
``ctx.run_state`` dict, so every node of one session sees the same one::

    turn_text_of(self.ctx).post(turn, probability)     # an LLM, on a speculative transcript
    turn_text_of(self.ctx).get(turn)                   # the VAD, at the pause (None: not yet)

What "ends here" means for a model that was not fine-tuned for it: LiveKit's model is a
SmolLM2-135M trained to predict ``<|im_end|>`` after unpunctuated words; the bundled
SmolLM2-135M-Instruct is the same base without that training, and after the words of a finished
question it gives ``<|im_end|>`` almost nothing but puts back the question mark (p ~0.5-0.9),
and after "set a timer for" a space (0.9). So the end probability counts the end-of-turn token
and the punctuation that ends a sentence (``END_TEXTS``): the chance the message is over at
this word. On the turn-taking corpus (benchmarks/bench_turn.py; Whisper's transcripts) it was
under 0.33 at 95 % of the pauses after an unfinished clause and over 0.4 at half of the finished
ends; at 0.3 (vad.text_threshold) 2 of 32 pauses and 23 of 32 ends read as finished.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from typing import Any

from s2s_flow.node import Context

__all__ = ["TurnText", "turn_text_of", "normalise", "end_probability", "END_TEXTS", "cut_end_token",
           "ServerScorer", "scoring_messages"]

#: next tokens that end the user's sentence where the words stop (besides the template's end token)
END_TEXTS = frozenset({".", "?", "!", "...", "\n"})
_PUNCTUATION = re.compile(r"[^\w\s'-]")
_TEMPLATE_TOKEN = re.compile(r"<\|?[A-Za-z_]+\|?>|\[/?[A-Z_]+\]")  # <|im_end|>, <end_of_turn>, [/INST]
#: messages of history before the user's words: LiveKit's detector reads a few turns of context
CONTEXT_MESSAGES = 4


def normalise(text: str) -> str:
    """As LiveKit's detector reads the user's words: lower case, no punctuation, single spaces."""
    return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())


def cut_end_token(prompt: str, text: str) -> tuple[str, str] | None:
    """The templated prompt cut just after the user's ``text``, and the template's end-of-turn
    token that followed it (``<|im_end|>``); None when the template shows no such token."""
    at = prompt.rfind(text)
    if at < 0:
        return None
    end = at + len(text)
    found = _TEMPLATE_TOKEN.match(prompt[end:].lstrip(" "))
    return (prompt[:end], found.group(0)) if found else None


def end_probability(top: Mapping[str, float], end_token: str) -> float:
    """The chance the message ends after the words, from the next token's top probabilities."""
    return min(1.0, sum(p for token, p in top.items() if token.strip(" ") in (END_TEXTS | {end_token})))


class TurnText:
    """Thread-safe: written by the LLM's thread, read by the VAD's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scores: dict[int, float] = {}
        self.wanted = False  # a VAD with vad.turn=hybrid reads the scores
        self.scorer: str | None = None  # the LLM that gives them (its group option), once it can

    def post(self, turn: int, probability: float) -> None:
        with self._lock:
            self._scores[turn] = probability
            for old in [t for t in self._scores if t < turn - 8]:
                del self._scores[old]

    def get(self, turn: int) -> float | None:
        with self._lock:
            return self._scores.get(turn)


_LOCK = threading.Lock()


def turn_text_of(ctx: Context) -> TurnText:
    """The session's record: every node of one scheduler run gets the same object."""
    with _LOCK:
        return ctx.run_state.setdefault("turn_text", TurnText())


def scoring_messages(history: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """What the scorer reads: the system prompt, the last few messages, the user's words normalised."""
    system = [m for m in history[:1] if m.get("role") == "system"]
    recent = [m for m in history[len(system):] if isinstance(m.get("content"), str)][-CONTEXT_MESSAGES:]
    return [*system, *recent, {"role": "user", "content": normalise(text)}]


class ServerScorer:
    """The end probability from llama-server's own endpoints: ``/apply-template`` renders the
    model's chat template, ``/completion`` with ``n_probs`` gives the next token's top
    probabilities (with ``cache_prompt`` the reply's request finds the prefix in its slot)."""

    TOP = 20  # top probabilities asked for: the end tokens are among them when they matter

    def __init__(self, client: Any) -> None:
        self.client = client  # a nodes._http.RemoteClient on the server's root URL
        self.slot: int | None = None  # the server slot the scores go to (nodes/llm/_slots.py); None: any

    def probability(self, messages: list[dict[str, Any]]) -> float | None:
        """None: the template has no end-of-turn token to cut off after the user's words."""
        found = self.next_token(messages)
        return None if found is None else end_probability(*found)

    def next_token(self, messages: list[dict[str, Any]]) -> tuple[dict[str, float], str] | None:
        """The next token's top probabilities after the user's words, and the template's end token."""
        text = messages[-1]["content"]
        if not text:
            return None
        api = "llama-server end-of-turn score"
        prompt = self.client.post_json("/apply-template", {"messages": messages}, api=api)["prompt"]
        cut = cut_end_token(prompt, text)
        if cut is None:
            return None
        body = {"prompt": cut[0], "n_predict": 1, "n_probs": self.TOP, "temperature": 0.0, "cache_prompt": True,
                "post_sampling_probs": False}
        if self.slot is not None:
            body["id_slot"] = self.slot
        answer = self.client.post_json("/completion", body, api=api)
        return top_probabilities(answer), cut[1]


def top_probabilities(answer: Mapping[str, Any]) -> dict[str, float]:
    """``/completion``'s first ``completion_probabilities`` entry as token -> probability (llama-server
    writes ``top_logprobs`` with log-probabilities; builds before b4800 wrote ``probs`` with ``prob``)."""
    first = (answer.get("completion_probabilities") or [{}])[0]
    top = first.get("top_logprobs") or first.get("probs") or []
    return {t.get("token", t.get("tok_str", "")): math.exp(t["logprob"]) if "logprob" in t else float(t["prob"])
            for t in top}
