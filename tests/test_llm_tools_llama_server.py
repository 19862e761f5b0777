"""Real tool calls from a real server: SmolLM2-135M on llama-server with a tool-capable template.

Facts this file stands on (this llama-server build, checked here):
- SmolLM2's own template ignores ``tools``; with Qwen2.5's template (``--jinja
  --chat-template-file``) the tools reach the prompt and llama-server parses
  ``<tool_call>{...}</tool_call>`` output into ``tool_calls``.
- ``tool_choice: "required"`` alone does not force a call: the server's grammar lets the model
  write text before the call, and the 135M model talks until ``max_tokens``.
- Opening the assistant's turn with the call tag (``llm.tool_call_prefill``) leaves the model
  only the call to write; the required choice's grammar keeps it to the declared schema, so
  the model picks the arguments (``{"city": "Paris"}``) and the server returns a real call.

Then the node runs the tool, sends its result back, and the model answers with it. The same
real calls drive every way a round can go wrong on the tool's side: a tool that raises, one
that outlives ``tool_timeout_s``, one cut short by a barge-in, and one slow enough for the
filler sentence (or not). The last test runs a full spoken turn (Piper speech -> Silero ->
Whisper -> llama-server with the tool -> Piper) from a user recipe that carries the tools.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import soundfile as sf

from nodes.llm._tools import describe
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from s2s_flow.messages import Transcript
from tests.support import tools
from tests.support.fixtures import llama_server_binary, smollm2_gguf  # noqa: F401
from tests.support.managed import wait_until
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.servers import running_llama_server

WEATHER = "tests.support.tools:get_weather"
BROKEN = "tests.support.tools:broken_lookup"
SLOW = "tests.support.tools:slow_lookup"  # runs until the test sets tools.RELEASE
FILLER = "One moment."
SYSTEM = "You are a helpful voice assistant. Answer briefly in plain spoken sentences."
QUESTION = "What is the weather in Paris?"
FORCED = {"tools": [WEATHER], "tool_choice": "required", "tool_call_prefill": "<tool_call>\n",
          "temperature": 0.0, "seed": 1, "max_tokens": 60, "system_prompt": SYSTEM}
BOTH = pytest.mark.parametrize("cls", [ChatCompletionsLLM, ResponsesLLM], ids=["chat", "responses"])


@pytest.fixture(scope="module")
def tool_server(smollm2_gguf: Path, llama_server_binary: Path) -> Iterator[str]:  # noqa: F811
    """llama-server with SmolLM2 and Qwen2.5's tool-capable chat template; yields the API root."""
    args = ("--jinja", "--chat-template-file", str(tools.TOOL_TEMPLATE_PATH))
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=args) as base_url:
        yield base_url + "/v1"


@pytest.fixture(autouse=True)
def fresh_calls():
    tools.CALLS.clear()
    tools.RELEASE.clear()
    yield
    tools.RELEASE.set()  # no tool thread outlives its test blocked


def sent_bodies(node: Any) -> list[dict]:
    """Every request body the node hands its client, as sent to the server (the real client sends it)."""
    bodies: list[dict] = []
    post = node.client.post_stream

    def recording(path: str, body: dict, **options: Any) -> Any:
        bodies.append(copy.deepcopy(body))
        return post(path, body, **options)

    node.client.post_stream = recording
    return bodies


def tool_results(body: dict) -> list[str]:
    """The tool results a request carries: Chat's ``tool`` messages, or Responses' output items."""
    if "messages" in body:
        return [m["content"] for m in body["messages"] if m["role"] == "tool"]
    return [item["output"] for item in body["input"] if item.get("type") == "function_call_output"]


def forced(tool: str, **options: Any) -> dict[str, Any]:
    """FORCED with ``tool`` as the one tool: the server's grammar makes the model call it. One round
    of calls, then the answer in words: these tests are about the tool, not how long a small model
    would go on calling."""
    return {**FORCED, "tools": [tool], "max_tool_rounds": 1, **options}


@BOTH
def test_a_real_model_calls_the_tool_and_answers_with_its_result(tool_server, tmp_path, cls):
    node = llm_node(cls, tool_server, tmp_path, **FORCED)
    deltas = turn(node, QUESTION)
    # the model wrote the call (greedy SmolLM2 writes it twice); the server parsed it into tool_calls
    assert tools.CALLS and set(map(json.dumps, tools.CALLS)) == {json.dumps(("get_weather", {"city": "Paris"}))}
    (round_,) = node.conversation.exchanges[-1].rounds
    assert all(c.name == "get_weather" and json.loads(c.arguments) == {"city": "Paris"} for c in round_.calls)
    assert all(c.id for c in round_.calls) and round_.text == ""  # never spoken: no text before the call
    # 24 degrees comes only from the tool: the server took the request with the result and the model used it
    assert "sunny, 24 degrees" in text_of(deltas)
    assert deltas[-1].end and node.conversation.exchanges[-1].reply == text_of(deltas)
    node.close()


