"""What the LLM sees of a Realtime conversation: its own history with the items the client
deleted left out, and the system prompt of the response being made (``response.create``'s
``instructions``). A view for one request: the LLM's history itself is never changed.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from nodes.llm._conversation import Conversation, Exchange

__all__ = ["conversation_view"]


def conversation_view(conversation: Conversation, *, instructions: str | None, deleted: set[str],
                      turn_items: dict[int, list[tuple[str, str | None, tuple[str, ...]]]], user_items: dict[int, str],
                      no_reply: set[int]) -> Conversation:
    """``conversation`` as the client edited it. ``turn_items``: per LLM turn, the user items a
    ``response.create`` answered together (their text, None for audio; their images' URLs); ``user_items``: a spoken
    turn's item; ``no_reply``: turns whose reply item was deleted."""
    view = copy.copy(conversation)
    if instructions is not None:
        view.system_prompt = instructions or None
    if not deleted:
        return view
    exchanges = list(conversation.exchanges)
    shown: list[Exchange] = []
    for i, ex in enumerate(exchanges):
        last = i == len(exchanges) - 1
        user, user_gone = _user_view(ex, turn_items.get(ex.turn), user_items.get(ex.turn), deleted)
        reply_gone = not last and ex.turn in no_reply
        if user is ex.user and not user_gone and not reply_gone:
            shown.append(ex)
            continue
        reply, rounds = ("", []) if reply_gone else (ex.reply, ex.rounds)
        if user_gone:  # a reply without its question stays, joined to the reply before it
            if shown and reply and not rounds and not last:
                shown[-1] = replace(shown[-1], reply=f"{shown[-1].reply} {reply}".strip())
            continue
        shown.append(Exchange(user=user, turn=ex.turn, reply=reply, rounds=list(rounds)))
    view.exchanges = shown
    return view


def _user_view(ex: Exchange, entries: list[tuple[str, str | None, tuple[str, ...]]] | None, item_id: str | None,
               deleted: set[str]) -> tuple[Any, bool]:
    """(user message, gone) of one exchange once the deleted items are left out: typed messages
    answered together lose only the deleted ones (words and images: the chat content parts the LLM
    was sent, llm.vision); audio goes as a whole."""
    if entries is None:
        return ex.user, item_id is not None and item_id in deleted
    kept = [(text, images) for i, text, images in entries if i not in deleted]
    if len(kept) == len(entries):
        return ex.user, False
    if not kept or any(text is None for _, text, _ in entries) or not isinstance(ex.user, (str, list)):
        return ex.user, True
    text = "\n".join(t for t, _ in kept if t)
    images = [{"type": "image_url", "image_url": {"url": url}} for _, urls in kept for url in urls]
    if not images:
        return text, not text
    return [*([{"type": "text", "text": text}] if text else []), *images], False
