"""What llm=chat and llm=responses put on the wire, and what they never leak (the API key).

Pinned against a local scripted server (tests/support/fault_server.py), which records every
request as received on a real socket.
"""

from __future__ import annotations

import base64
import logging

import numpy as np
import pytest

from nodes._http import RemoteError
from nodes._playback import playback_of
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.audio import wav_bytes
from s2s_flow.errors import ConfigError
from s2s_flow.messages import Speech, Transcript
from tests.support.fault_server import FaultServer, Reply, chat_chunks, responses_events
from tests.support.remote_llm import llm_node, sentences, text_of, turn

SYSTEM = "You are terse."
KEY = "sk-test-SECRET-0123456789abcdef"


@pytest.fixture
def srv():
    with FaultServer() as server:
        yield server


def speech(seconds: float = 0.5, rate: int = 16000, turn_: int = 1) -> Speech:
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return Speech(turn=turn_, pcm=pcm, rate=rate, start=0.0, end=seconds, speech_end_t=0.0)


def b64_wav(msg: Speech) -> str:
    return base64.b64encode(wav_bytes(msg.pcm, msg.rate)).decode()


def test_chat_text_turn_sends_the_exact_request_json(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Rome.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, model="m", system_prompt=SYSTEM,
                    temperature=0.0, max_tokens=64, top_p=0.9, seed=7)
    turn(node, "What is the capital of Italy?")
    (post,) = srv.posts
    assert post.path == "/v1/chat/completions"
    assert post.body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of Italy?"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "top_p": 0.9,
        "seed": 7,
        "max_tokens": 64,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert post.headers["Accept"] == "text/event-stream"
    assert "Authorization" not in post.headers  # loopback server, no key configured


def test_chat_audio_turn_as_input_audio_part_with_prompt(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Hi.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM,
                    audio_prompt="Answer the question in this audio.")
    msg = speech()
    turn(node, msg)
    assert srv.posts[0].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [
            {"type": "text", "text": "Answer the question in this audio."},
            {"type": "input_audio", "input_audio": {"data": b64_wav(msg), "format": "wav"}},
        ]},
    ]


def test_chat_audio_turn_as_audio_url_data_uri_for_vllm(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Hi.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=None,
                    audio_content_type="audio_url")
    msg = speech()
    turn(node, msg)
    assert srv.posts[0].body["messages"] == [
        {"role": "user", "content": [
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64_wav(msg)}},
        ]},
    ]
    wav = base64.b64decode(b64_wav(msg))
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"


def test_history_is_trimmed_to_max_history_turns_and_old_audio_becomes_a_placeholder(srv, tmp_path):
    srv.script(*(Reply.sse(chat_chunks(answer)) for answer in ("One.", "Two.", "Three.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM, max_history_turns=2)
    turn(node, "first", 1)
    turn(node, speech(turn_=2), 2)
    msg3 = speech(0.25, turn_=3)
    turn(node, msg3, 3)
    assert srv.posts[2].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "[user audio]"},  # turn 2: older audio is summarized
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64_wav(msg3), "format": "wav"}},
        ]},
    ]  # turn 1 fell out of the 2-turn window


def test_keep_audio_turns_keeps_the_newest_audio_turns_as_audio(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=None, keep_audio_turns=2)
    turn(node, speech(turn_=1), 1)
    turn(node, speech(turn_=2), 2)
    users = [m["content"] for m in srv.posts[1].body["messages"] if m["role"] == "user"]
    assert [part[0]["type"] for part in users] == ["input_audio", "input_audio"]


def test_responses_text_turn_sends_the_exact_request_json(srv, tmp_path):
    srv.script(Reply.sse(responses_events("Rome.")), Reply.sse(responses_events("Paris.")))
    node = llm_node(ResponsesLLM, srv.base_url, tmp_path, model="m", system_prompt=SYSTEM,
                    temperature=0.0, max_tokens=32, reasoning_effort="low")
    turn(node, "Capital of Italy?", 1)
    turn(node, "And France?", 2)
    assert srv.posts[1].path == "/v1/responses"
    assert srv.posts[1].body == {
        "model": "m",
        "input": [  # typed parts: early llama.cpp /v1/responses builds refuse untyped assistant text
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": SYSTEM}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of Italy?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And France?"}]},
        ],
        "stream": True,
        "store": False,
        "temperature": 0.0,
        "max_output_tokens": 32,
        "reasoning": {"effort": "low"},  # and no enable_thinking next to it: vLLM would ignore the effort
    }


def test_reasoning_effort_thinking_switch_and_extra_body_in_a_chat_request(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, reasoning_effort="high", enable_thinking=True,
                    chat_template_kwargs={"custom": 1}, extra_body={"min_p": 0.05, "stream_options": None})
    turn(node, "hi")
    body = srv.posts[0].body
    assert body["reasoning_effort"] == "high"
    assert body["chat_template_kwargs"] == {"custom": 1}  # the effort alone decides the thinking
    assert body["min_p"] == 0.05 and body["stream_options"] is None  # extra_body wins


