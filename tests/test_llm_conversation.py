"""The sentence splitter and reply stream shared by every LLM backend (nodes/llm/_conversation.py).

TTS starts speaking at the first ``sentence_end``: it must come as soon as the sentence is
certain (one token after its full stop), never batched with the next sentence, and never
inside "Dr. Smith", "3.5", "e.g." or "example.com".
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodes.llm._conversation import Conversation, SentenceSplitter, reply_deltas
from tests.support.remote_llm import sentences


def split(deltas: list[str]) -> list[str]:
    splitter, pieces = SentenceSplitter(), []
    for d in deltas:
        pieces += splitter.feed(d)
    pieces += splitter.flush()
    out, cur = [], ""
    for text, end in pieces:
        cur += text
        if end:
            out.append(cur)
            cur = ""
    assert not cur.strip()
    return out


CASES = {
    "Hello world. How are you? I'm fine!": ["Hello world.", " How are you?", " I'm fine!"],
    "Dr. Smith paid $3.5 for e.g. apples. Then he left.": [
        "Dr. Smith paid $3.5 for e.g. apples.", " Then he left."
    ],
    "Visit example.com today. Okay.": ["Visit example.com today.", " Okay."],
    "Well... I see. Well... maybe not.": ["Well...", " I see.", " Well... maybe not."],
    "Wait\u2026 What? Yes.": ["Wait\u2026", " What?", " Yes."],
    "Here:\n1. Rome\n2. Milan\nDone.": ["Here:\n", "1. Rome\n", "2. Milan\n", "Done."],
    "I am 42. Next one.": ["I am 42.", " Next one."],
    'He said "Hi!" and left. "Go on." She went.': ['He said "Hi!" and left.', ' "Go on."', " She went."],
    "J. K. Rowling wrote it. Mr. Brown, i.e. him, too.": [
        "J. K. Rowling wrote it.", " Mr. Brown, i.e. him, too."
    ],
    "Fruits, etc. are fine. Veggies etc. The end": ["Fruits, etc. are fine.", " Veggies etc.", " The end"],
    "A. Ok. Sure thing.": ["A. Ok.", " Sure thing."],
    "Rome is the capital.\n\nIt is old.": ["Rome is the capital.", "\n\nIt is old."],
    "**Rome.** It is (very) old.)": ["**Rome.**", " It is (very) old.)"],
    "\u4e2d\u6587\u53e5\u5b50\u3002\u53e5\u5b50\u597d\uff01\u597d": [
        "\u4e2d\u6587\u53e5\u5b50\u3002", "\u53e5\u5b50\u597d\uff01", "\u597d"
    ],
}


@pytest.mark.parametrize("text", list(CASES))
def test_sentences_end_where_a_reader_would_pause(text):
    assert split(list(text)) == CASES[text]  # token by token (one character each)
    assert split([text]) == CASES[text]  # all at once


def test_the_first_sentence_is_released_one_token_after_its_full_stop():
    splitter = SentenceSplitter()
    assert splitter.feed("The capital") == [("The capital", False)]
    assert splitter.feed(" is Rome.") == [(" is Rome", False)]  # "." waits: "Rome.com"? "3.5"?
    assert splitter.feed(" It") == [(".", True), (" It", False)]  # released before the next sentence ends
    assert splitter.feed(" is old. Very") == [(" is old.", True), (" Very", False)]


def test_a_short_sentence_merges_with_the_next():
    assert split(["Ok", ". ", "Yes", ". ", "Fine."]) == ["Ok. Yes.", " Fine."]


@given(st.text(alphabet="ab .!?\n3\u2026\"'", max_size=60), st.lists(st.integers(1, 5), max_size=20))
def test_splitting_never_loses_or_reorders_text(text, cuts):
    deltas, i = [], 0
    for c in cuts:
        deltas.append(text[i:i + c])
        i += c
    deltas.append(text[i:])
    splitter, out = SentenceSplitter(), []
    for d in deltas:
        out += splitter.feed(d)
    out += splitter.flush()
    assert "".join(t for t, _ in out) == text
    assert split(deltas) == split([text])  # the cut points of the stream change nothing


def test_reply_deltas_close_the_reply_and_record_it():
    conv = Conversation("sys", 4)
    ex = conv.add_user("hi", 5)
    deltas = list(reply_deltas(iter(["Rome. It is", " old"]), turn=5, conversation=conv, exchange=ex,
                               log=logging.getLogger("t")))
    assert sentences(deltas) == ["Rome.", " It is old"]
    assert deltas[-1].text == "" and deltas[-1].end and deltas[-1].sentence_end  # closes " It is old"
    assert all(d.turn == 5 for d in deltas) and sum(d.end for d in deltas) == 1
    assert ex.reply == "Rome. It is old"


def test_an_error_mid_reply_still_closes_the_turn_then_raises():
    def broken():
        yield "Rome is "
        raise RuntimeError("boom")

    conv = Conversation(None, 4)
    ex = conv.add_user("hi", 1)
    gen = reply_deltas(broken(), turn=1, conversation=conv, exchange=ex, log=logging.getLogger("t"))
    got = [next(gen), next(gen)]
    assert got[-1].end
    with pytest.raises(RuntimeError):
        next(gen)
    assert ex.reply == "Rome is "


def test_history_keeps_the_last_turns_and_alternates_roles():
    conv = Conversation("sys", 2)
    for n in range(1, 4):
        conv.record_reply(conv.add_user(f"q{n}", n), f"a{n}" if n != 2 else "")
    conv.add_user("q4", 4)
    assert conv.messages() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a3"},
        {"role": "user", "content": "q4"},
    ]
    conv.truncate_last_reply("partial")
    assert conv.exchanges[-1].reply == "partial"


def test_a_full_window_drops_its_older_half_at_once_so_most_prompts_only_grow():
    """A server's prompt cache serves a prompt that only grew from the previous request's; one whose
    start moved makes llama-server shift its KV cache (+250 ms to the first token with the
    recipe's 5 slots, every slot's generation waiting). Sliding the window one turn at a time moved
    the start every turn once the window was full; dropping the older half moves it every 4th."""
    conv = Conversation("sys", 8)
    prompts, users = [], []
    for n in range(1, 21):
        conv.add_user(f"q{n}", n)
        prompts.append(conv.messages())
        users.append([m["content"] for m in prompts[-1] if m["role"] == "user"])
        conv.record_reply(conv.exchanges[-1], f"a{n}")
    grown = [[*prompts[n - 2], {"role": "assistant", "content": f"a{n - 1}"}] for n in range(2, 21)]
    moved = [n for n, before in zip(range(2, 21), grown, strict=True) if prompts[n - 1][: len(before)] != before]
    assert moved == [9, 13, 17], f"turns whose prompt does not extend the previous one: {moved}"
    assert all(len(u) <= 8 for u in users)
    assert all(len(u) >= 5 for u in users[8:]), "a trimmed window keeps more than half of its turns"
    assert users[8] == ["q5", "q6", "q7", "q8", "q9"] and users[-1][-1] == "q20"
    early = Conversation("sys", 8)  # make_room(): the same trim once a reply is written (nodes/llm/chat.py)
    for n in range(1, 21):
        early.add_user(f"q{n}", n)
        assert early.messages() == prompts[n - 1]
        early.record_reply(early.exchanges[-1], f"a{n}")
        assert early.make_room() == (n in (8, 12, 16, 20))
    one = Conversation(None, 1)  # max_history_turns=1: only the turn being answered
    for n in range(1, 4):
        one.record_reply(one.add_user(f"q{n}", n), "a")
    assert one.messages() == [{"role": "user", "content": "q3"}]
