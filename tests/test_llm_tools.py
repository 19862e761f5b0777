"""Tool calling: what a tool looks like to the model, the exact requests of both APIs around a
tool result, and the faults of the model or the server a real one cannot be made to produce on
cue (malformed calls, a call without a name, a model that never stops calling).

The requests are pinned against the scripted loopback server (tests/support/fault_server.py),
which records them as received; the replies imitate llama-server's tool-call streams. Real
calls from a real server, and every fault of the tool itself (it raises, hangs, is interrupted,
is slow enough for the filler), are in tests/test_llm_tools_llama_server.py.
"""

from __future__ import annotations

import json
import logging

import pytest

from nodes._http import RemoteError
from nodes.llm._conversation import Conversation, ToolCall, ToolRound
from nodes.llm._local import split_tool_calls
from nodes.llm._tools import Toolbox, describe
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.errors import ConfigError
from tests.support import tools
from tests.support.fault_server import FaultServer, Reply, chat_chunks, responses_events
from tests.support.remote_llm import llm_node, text_of, turn

SYSTEM = "You are terse."
WEATHER = "tests.support.tools:get_weather"
WEATHER_SCHEMA = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city's name, e.g. Paris."}},
        "required": ["city"],
    },
}


@pytest.fixture
def srv():
    with FaultServer() as server:
        yield server


@pytest.fixture(autouse=True)
def fresh_calls():
    tools.CALLS.clear()


def chat_call_chunks(*calls: tuple[str, str, str], text: str = "") -> list[dict | str]:
    """A Chat Completions stream asking for ``calls`` (id, name, arguments), as llama-server
    streams them: the name first, the arguments in two pieces, keyed by index."""
    events: list[dict | str] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}]
    if text:
        events.append({"choices": [{"index": 0, "delta": {"content": text}}]})
    for i, (call_id, name, arguments) in enumerate(calls):
        half = len(arguments) // 2
        events += [
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": arguments[:half]}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": arguments[half:]}}]}}]},
        ]
    events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, "data: [DONE]\n\n"]
    return events


def responses_call_events(call_id: str, name: str, arguments: str) -> list[str]:
    """A Responses API stream asking for one call, as llama-server streams it."""

    def ev(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    item = {"id": f"fc_{call_id}", "arguments": "", "call_id": f"call_{call_id}", "name": name,
            "type": "function_call", "status": "in_progress"}
    done = {**item, "arguments": arguments, "status": "completed"}
    return [
        ev("response.created", response={"id": "resp_1", "status": "in_progress"}),
        ev("response.output_item.added", item=item),
        ev("response.function_call_arguments.delta", delta=arguments[:5], item_id=f"fc_{call_id}"),
        ev("response.function_call_arguments.delta", delta=arguments[5:], item_id=f"fc_{call_id}"),
        ev("response.output_item.done", item=done),
        ev("response.completed", response={"id": "resp_1", "status": "completed", "output": [done]}),
    ]


# -- describing tools ---------------------------------------------------------------------


def test_a_tool_is_described_by_its_type_hints_and_docstring():
    weather = describe(WEATHER)
    assert weather.chat_schema() == {"type": "function", "function": WEATHER_SCHEMA}
    assert weather.responses_schema() == {"type": "function", **WEATHER_SCHEMA}
    convert = describe("tests.support.tools.convert_temperature")  # a dotted path works too
    assert convert.parameters == {
        "type": "object",
        "properties": {
            "degrees": {"type": "number", "description": "the temperature to convert"},
            "to": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "the unit to convert to"},
            "precision": {"type": "integer", "description": "digits after the decimal point"},
            "style": {"type": "string", "enum": ["short", "long"], "description": "how to phrase the answer"},
        },
        "required": ["degrees", "to"],  # the others have defaults
    }