def test_the_thinking_switch_goes_to_servers_of_ones_own_and_never_with_an_effort(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, enable_thinking=True)
    turn(node, "hi")
    assert srv.posts[0].body["chat_template_kwargs"] == {"enable_thinking": True}  # loopback: llama.cpp, vLLM
    with pytest.raises(ConfigError, match=r"enable_thinking and llm.reasoning_effort"):
        ChatCompletionsLLM(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize(("url", "sent"), [
    ("https://api.openai.com/v1", False),  # rejects unknown fields
    ("https://my-resource.openai.azure.com/openai/v1", False),
    ("http://10.0.0.5:8000/v1", True),  # vLLM on a private network
    ("http://gpu-box:8000/v1", True),  # a bare hostname: a machine of one's own
])
def test_the_thinking_switch_is_left_out_for_public_apis(url, sent):
    body = ChatCompletionsLLM(base_url=url, model="m", api_key=KEY).generation_options()
    assert ("chat_template_kwargs" in body) is sent
    assert ResponsesLLM(base_url=url, model="m", api_key=KEY).template_kwargs() == (
        {"enable_thinking": False} if sent else {})


def test_a_remote_server_needs_the_model_named_at_compose_time():
    with pytest.raises(ConfigError, match=r"llm\.model is not set .*api\.openai\.com.*OpenAI answers 400"):
        ChatCompletionsLLM(base_url="https://api.openai.com/v1", api_key=KEY)
    with pytest.raises(ConfigError, match=r"llm\.model is not set"):
        ResponsesLLM(base_url="http://10.0.0.5:8000/v1", api_key=KEY)
    ChatCompletionsLLM(base_url="http://127.0.0.1:8080/v1")  # llama-server serves its one model


def test_a_turn_interrupted_before_any_text_leaves_no_empty_assistant_message(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Two.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM)
    node.conversation.add_user("Tell me a long story.", 1)  # interrupted: no reply text was recorded
    turn(node, "Actually, just say two.", 2)
    assert srv.posts[0].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Tell me a long story.\nActually, just say two."},  # roles still alternate
    ]


def test_chat_template_kwargs_null_sends_no_such_field_for_strict_servers(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, chat_template_kwargs=None,
                    enable_thinking=True)
    turn(node, "hi")
    assert "chat_template_kwargs" not in srv.posts[0].body


def test_a_strict_server_refusing_chat_template_kwargs_names_the_fix(srv, tmp_path):
    srv.script(Reply.status(400, {"error": {"message": "Unknown parameter: 'chat_template_kwargs'."}}))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    with pytest.raises(RemoteError, match=r"set llm.chat_template_kwargs=null"):
        turn(node, "hi")


def test_stream_false_gives_one_textdelta_series_from_the_full_answer(srv, tmp_path):
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Rome. It is old."},
                           "finish_reason": "stop"}]}
    srv.script(Reply.json(answer))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, stream=False)
    deltas = turn(node, "hi")
    assert srv.posts[0].body["stream"] is False and "stream_options" not in srv.posts[0].body
    assert sentences(deltas) == ["Rome.", " It is old."]
    assert deltas[-1].end and deltas[-1].text == ""


def test_responses_stream_false_reads_output_text_items(srv, tmp_path):
    answer = {"status": "completed", "output": [
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome."}]},
    ]}
    srv.script(Reply.json(answer))
    node = llm_node(ResponsesLLM, srv.base_url, tmp_path, stream=False)
    assert text_of(turn(node, "hi")) == "Rome."


def test_an_empty_transcript_gets_no_request_and_no_reply(srv, tmp_path, caplog):
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    with caplog.at_level(logging.INFO):
        assert turn(node, "   ") == []
    assert srv.posts == [] and "empty transcript" in caplog.text