def test_llama_servers_required_choice_alone_lets_the_model_talk_instead_of_calling(tool_server):
    """Why llm.tool_call_prefill exists: the fact as this server build behaves."""
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            "tools": [describe(WEATHER).chat_schema()], "tool_choice": "required", "temperature": 0,
            "max_tokens": 24}
    choice = httpx.post(tool_server + "/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    assert choice["message"]["content"].startswith("The weather in Paris")


def test_the_template_puts_the_tools_in_the_prompt_and_the_result_goes_back_as_a_tool_response(tool_server,
                                                                                               tmp_path):
    node = llm_node(ChatCompletionsLLM, tool_server, tmp_path, **FORCED)
    turn(node, QUESTION)
    after = node.request_body("auto")  # the request that carried the result, rendered by the server
    prompt = httpx.post(tool_server.removesuffix("/v1") + "/apply-template", json=after, timeout=30).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" in prompt
    assert "<tool_response>\nThe weather in Paris is sunny, 24 degrees.\n</tool_response>" in prompt


# -- when the tool goes wrong: real calls, the tool's fault --------------------------------------------


@BOTH
def test_a_tool_that_raises_becomes_a_result_the_model_gets(tool_server, tmp_path, cls):
    node = llm_node(cls, tool_server, tmp_path, **forced(BROKEN))
    bodies = sent_bodies(node)
    deltas = turn(node, "Is the blue kettle in stock?")
    error = "error: ConnectionError: the database at db.internal:5432 refused the connection"
    assert tools.CALLS and {name for name, _ in tools.CALLS} == {"broken_lookup"}  # the model's real call ran
    # every call that ran got the error as its result (a call the model cut off at max_tokens has its own)
    (round_,) = node.conversation.exchanges[-1].rounds
    assert [c.result for c in round_.calls].count(error) == len(tools.CALLS)
    assert deltas[-1].end  # the turn ended normally: the graph goes on
    assert tool_results(bodies[1]).count(error) == len(tools.CALLS)  # the next request carried it to the model
    node.close()


def test_a_tool_past_its_timeout_gives_the_model_an_error_result(tool_server, tmp_path):
    node = llm_node(ChatCompletionsLLM, tool_server, tmp_path, **forced(SLOW, tool_timeout_s=0.2))
    bodies = sent_bodies(node)
    deltas = turn(node, "Where are the maps?")
    assert tools.CALLS and not tools.RELEASE.is_set()  # it ran, and is still blocked
    late = "error: slow_lookup did not finish within 0.2 s; tell the user it is taking too long"
    calls = node.conversation.exchanges[-1].rounds[0].calls
    assert tool_results(bodies[1]) == [late] * len(calls) and deltas[-1].end
    node.close()


def test_a_barge_in_during_a_running_tool_ends_the_turn_at_once(tool_server, tmp_path):
    node = llm_node(ChatCompletionsLLM, tool_server, tmp_path, **forced(SLOW, tool_timeout_s=60))
    bodies = sent_bodies(node)
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(
        node.process("text", Transcript(turn=1, text="Where are the maps?"))))
    consumer.start()
    assert wait_until(lambda: tools.CALLS, 60)  # the model's call is running (it blocks until RELEASE)
    node.on_interrupt(2)  # the user speaks again
    consumer.join(10)
    assert not consumer.is_alive() and got[-1].end
    assert len(bodies) == 1  # the round was abandoned: no request after it
    calls = node.conversation.exchanges[-1].rounds[0].calls
    assert [c.result for c in calls] == ["cancelled: the user interrupted before the tool finished"] * len(calls)
    node.close()


def test_a_tool_done_before_tool_filler_after_s_gets_no_filler(tool_server, tmp_path):
    node = llm_node(ChatCompletionsLLM, tool_server, tmp_path,
                    **forced(SLOW, tool_filler=FILLER, tool_filler_after_s=60, tool_timeout_s=120))
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(
        node.process("text", Transcript(turn=1, text="Where are the maps?"))))
    consumer.start()
    assert wait_until(lambda: tools.CALLS, 60)  # the tool is running ...
    assert not wait_until(lambda: got, 0.5)  # ... and nothing is said while it runs, before the delay
    tools.RELEASE.set()  # it finishes well within tool_filler_after_s
    consumer.join(60)
    assert not consumer.is_alive() and got[-1].end
    assert FILLER not in text_of(got) and FILLER not in node.conversation.exchanges[-1].reply
    node.close()


