"""tts.first_clause_words: a reply's first clause is spoken before the rest of its sentence
arrives; everything after it goes sentence by sentence, as without the option."""

from __future__ import annotations

import pytest

pytest.importorskip("espeakng_loader", reason="needs the espeak extra: pip install 's2s-flow[espeak]'")

from nodes.tts._base import first_clause  # noqa: E402
from nodes.tts.espeak import EspeakTTS  # noqa: E402
from s2s_flow.errors import ConfigError  # noqa: E402
from s2s_flow.messages import AudioOut, TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

#: a reply as the LLM streams it: the first sentence has a clause, so has the second
REPLY = [("The capital of Australia", False), (" is Canberra", False), (",", False),
         (" which is a planned", False), (" city.", True), (" It is small, but", False),
         (" very green.", True)]


def make(tmp_path, **params: object) -> EspeakTTS:
    node = EspeakTTS(**params)
    node.ctx = Context("tts", tmp_path)
    node.setup()
    return node


def spoken(node: EspeakTTS, turn: int = 1) -> list[tuple[int, str]]:
    """(index of the delta that released it, text) of each piece of speech, in order."""
    out: list[tuple[int, str]] = []
    deltas = [TextDelta(turn=turn, text=t, sentence_end=e) for t, e in REPLY]
    deltas.append(TextDelta(turn=turn, text="", end=True))
    for i, delta in enumerate(deltas):
        for audio in node.process("text", delta):
            assert isinstance(audio, AudioOut)
            if len(audio.pcm) and (not out or out[-1] != (i, audio.text)):
                out.append((i, audio.text))
    return out


@pytest.mark.parametrize(("text", "clause"), [
    ("The capital of Australia is Canberra, which", "The capital of Australia is Canberra,"),
    ("Sure, the capital of Australia is", ""),  # one word is not a clause worth its own breath
    ("It costs 3,000 dollars and", ""),  # a digit group is not a clause
    ("First you boil the water; then", "First you boil the water;"),
    ("The answer is simple - use salt", "The answer is simple -"),
    ("Well, I think that the answer, as", "Well, I think that the answer,"),
])
def test_the_first_clause_is_cut_after_its_punctuation_once_it_has_enough_words(text, clause):
    assert text[: first_clause(text, 4)] == clause


@pytest.mark.parametrize(("text", "clause"), [
    ("A good book for a long train ride is The", "A good book for a long train ride"),  # 8 words
    ("A good book for a long train ride", ""),  # the 8th word may still go on ("rider")
    ("The capital of Australia is Canberra, which", "The capital of Australia is Canberra,"),
    ("Sure, the capital city of Australia is Canberra and", "Sure, the capital city of Australia is Canberra"),
])
def test_a_first_sentence_with_no_comma_is_cut_after_the_most_words(text, clause):
    assert text[: first_clause(text, 4, 8)] == clause


def test_the_cap_releases_a_long_first_sentence_and_the_tts_start_event_marks_it(tmp_path):
    events: list[tuple[str, dict]] = []
    node = EspeakTTS(first_clause_words=4, first_clause_max_words=5)
    node.ctx = Context("tts", tmp_path, record=lambda kind, **f: events.append((kind, f)))
    node.setup()
    deltas = ["The sky looks blue", " because air scatters", " blue light more.", ""]
    out = []
    for i, text in enumerate(deltas):
        msg = TextDelta(turn=3, text=text, sentence_end=i == 2, end=i == 3)
        out += [(i, a.text) for a in node.process("text", msg) if len(a.pcm)]
    assert sorted(set(out)) == [(1, "The sky looks blue because"), (2, "air scatters blue light more.")]
    assert events == [("tts_start", {"node": "tts", "turn": 3, "words": 5})]  # once per reply, the first words


def test_the_first_clause_goes_ahead_of_its_sentence_and_the_rest_sentence_by_sentence(tmp_path):
    assert spoken(make(tmp_path, first_clause_words=4)) == [
        (3, "The capital of Australia is Canberra,"),  # released by the delta after the comma
        (4, "which is a planned city."),
        (6, "It is small, but very green."),  # later sentences are never split
    ]


def test_without_the_option_whole_sentences_are_spoken(tmp_path):
    assert spoken(make(tmp_path)) == [
        (4, "The capital of Australia is Canberra, which is a planned city."),
        (6, "It is small, but very green."),
    ]


def test_every_reply_gets_its_first_clause_ahead(tmp_path):
    node = make(tmp_path, first_clause_words=4)
    spoken(node, turn=1)
    assert spoken(node, turn=2)[0] == (3, "The capital of Australia is Canberra,")


def test_an_interrupted_first_clause_is_never_spoken(tmp_path):
    node = make(tmp_path, first_clause_words=4)
    assert list(node.process("text", TextDelta(turn=1, text="The capital of Australia is"))) == []
    node.on_interrupt(2)
    assert list(node.process("text", TextDelta(turn=1, text=" Canberra, which"))) == []


def test_a_negative_word_count_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match=r"tts\.first_clause_words"):
        EspeakTTS(first_clause_words=-1)


@pytest.mark.parametrize("params", [{"first_clause_max_words": 8},
                                    {"first_clause_words": 4, "first_clause_max_words": 3}])
def test_a_cap_without_the_first_clause_or_below_it_is_a_config_error(params):
    with pytest.raises(ConfigError, match=r"tts\.first_clause_max_words"):
        EspeakTTS(**params)
