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

Then the node runs the tool, sends its result back, and the model answers with it. The last
test runs a full spoken turn (Piper speech -> Silero -> Whisper -> llama-server with the tool
-> Piper) from a user recipe that carries the tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from nodes.llm._tools import describe
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.responses import ResponsesLLM
from tests.support import tools
from tests.support.fixtures import llama_server_binary, smollm2_gguf  # noqa: F401
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.servers import running_llama_server

WEATHER = "tests.support.tools:get_weather"
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
    env = {**os.environ, "S2S_LOG_LEVEL": "WARNING", "S2S_FLOW_CONFIG_PATH": str(tmp_path / "conf")}
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
    assert turn_["tool_ms"] is not None
    assert turn_["voice_to_voice_without_tools_ms"] == pytest.approx(turn_["voice_to_voice_ms"] - turn_["tool_ms"],
                                                                     abs=0.2)