@pytest.mark.parametrize(("path", "match"), [
    ("tests.support.tools:no_hints", r"no_hints: parameter 'city' has no type hint"),
    ("tests.support.tools:takes_a_set", r"takes_a_set: parameter 'cities': its type 'set' has no JSON schema"),
    ("tests.support.tools:undocumented", r"undocumented has no docstring"),
    ("tests.support.tools:missing", r"tests.support.tools has no missing"),
    ("no_such_module_here:f", r"cannot import no_such_module_here"),
    ("justaname", r"not an import path"),
])
def test_a_tool_the_model_could_not_be_told_about_is_a_compose_time_error_naming_it(path, match):
    with pytest.raises(ConfigError, match=match):
        ChatCompletionsLLM(tools=[path])


def test_tool_choice_and_limits_are_checked_at_compose_time():
    with pytest.raises(ConfigError, match=r"llm.tool_choice='get_wether' is neither .* \(get_weather\)"):
        ChatCompletionsLLM(tools=[WEATHER], tool_choice="get_wether")
    with pytest.raises(ConfigError, match=r"llm.tool_choice='required' needs tools"):
        ResponsesLLM(tool_choice="required")
    with pytest.raises(ConfigError, match=r"two tools called 'get_weather'"):
        ChatCompletionsLLM(tools=[WEATHER, "tests.support.tools.get_weather"])
    with pytest.raises(ConfigError, match=r"llm.max_tool_rounds"):
        ChatCompletionsLLM(tools=[WEATHER], max_tool_rounds=0)


# -- the exact requests around a tool result ---------------------------------------------------


def test_chat_pins_the_first_request_and_the_one_after_a_tool_result(srv, tmp_path):
    srv.script(Reply.sse(chat_call_chunks(("call_abc", "get_weather", '{"city": "Paris"}'))),
               Reply.sse(chat_chunks("It is sunny ", "in Paris.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, model="m", system_prompt=SYSTEM,
                    temperature=0.0, tools=[WEATHER])
    deltas = turn(node, "What's the weather in Paris?")
    assert text_of(deltas) == "It is sunny in Paris."
    first, second = (p.body for p in srv.posts)
    common = {
        "model": "m",
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": WEATHER_SCHEMA}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    user = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What's the weather in Paris?"}]
    assert first == {**common, "messages": user, "tool_choice": "auto"}
    assert second == {**common, "tool_choice": "auto", "messages": [
        *user,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "The weather in Paris is sunny, 24 degrees."},
    ]}
    assert tools.CALLS == [("get_weather", {"city": "Paris"})]


def test_responses_pins_the_first_request_and_the_one_after_a_tool_result(srv, tmp_path):
    srv.script(Reply.sse(responses_call_events("7", "get_weather", '{"city": "Rome"}')),
               Reply.sse(responses_events("Cloudy in Rome.")))
    node = llm_node(ResponsesLLM, srv.base_url, tmp_path, model="m", system_prompt=SYSTEM, tools=[WEATHER],
                    tool_choice="required")
    assert text_of(turn(node, "Weather in Rome?")) == "Cloudy in Rome."
    first, second = (p.body for p in srv.posts)
    common = {
        "model": "m",
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", **WEATHER_SCHEMA}],
        "stream": True,
        "store": False,
    }
    user = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": SYSTEM}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
    ]
    assert first == {**common, "input": user, "tool_choice": "required"}
    assert second == {**common, "tool_choice": "auto", "input": [  # forced once: then the model may answer
        *user,
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "The weather in Rome is cloudy, 18 degrees."},
    ]}


