"""llm=chat against two more real servers, both serving the tiny random Llama of the fixtures
and checked against llama-server serving the same weights:

- ``mlx_lm.server`` (mlx-lm on mlx's CPU backend, the model's HF directory);
- ``python -m llama_cpp.server`` (llama-cpp-python, built by scripts/bootstrap.sh; the GGUF).

Both serve ``/v1/chat/completions`` and ``/v1/completions`` only (mlx-lm 0.32.2 and
llama-cpp-python 0.3.36, the newest releases): neither has a Responses API (``POST
/v1/responses`` answers 404), so llm=responses is tested against llama-server
(test_llm_remote_llama_server.py) and here only for the error a user meets when pointing it at
one of these. Nothing here is faked.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from nodes._http import RemoteRefused
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.messages import Transcript
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.servers import Served

SYSTEM = "You are a helpful voice assistant."
USER = "Hello! How are you today?"
AGAIN = "Tell me a short story, please."
N_TOKENS = 24  # the tiny model never emits eos: every reply is exactly this long
GREEDY = {"temperature": 0.0, "max_tokens": N_TOKENS, "system_prompt": SYSTEM}
# The tiny model never stops by itself: this reply would take minutes unless the stream is closed.
# No seed: mlx_lm.server then batches requests, and stops one only when its client is gone.
ENDLESS = {"temperature": 0.0, "max_tokens": 100_000, "system_prompt": SYSTEM}



@dataclass(frozen=True)
class Server:
    fixture: str
    trims_space: bool  # mlx-lm's streaming detokenizer drops the space that opens a reply (trim_space)
    client_gone: re.Pattern  # what its log says when a reply's client went away mid-stream
    greedy: dict = field(default_factory=dict)  # extra_body for llama-server's plain greedy decoding


SERVERS = {
    # Python's http.server, on the write after the client closed
    "mlx_lm.server": Server("tiny_llama_mlx_server", True, re.compile(r"^(BrokenPipeError|ConnectionResetError)\b",
                                                                          re.M)),
    # llama_cpp.server checks after each chunk it sends; it penalises repeats by default (1.1), llama-server not
    "llama_cpp.server": Server("tiny_llama_cpp_python_server", False, re.compile(r"Disconnected from client"),
                               {"repeat_penalty": 1.0}),
}


@pytest.fixture(params=list(SERVERS))
def kind(request) -> Server:
    return SERVERS[request.param]


@pytest.fixture
def server(kind: Server, request) -> Served:
    return request.getfixturevalue(kind.fixture)


@pytest.fixture
def api(server: Served) -> str:
    return server.base_url + "/v1"


def chat(kind: Server, api: str, tmp_path, **options) -> ChatCompletionsLLM:
    """llm=chat against the server under test, decoding as llama-server does."""
    return llm_node(ChatCompletionsLLM, api, tmp_path, extra_body=kind.greedy, **options)


def as_served(text: str, kind: Server) -> str:
    """llama-server's text as this server streams it."""
    return text.removeprefix(" ") if kind.trims_space else text


def generating(pid: int, window_s: float = 1.0) -> bool:
    """Whether the server spent CPU over ``window_s`` as a generating server does.

    Generating, either server keeps a core busy (about a second of CPU a second; a quarter of
    that on a loaded 2-core machine); idle, it waits on a queue or a socket and uses about a
    millisecond. A tenth of the window lies far from both.
    """
    import psutil

    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    time.sleep(window_s)
    return sum(proc.cpu_times()[:2]) - before > 0.1 * window_s