def test_every_delta_carries_the_turn_of_its_transcript(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("One. ", "Two.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert {d.turn for d in turn(node, "hi", 41)} == {41}


# -- the API key ----------------------------------------------------------------------


def test_the_api_key_is_sent_but_never_logged_printed_or_put_in_errors(srv, tmp_path, caplog):
    srv.script(Reply.sse(chat_chunks("Ok.")), Reply.status(401, {"error": {"message": "Invalid API key"}}))
    with caplog.at_level(logging.DEBUG):  # httpx/httpcore debug traces included
        node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, api_key=KEY)
        turn(node, "hi")
        with pytest.raises(RemoteError) as err:
            turn(node, "again", 2)
    assert srv.posts[0].headers["Authorization"] == f"Bearer {KEY}"
    assert "llm.api_key" in str(err.value) and "OPENAI_API_KEY" in str(err.value)
    assert caplog.records, "debug logging produced nothing to check"
    leaks = [
        str(err.value), repr(err.value), repr(node), repr(node.client), str(vars(node)),
        str(vars(node.client)), caplog.text, *(str(r.args) for r in caplog.records),
    ]
    assert not [s for s in leaks if KEY in s]
    assert ChatCompletionsLLM.secret_params == ResponsesLLM.secret_params == frozenset({"api_key"})


def test_a_remote_server_without_a_key_is_a_config_error_at_compose_time(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"llm\.api_key.*OPENAI_API_KEY"):
        ResponsesLLM(base_url="https://api.openai.com/v1", model="gpt-4.1-mini")
    with pytest.raises(ConfigError, match=r"llm\.api_key"):
        ChatCompletionsLLM(base_url="http://10.0.0.5:8000/v1", api_key="", model="m")


@pytest.mark.parametrize("url", ["http://localhost:8080/v1", "http://127.0.0.2:9/v1", "http://[::1]:8000/v1"])
def test_loopback_servers_need_no_key(monkeypatch, url):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    ChatCompletionsLLM(base_url=url)


def test_the_key_comes_from_openai_api_key_when_unset(monkeypatch, srv, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    ChatCompletionsLLM(base_url="https://api.openai.com/v1", model="gpt-4.1-mini")  # no ConfigError
    srv.script(Reply.sse(chat_chunks("Ok.")))
    turn(llm_node(ChatCompletionsLLM, srv.base_url, tmp_path), "hi")
    assert srv.posts[0].headers["Authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"base_url": "127.0.0.1:8080"}, r"llm\.base_url=.*not an http"),
        ({"audio_content_type": "wav"}, r"llm\.audio_content_type"),
        ({"max_history_turns": 0}, r"llm\.max_history_turns"),
        ({"keep_audio_turns": 0}, r"llm\.keep_audio_turns"),
        ({"temperature": 5.0}, r"llm\.temperature"),
        ({"read_timeout": 0}, r"llm\.read_timeout"),
    ],
)
def test_bad_options_are_config_errors_naming_the_option(options, match):
    with pytest.raises(ConfigError, match=match):
        ChatCompletionsLLM(**options)


def test_a_turn_arriving_as_both_speech_and_transcript_gets_one_reply(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert text_of(turn(node, speech(turn_=4), 4)) == "Ok."
    assert turn(node, "the same turn, transcribed", 4) == []
    assert len(srv.posts) == 1


def test_a_partial_transcript_never_confirms_a_speculative_turn(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Paris.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path)
    assert text_of(turn(node, Transcript(turn=3, text="Capital of France?", speculative=True))) == "Paris."
    assert turn(node, Transcript(turn=3, text="Capital of", final=False)) == []  # display only
    assert turn(node, Transcript(turn=3, text="Capital of France?")) == []  # the confirmation: answered already
    assert len(srv.posts) == 1 and len(node.conversation.exchanges) == 1


def test_a_played_speculative_reply_stays_in_the_history_when_a_barge_in_drops_its_confirmation(srv, tmp_path):
    # The gate plays a speculative reply once the VAD confirms the turn; the user barged in before the
    # STT's confirming transcript reached the LLM, so that transcript was dropped as stale.
    srv.script(Reply.sse(chat_chunks("Paris is the capital.")), Reply.sse(chat_chunks("Rome.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM)
    turn(node, Transcript(turn=3, text="Capital of France?", speculative=True), 3)
    playback_of(node.ctx).set_heard(3, "Paris", played_s=0.4, t=0.0)
    node.on_interrupt(4)
    turn(node, "And of Italy?", 4)
    assert srv.posts[-1].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
    ]


def test_a_withdrawn_speculative_reply_is_forgotten(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Paris is.")), Reply.sse(chat_chunks("Sure.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM)
    turn(node, Transcript(turn=3, text="Capital of", speculative=True), 3)
    node.on_interrupt(4)  # the user went on: never played, the utterance comes again whole
    turn(node, "Capital of France, and of Italy?", 4)
    assert srv.posts[-1].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Capital of France, and of Italy?"},
    ]


def test_reset_starts_the_next_conversation_with_an_empty_history(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("One.")), Reply.sse(chat_chunks("Two.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM)
    turn(node, "first conversation", 1)
    node.reset()
    turn(node, "second conversation", 2)
    assert srv.posts[1].body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "second conversation"},
    ]


def test_a_barge_in_while_the_request_is_being_built_sends_nothing(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Sure.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=SYSTEM)
    build = node.request_body

    def built_then_interrupted(*args):  # the user barges in between the stale check and the request
        body = build(*args)
        node.on_interrupt(2)
        return body

    node.request_body = built_then_interrupted
    assert text_of(turn(node, "Tell me a story.", 1)) == "" and srv.posts == []
    node.request_body = build
    assert text_of(turn(node, "Never mind, hi.", 2)) == "Sure." and len(srv.posts) == 1  # not aborted