def test_a_named_tool_choice_is_sent_in_each_apis_own_shape(srv, tmp_path):
    srv.script(Reply.sse(chat_chunks("Ok.")))
    chat = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, tools=[WEATHER, "tests.support.tools:slow_lookup"],
                    tool_choice="get_weather")
    # Chat Completions: "required" with that one tool (llama-server refuses the object form; it means the same)
    body = chat.request_body("get_weather")
    assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == ["get_weather"]
    assert len(chat.request_body("auto")["tools"]) == 2, "the other choices offer every tool"
    responses = llm_node(ResponsesLLM, srv.base_url, tmp_path, tools=[WEATHER], setup=False)
    assert responses.request_body("get_weather")["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert "tools" not in llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, setup=False).request_body()


def test_the_next_turn_keeps_the_tool_round_and_the_answer_in_its_history(srv, tmp_path):
    srv.script(Reply.sse(chat_call_chunks(("c1", "get_weather", '{"city":"Oslo"}'), text="Let me check. ")),
               Reply.sse(chat_chunks("Snowing.")), Reply.sse(chat_chunks("You're welcome.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, system_prompt=None, tools=[WEATHER])
    assert text_of(turn(node, "Weather in Oslo?", 1)) == "Let me check. Snowing."
    turn(node, "Thanks!", 2)
    assert srv.posts[2].body["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me check. ", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "The weather in Oslo is snowing, minus 3 degrees."},
        {"role": "assistant", "content": "Snowing."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_a_reply_cut_by_a_barge_in_keeps_only_what_was_heard_of_each_round():
    conv = Conversation(None, 4)
    ex = conv.add_user("Weather?", 1)
    ex.rounds.append(ToolRound("Let me check. ", [ToolCall("c1", "get_weather", "{}", "sunny")]))
    conv.record_reply(ex, "Let me check. It is sunny.")
    conv.truncate_last_reply("Let me")  # the speaker played this much
    conv.add_user("Stop.", 2)
    assert conv.messages()[1:3] == [
        {"role": "assistant", "content": "Let me", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert conv.messages()[3] == {"role": "user", "content": "Stop."}  # nothing after the round was heard


def test_a_call_whose_arguments_are_not_json_goes_back_to_the_server_as_an_empty_object():
    """A call cut by max_tokens ('{"city": "Ro') keeps its error result, and the history stays one
    llama-server can parse (it answers HTTP 500 to every later request of the conversation otherwise)."""
    conv = Conversation(None, 4)
    ex = conv.add_user("Weather in Rome?", 1)
    cut = ToolCall("c1", "get_weather", '{"city": "Ro', "error: the arguments are not valid JSON")
    ex.rounds.append(ToolRound("", [cut, ToolCall("c2", "get_weather", '{"city": "Rome"}', "cloudy")]))
    conv.record_reply(ex, "Cloudy.")
    (assistant,) = [m for m in conv.messages() if m.get("tool_calls")]
    calls = assistant["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city": "Rome"}']
    assert cut.arguments == '{"city": "Ro', "the record keeps what the model wrote"


# -- when a round goes wrong ------------------------------------------------------------------


def test_bad_calls_become_results_that_say_what_was_wrong(srv, tmp_path):
    srv.script(Reply.sse(chat_call_chunks(("c1", "get_weather", '{"city": '), ("c2", "get_time", "{}"),
                                          ("c3", "get_weather", '["Paris"]'))),
               Reply.sse(chat_chunks("Sorry.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, tools=[WEATHER])
    turn(node, "Weather?")
    results = [m["content"] for m in srv.posts[1].body["messages"] if m["role"] == "tool"]
    assert results[0].startswith("error: the arguments are not valid JSON") and '{"city": ' in results[0]
    assert results[1] == "error: there is no tool called 'get_time'; the tools are get_weather"
    assert results[2] == 'error: the arguments must be a JSON object, not ["Paris"]'
    assert tools.CALLS == []


def test_a_model_that_keeps_calling_is_offered_no_tools_after_max_tool_rounds(srv, tmp_path, caplog):
    srv.script(Reply.sse(chat_call_chunks(("c", "get_weather", '{"city": "Paris"}'))))  # repeats forever
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, tools=[WEATHER], max_tool_rounds=2)
    with caplog.at_level(logging.WARNING):
        deltas = turn(node, "Weather?")
    assert [p.body["tool_choice"] for p in srv.posts] == ["auto", "auto", "none"]
    assert len(tools.CALLS) == 2 and deltas[-1].end
    assert "no more tool rounds are left (llm.max_tool_rounds=2)" in caplog.text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_call_without_a_function_name_is_the_servers_fault(srv, tmp_path, api):
    if api == "chat":
        srv.script(Reply.sse(chat_call_chunks(("c1", "", "{}"))))
    else:
        srv.script(Reply.sse(responses_call_events("c1", "", "{}")))
    node = llm_node(ChatCompletionsLLM if api == "chat" else ResponsesLLM, srv.base_url, tmp_path, tools=[WEATHER])
    with pytest.raises(RemoteError, match=rf"the server at {srv.base_url} sent a tool call without a function name"):
        turn(node, "Weather?")


def test_tool_calls_are_recorded_for_the_metrics(srv, tmp_path):
    srv.script(Reply.sse(chat_call_chunks(("c1", "get_weather", '{"city": "Paris"}'))),
               Reply.sse(chat_chunks("Sunny.")))
    node = llm_node(ChatCompletionsLLM, srv.base_url, tmp_path, tools=[WEATHER])
    events: list[dict] = []
    node.ctx._record = lambda kind, **fields: events.append({"kind": kind, **fields})
    turn(node, "Weather?", 3)
    (event,) = events
    assert event["kind"] == "tool_call" and event["node"] == "llm" and event["turn"] == 3
    assert event["tool"] == "get_weather" and event["status"] == "ok"
    assert event["args_bytes"] == len('{"city": "Paris"}') and event["seconds"] >= 0


# -- <tool_call> sections in a local model's stream -------------------------------------------


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


@pytest.mark.parametrize("pieces", [
    ['Let me check.', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
    ['Let me check.<', 'tool_', 'call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool',
     '_call>\n'],
])
def test_a_tool_call_section_is_taken_out_of_the_stream_and_never_spoken(pieces):
    out = list(split_tool_calls(pieces, new_id=ids()))
    assert out == ["Let me check.", ToolCall("call_0", "get_weather", '{"city": "Paris"}')]


def test_text_that_only_looks_like_a_tag_is_spoken_once_it_is_clear():
    assert "".join(split_tool_calls(["a <", "b> and <tool", "s>"], new_id=ids())) == "a <b> and <tools>"


def test_a_call_opened_in_the_prompt_and_one_left_unclosed_are_read_to_the_end():
    out = list(split_tool_calls(['{"city": "Rome"}}'], opened='\n{"name": "get_weather", "arguments": ',
                                new_id=ids()))
    assert out == [ToolCall("call_0", "get_weather", '{"city": "Rome"}')]
    (bad,) = split_tool_calls(["<tool_call>{'name': nope"], new_id=ids())
    assert bad.name == "" and bad.arguments == "{'name': nope"
    box = Toolbox([WEATHER])
    list(box.run([bad], turn=1, cancelled=lambda: False, record=lambda *a, **k: None, log=logging.getLogger()))
    assert bad.result.startswith("error: the tool call could not be read")


def test_metrics_give_each_turns_tool_calls_and_voice_to_voice_without_tool_time():
    from s2s_flow import metrics
    from tests.test_metrics import graph_for, synthetic_trace

    trace = synthetic_trace()  # end of speech at 10.0 s, first audio at the sink at 11.105 s
    for start, end, tool in ((10.75, 11.0, "get_weather"), (10.8, 10.9, "get_time"), (11.05, 11.5, "get_news")):
        trace.event("tool_call", node="llm", turn=1, tool=tool, call_id="c", args_bytes=17, result_bytes=40,
                    t=end, seconds=end - start, status="ok")
    (row,) = metrics.report(trace, {}, graph_for())["turns"]
    assert row["voice_to_voice_ms"] == pytest.approx(1105.0)
    assert [c["tool"] for c in row["tool_calls"]] == ["get_weather", "get_time", "get_news"]
    assert row["tool_calls"][0] == {"tool": "get_weather", "args_bytes": 17, "ms": pytest.approx(250.0),
                                    "status": "ok"}
    # overlapping calls count once, and time after the first audio is not on the critical path
    assert row["tool_ms"] == pytest.approx(250.0 + 55.0)
    assert row["voice_to_voice_without_tools_ms"] == pytest.approx(1105.0 - 305.0)