def test_a_tool_still_running_after_tool_filler_after_s_gets_the_filler_first(tool_server, tmp_path):
    node = llm_node(ChatCompletionsLLM, tool_server, tmp_path,
                    **forced(SLOW, tool_filler=FILLER, tool_filler_after_s=0.3, tool_timeout_s=60))
    bodies = sent_bodies(node)
    gen = node.process("text", Transcript(turn=1, text="Where are the maps?"))
    first = next(gen)  # comes while the tool is blocked: only the delay can have let it out
    assert first.text == FILLER and first.sentence_end  # to TTS while the tool still runs
    assert tools.CALLS and not tools.RELEASE.is_set() and len(bodies) == 1
    tools.RELEASE.set()
    rest = list(gen)
    assert rest[-1].end and text_of([first, *rest]).startswith(FILLER + " ")
    assert node.conversation.exchanges[-1].reply.startswith(FILLER + " ")
    kept = {f"The archive keeps {arguments['topic']} in aisle 7." for _, arguments in tools.CALLS}
    assert set(tool_results(bodies[1])) == kept  # the results came once the tool was let go
    # the filler was said after the call: it opens the answer in the history, not the call's message
    assert [m["content"] for m in bodies[1]["messages"] if m.get("tool_calls")] == [None]
    node.close()


# -- a full spoken turn -----------------------------------------------------------------------------


RECIPE = """\
# @package _global_
# A weather agent: llm=chat on llama-server with one tool (tests/test_llm_tools_llama_server.py).
defaults:
  - override /llm: chat
llm:
  tools: [tests.support.tools:get_weather]
  tool_choice: required
  tool_call_prefill: "<tool_call>\\n"
  temperature: 0
  seed: 1
  max_tokens: 60
"""


def test_a_spoken_question_gets_a_spoken_answer_that_uses_the_tools_result(tool_server, tmp_path):
    from tests.support.speech import synthesize

    question = tmp_path / "question.wav"
    silence = [0.0] * 8000  # half a second either side, as a microphone would hear it
    sf.write(question, [*silence, *synthesize(QUESTION, rate=16000), *silence], 16000, subtype="PCM_16")
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "weather_tools.yaml").write_text(RECIPE)
    run_dir = tmp_path / "run"
    stamps = tmp_path / "tool_stamps.jsonl"  # the tool's own start and end, written by the run's process
    env = {**os.environ, "S2S_LOG_LEVEL": "WARNING", "S2S_FLOW_CONFIG_PATH": str(tmp_path / "conf"),
           tools.STAMPS_ENV: str(stamps)}
    proc = subprocess.run(
        [sys.executable, "-m", "s2s_flow.cli", "recipe=weather_tools", f"llm.base_url={tool_server}",
         "stt=whisper", "tts=piper", "server=null", f"io.input={question}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (run_dir / "transcript.jsonl").read_text().splitlines()]
    assert "weather" in row["user"].lower() and "paris" in row["user"].lower()
    assert "sunny, 24 degrees" in row["agent"] and row["reply_audio_s"] > 1.0  # spoken, from the tool's result
    (turn_,) = json.loads((run_dir / "metrics.json").read_text())["turns"]
    assert turn_["tool_calls"] and {c["tool"] for c in turn_["tool_calls"]} == {"get_weather"}
    assert all(c["status"] == "ok" and c["args_bytes"] > len('{"city":"Paris"}') - 1 for c in turn_["tool_calls"])
    # voice-to-voice without the tools, against stamps the metric does not make: the sink's first
    # audio, the tool's own clock (it took tools.STAMPED_S) and the calls' own records
    trace = json.loads((run_dir / "trace.json").read_text())
    marks = {name: table["1"]["marks"] for name, table in trace["nodes"].items() if "1" in table}
    first_audio, speech_end = marks["sink"]["in:audio"], marks["vad"]["out:speech_end"]
    assert turn_["voice_to_voice_ms"] == pytest.approx((first_audio - speech_end) * 1000, abs=0.1)
    calls = [e for e in trace["events"] if e["kind"] == "tool_call"]
    own = [s["end"] - s["start"] for s in map(json.loads, stamps.read_text().splitlines())]
    assert len(own) == len(calls) == len(turn_["tool_calls"]) and min(own) >= tools.STAMPED_S
    assert speech_end < min(e["t"] - e["seconds"] for e in calls) and max(e["t"] for e in calls) < first_audio
    taken_off = turn_["voice_to_voice_ms"] - turn_["voice_to_voice_without_tools_ms"]
    span = max(e["t"] for e in calls) - min(e["t"] - e["seconds"] for e in calls)  # parallel calls count once
    assert max(own) * 1000 - 0.2 <= taken_off <= span * 1000 + 0.2
