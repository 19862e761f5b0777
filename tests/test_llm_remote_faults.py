"""How llm=chat and llm=responses behave when the server misbehaves: retries before the first
token only, partial replies kept, clear errors, no hangs, streams closed on barge-in.

The faults come from a scripted server on real loopback sockets (tests/support/fault_server.py):
a real LLM server does not fail on demand.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from nodes._http import RemoteError, StreamBroken
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.messages import Transcript
from tests.support.fault_server import FaultServer, Reply, chat_chunks, responses_events
from tests.support.remote_llm import llm_node, sentences, text_of, turn
from tests.support.servers import free_port

BOTH = pytest.mark.parametrize(
    ("cls", "events"),
    [(ChatCompletionsLLM, chat_chunks), (ResponsesLLM, responses_events)],
    ids=["chat", "responses"],
)


@pytest.fixture
def srv():
    with FaultServer() as server:
        yield server


@BOTH
def test_a_5xx_before_the_first_token_is_retried(srv, tmp_path, cls, events):
    srv.script(Reply.status(500), Reply.status(502), Reply.sse(events("Hello there.")))
    node = llm_node(cls, srv.base_url, tmp_path, max_retries=2)
    deltas = turn(node, "hi")
    assert text_of(deltas) == "Hello there." and deltas[-1].end
    assert len(srv.posts) == 3
    assert srv.posts[0].body == srv.posts[2].body


def test_429_waits_as_long_as_retry_after_says(srv, tmp_path):
    srv.script(Reply.status(429, Retry_After="1"), Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert text_of(turn(node, "hi")) == "Ok."
    first, second = srv.posts
    assert 0.95 <= second.t - first.t < 2.5


def test_a_server_failing_every_time_is_an_error_after_max_retries(srv, tmp_path):
    srv.script(Reply.status(503, {"error": {"message": "overloaded"}}))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, max_retries=1)
    with pytest.raises(RemoteError, match=r"HTTP 503: overloaded\) on 2 attempts"):
        turn(node, "hi")
    assert len(srv.posts) == 2


@BOTH
def test_a_stream_broken_after_tokens_ends_the_reply_and_keeps_the_text(srv, tmp_path, caplog, cls, events):
    srv.script(Reply.sse(events("The capital ", "is Rome. ", "It has ", "many ", "old ", "churches."),
                         drop_after=4))
    node = llm_node(cls, srv.base_url, tmp_path)
    with caplog.at_level(logging.ERROR):
        deltas = turn(node, "hi")
    text = text_of(deltas)
    assert text.startswith("The capital is Rome.") and "churches" not in text
    assert deltas[-1].end and deltas[-1].text == ""
    assert len(srv.posts) == 1  # never replayed
    assert node.conversation.exchanges[-1].reply == text
    assert "reply cut short" in caplog.text


def test_a_stream_broken_before_any_token_is_an_error(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("never"), drop_after=0))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    with pytest.raises(StreamBroken, match="broke off"):
        turn(node, "hi")


def test_a_malformed_sse_line_is_a_clear_error_naming_server_and_line(srv, tmp_path):
    srv.script(Reply.sse(["data: {\"choices\": [\n\n"]))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    start = time.monotonic()
    with pytest.raises(StreamBroken) as err:
        turn(node, "hi")
    assert time.monotonic() - start < 2
    assert srv.base_url in str(err.value) and "malformed" in str(err.value)
    assert "data: {\"choices\": [" in str(err.value)


def test_a_line_that_is_no_sse_field_is_malformed_too(srv, tmp_path):
    srv.script(Reply.sse(["<html>" + "x" * 1000 + "</html>\n\n"]))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    with pytest.raises(StreamBroken, match="malformed") as err:
        turn(node, "hi")
    assert len(str(err.value)) < 600  # the line is quoted truncated


def test_a_first_byte_slower_than_read_timeout_is_an_error_not_a_hang(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("late"), delay_s=3.0))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, read_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"within 0.3 s \(llm.read_timeout\)"):
        turn(node, "hi")
    assert time.monotonic() - start < 1.5
    assert len(srv.posts) == 1  # a slow server is not asked twice


def test_silence_between_chunks_longer_than_read_timeout_ends_the_reply(srv, tmp_path, caplog):
    srv.script(Reply.sse(chat_chunks("Hello. ", "world")[1:], gap_s=1.0))  # a token, then silence
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, read_timeout=0.3)
    deltas = turn(node, "hi")
    assert text_of(deltas) == "Hello. " and deltas[-1].end and "llm.read_timeout" in caplog.text


def test_no_server_is_reported_at_setup_with_the_fix(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    node = llm_node(ChatCompletionsLLM, url, tmp_path, setup=False, max_retries=1)
    start = time.monotonic()
    with pytest.raises(RemoteError) as err:
        node.setup()
    assert time.monotonic() - start < 2
    assert str(err.value).startswith(f"no server at {url}")
    assert "llama-server" in str(err.value) and "llm.base_url" in str(err.value)


def test_a_bad_key_is_reported_at_setup_naming_llm_api_key(srv, tmp_path):
    srv.routes["/models"] = Reply.status(401, {"error": {"message": "Incorrect API key provided"}})
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, setup=False, api_key="sk-wrong")
    expected = r"refused the API key \(HTTP 401: Incorrect API key provided\).*llm\.api_key"
    with pytest.raises(RemoteError, match=expected):
        node.setup()


def test_a_server_without_the_responses_api_says_use_llm_chat(srv, tmp_path):
    llama_cpp_404 = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
    srv.script(Reply.status(404, llama_cpp_404))
    node = llm_node(ResponsesLLM, srv.base_url, tmp_path)
    with pytest.raises(RemoteError) as err:
        turn(node, "hi")
    assert str(err.value).startswith(f"this server has no Responses API at {srv.base_url}/responses")
    assert "use llm=chat" in str(err.value)


def test_an_unknown_model_is_told_apart_from_a_missing_endpoint(srv, tmp_path):
    openai_404 = {"error": {"message": "The model `gpt-9` does not exist", "code": "model_not_found"}}
    srv.script(Reply.status(404, openai_404))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, model="gpt-9")
    with pytest.raises(RemoteError, match=r"does not serve the requested model .*set llm\.model"):
        turn(node, "hi")


def test_a_server_without_models_endpoint_is_fine_and_a_loading_one_is_waited_for(srv, tmp_path):
    srv.routes["/models"] = Reply.status(404)
    llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)  # no error
    srv.routes["/models"] = Reply.status(503, {"error": {"message": "Loading model"}})
    threading.Timer(0.6, lambda: srv.routes.update({"/models": Reply.json({"data": []})})).start()
    start = time.monotonic()
    llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert 0.5 < time.monotonic() - start < 3


def test_an_html_page_instead_of_an_event_stream_names_base_url(srv, tmp_path):
    srv.script(Reply(200, b"<html>web ui</html>", {"Content-Type": "text/html"}))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    with pytest.raises(RemoteError, match=r"answered text/html instead of an event stream.*llm\.base_url"):
        turn(node, "hi")


@pytest.mark.parametrize(
    "event",
    [
        'event: error\ndata: {"type": "error", "code": "server_error", "message": "model crashed"}\n\n',
        'event: response.failed\ndata: {"type": "response.failed", "response": '
        '{"status": "failed", "error": {"code": "server_error", "message": "model crashed"}}}\n\n',
    ],
)
def test_responses_error_events_are_clear_errors(srv, tmp_path, event):
    srv.script(Reply.sse([event]))
    node = llm_node(ResponsesLLM, srv.base_url, tmp_path)
    with pytest.raises(RemoteError, match=r"reported an error: model crashed \(server_error\)"):
        turn(node, "hi")


def test_a_chat_error_event_after_tokens_keeps_the_partial_reply(srv, tmp_path, caplog):
    events = chat_chunks("Rome is ", "old.", done=False)[:3] + [{"error": {"message": "context full"}}]
    srv.script(Reply.sse(events))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    deltas = turn(node, "hi")
    assert text_of(deltas) == "Rome is old." and "context full" in caplog.text


def test_reasoning_deltas_are_not_spoken(srv, tmp_path):
    thinking = {"choices": [{"index": 0, "delta": {"reasoning_content": "Italy... Rome"}}]}
    srv.script(Reply.sse([thinking, thinking, *chat_chunks("Rome.")]))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert text_of(turn(node, "hi")) == "Rome."


def test_a_reply_that_is_all_reasoning_warns_how_to_fix_it(srv, tmp_path, caplog):
    thinking = {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": "length"}]}
    srv.script(Reply.sse([thinking, "data: [DONE]\n\n"]))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    deltas = turn(node, "hi")
    assert [(d.text, d.end) for d in deltas] == [("", True)]
    assert "llm.enable_thinking=false" in caplog.text and "llm.max_tokens" in caplog.text


# -- barge-in ---------------------------------------------------------------------------


@BOTH
def test_closing_the_reply_generator_closes_the_http_stream_at_once(srv, tmp_path, cls, events):
    srv.script(Reply.sse(events(*(f"word{i} " for i in range(200))), gap_s=0.02))
    node = llm_node(cls, srv.base_url, tmp_path)
    gen = node.process("text", Transcript(turn=3, text="hi"))
    first = next(gen)
    assert first.text.startswith("word0")
    gen.close()  # what the engine does at the next yield of a stale turn
    assert srv.disconnected.wait(1.0), "the server kept streaming to nobody"
    assert node.conversation.exchanges[-1].reply == first.text  # what was produced so far


def test_on_interrupt_cuts_a_request_still_waiting_for_its_first_byte(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("late"), delay_s=5.0), Reply.sse(chat_chunks("Fresh answer.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    threading.Timer(0.3, node.on_interrupt, args=(2,)).start()  # from another thread, like the engine
    start = time.monotonic()
    deltas = turn(node, "first question", 1)
    assert time.monotonic() - start < 4.0  # cut at 0.3 s, long before the server's 5 s answer
    assert text_of(deltas) == ""
    assert text_of(turn(node, "second question", 2)) == "Fresh answer."  # the client still works


def test_the_connection_is_kept_alive_across_turns(srv, tmp_path):
    srv.script(*(Reply.sse(chat_chunks(answer)) for answer in ("One.", "Two.", "Three.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    for n in (1, 2, 3):
        turn(node, f"question {n}", n)
    assert len({r.client for r in srv.requests}) == 1  # warm-up + 3 turns on one connection


def test_truncate_last_reply_is_what_the_next_request_carries(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Rome is the capital. It is old.")), Reply.sse(chat_chunks("Yes.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=None)
    assert sentences(turn(node, "hi", 1)) == ["Rome is the capital.", " It is old."]
    node.conversation.truncate_last_reply("Rome is the capital.")
    turn(node, "more", 2)
    assert srv.posts[1].body["messages"][1] == {"role": "assistant", "content": "Rome is the capital."}


def test_on_interrupt_cuts_a_stream_waiting_between_tokens(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Hello. ", "never")[1:], gap_s=3.0), Reply.sse(chat_chunks("Next.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    threading.Timer(0.3, node.on_interrupt, args=(2,)).start()
    start = time.monotonic()
    deltas = turn(node, "first question", 1)
    assert time.monotonic() - start < 2.5  # cut at 0.3 s, not at the next token 3 s later
    assert text_of(deltas) == "Hello. " and node.conversation.exchanges[-1].reply == "Hello. "
    assert srv.disconnected.wait(6.0)  # the server learns it at its next writes (3 s on)
    assert text_of(turn(node, "second question", 2)) == "Next."


def test_a_connection_closed_without_an_answer_is_retried_at_once(srv, tmp_path, caplog):
    """llama-server closes a kept-alive connection shortly after a streamed reply; a turn
    that meets such a connection asks again on a fresh one, without a backoff pause."""
    caplog.set_level(logging.INFO)  # where a backoff pause would be logged
    srv.script(Reply(hangup=True), Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert text_of(turn(node, "hi")) == "Ok."
    assert len(srv.posts) == 2
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # no backoff pause was taken


def test_a_kept_alive_connection_found_closed_is_resent_even_without_retries(srv, tmp_path):
    """The pooled connection (made by the warm-up) is dead when the turn's request goes out:
    that request never reached a live server, so even ``max_retries=0`` sends it once more on a
    fresh connection; a fresh connection cut before any answer is an error, sent no third time."""
    srv.script(Reply(hangup=True), Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, max_retries=0)
    assert text_of(turn(node, "hi", 1)) == "Ok."
    first, second = srv.posts
    assert first.client == srv.requests[0].client != second.client  # the warm-up's, then a new one
    srv.script(Reply(hangup=True))
    with pytest.raises(RemoteError):
        turn(node, "again", 2)
    assert len(srv.posts) == 4  # the kept-alive connection, then one fresh one: no more