def stops_generating(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not generating(pid):
            return True
    return False


def test_a_reply_streams_in_pieces_and_is_the_greedy_text_of_llama_server(api, kind, tiny_llama_server, tmp_path):
    node = chat(kind, api, tmp_path, **GREEDY)
    deltas = turn(node, USER, 7)
    reference = text_of(turn(llm_node(ChatCompletionsLLM, tiny_llama_server + "/v1", tmp_path, **GREEDY), USER))
    assert len(deltas) > 4 and all(d.turn == 7 for d in deltas)  # streamed: many deltas, not one
    assert deltas[-1].end and deltas[-1].text == "" and sum(d.end for d in deltas) == 1
    # the same weights and chat template give the same greedy text
    assert len(reference) > N_TOKENS // 2 and text_of(deltas) == as_served(reference, kind)
    assert node.conversation.exchanges[-1].reply == text_of(deltas)
    node.close()


def test_stream_false_answers_the_same_as_streaming(api, kind, tmp_path):
    streamed = text_of(turn(chat(kind, api, tmp_path, **GREEDY), USER))
    whole = text_of(turn(chat(kind, api, tmp_path, stream=False, **GREEDY), USER))
    assert as_served(whole, kind) == streamed and len(streamed) > N_TOKENS // 2


def test_the_second_turn_carries_the_first_and_llama_server_answers_that_conversation_alike(
    api, kind, tiny_llama_server, tmp_path
):
    """The second request holds system, user, the first reply as said, user: llama-server, given
    that conversation, answers with the same greedy text; the question alone gets another."""
    node = chat(kind, api, tmp_path, **GREEDY)
    first = text_of(turn(node, USER, 1))
    second = text_of(turn(node, AGAIN, 2))
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                    {"role": "assistant", "content": first}, {"role": "user", "content": AGAIN}]
    answer = httpx.post(f"{tiny_llama_server}/v1/chat/completions", timeout=60,
                        json={"messages": conversation, "temperature": 0.0, "max_tokens": N_TOKENS}).json()
    assert second == as_served(answer["choices"][0]["message"]["content"], kind)
    alone = text_of(turn(chat(kind, api, tmp_path, **GREEDY), AGAIN))
    assert second != alone, "the first turn changed nothing: it was not sent"
    assert [(e.user, e.reply) for e in node.conversation.exchanges] == [(USER, first), (AGAIN, second)]
    node.close()


def test_closing_the_reply_mid_stream_closes_the_connection_and_the_server_stops(api, kind, server, tmp_path):
    node = chat(kind, api, tmp_path, **ENDLESS)
    gone_before = len(kind.client_gone.findall(server.log()))
    gen = node.process("text", Transcript(turn=1, text=USER))
    got = [next(gen) for _ in range(3)]
    assert generating(server.pid), "the server is generating the reply"
    gen.close()  # the engine closes a stale turn's generator at its next yield
    assert stops_generating(server.pid), "the server kept generating for a closed stream"
    assert len(kind.client_gone.findall(server.log())) == gone_before + 1, "the server saw its client go"
    assert node.conversation.exchanges[-1].reply == text_of(got)
    node.close()


def test_a_barge_in_from_another_thread_ends_the_stream_and_the_next_turn_is_answered(
    api, kind, server, tmp_path
):
    node = chat(kind, api, tmp_path, **ENDLESS)
    gen = node.process("text", Transcript(turn=1, text=USER))
    next(gen)
    threading.Timer(0.3, node.on_interrupt, args=(2,)).start()
    rest = list(gen)  # ends by itself once interrupted
    assert rest[-1].end and len(rest) < 10_000  # cut long before the reply (tens of thousands of tokens) ends
    assert stops_generating(server.pid), "the server kept generating for an interrupted stream"
    node.max_tokens = N_TOKENS
    second = turn(node, AGAIN, 2)
    assert second[-1].end and len(text_of(second)) > N_TOKENS // 2
    assert [e.turn for e in node.conversation.exchanges] == [1, 2]
    node.close()


def test_llm_responses_against_it_says_the_server_has_no_responses_api_and_to_use_llm_chat(api, tmp_path):
    assert httpx.post(api + "/responses", json={"input": USER}, timeout=10).status_code == 404
    node = llm_node(ResponsesLLM, api, tmp_path, **GREEDY)
    with pytest.raises(RemoteRefused, match=r"has no Responses API at .*/v1/responses \(HTTP 404.*use llm=chat"):
        turn(node, USER)
    node.close()
