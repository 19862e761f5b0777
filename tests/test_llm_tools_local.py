"""Tool calling in llm=transformers and llm=mlx, on the tiny random Llama with a tool-capable
chat template (Qwen2.5's: tools in the system message, <tool_call> JSON, <tool_response>).

The random model never chooses to call a tool, so these tests force one the way the backends
do for ``tool_choice=<name>``: the call is opened in the prompt, the model writes its
arguments (nonsense, from random weights), the section is parsed out of the stream, run, and
its result rendered back through the template for the next round. Both runtimes share the
weights, so they must agree on every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes.llm._local import TOOL_START, LocalLLM
from nodes.llm.mlx import MLXLLM
from nodes.llm.transformers import TransformersLLM
from s2s_flow.errors import ConfigError
from s2s_flow.node import Context
from tests.support import tools
from tests.support.remote_llm import text_of, turn
from tests.support.tiny_llama import TinyLlama, TinyLlamaConfig, build_tiny_llama

WEATHER = "tests.support.tools:get_weather"
LIBRARY = {TransformersLLM: "transformers", MLXLLM: "mlx_lm"}
BOTH = pytest.mark.parametrize("cls", [TransformersLLM, MLXLLM], ids=["transformers", "mlx"])
GREEDY = {"temperature": 0.0, "system_prompt": "You are a helpful voice assistant.", "max_tokens": 12}


@pytest.fixture(scope="module")
def tool_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyLlama:
    # the template's tool instructions take ~600 tokens of the tiny vocabulary: a longer context
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-tool-llama"), seed=0, chat_template=tools.TOOL_TEMPLATE,
                            config=TinyLlamaConfig(max_position_embeddings=2048))


def local_node(cls: type[LocalLLM], model: Path, tmp_path: Path, **options) -> LocalLLM:
    pytest.importorskip(LIBRARY[cls])
    node = cls(model=str(model), **options)
    node.ctx = Context("llm", tmp_path)
    node.setup()
    return node


def decoded(node: LocalLLM, ids: list[int]) -> str:
    return node._tokenizer.decode(ids)


@BOTH
def test_the_tools_reach_the_prompt_through_the_models_chat_template(cls, tool_llama, tmp_path):
    node = local_node(cls, tool_llama.hf_dir, tmp_path, tools=[WEATHER], **GREEDY)
    node.conversation.add_user("Weather in Paris?", 1)
    prompt = decoded(node, node.chat_prompt(node.conversation.messages(), "auto"))
    assert "<tools>\n" in prompt and '"name": "get_weather"' in prompt and '"city"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # auto: the model decides
    forced = decoded(node, node.chat_prompt(node.conversation.messages(), "get_weather"))
    assert forced.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    plain = decoded(node, node.chat_prompt(node.conversation.messages(), "none"))
    assert "<tools>" not in plain


def test_both_runtimes_make_the_same_forced_call_and_answer_after_its_result(tool_llama, tmp_path):
    rounds = {}
    for cls in (TransformersLLM, MLXLLM):
        tools.CALLS.clear()
        node = local_node(cls, tool_llama.hf_dir, tmp_path, tools=[WEATHER], tool_choice="get_weather",
                          max_tool_rounds=1, **GREEDY)
        deltas = turn(node, "Weather in Paris?")
        exchange = node.conversation.exchanges[-1]
        (round_,) = exchange.rounds
        (call,) = round_.calls
        assert call.name == "get_weather" and call.id == "call_1_1"
        assert call.result  # the model's nonsense arguments give an error result; the turn goes on
        assert TOOL_START not in text_of(deltas) and "</tool_call>" not in text_of(deltas)
        assert deltas[-1].end and text_of(deltas) == exchange.reply
        # the next round's prompt carries the call and its result, as the template writes them
        prompt = decoded(node, node.chat_prompt(node.conversation.messages(), "none"))
        assert '<tool_call>\n{"name": "get_weather", "arguments": ' in prompt
        assert f"<tool_response>\n{call.result}\n</tool_response>" in prompt
        rounds[cls.__name__] = (call.arguments, call.result, text_of(deltas))
        node.close()
    assert rounds["TransformersLLM"] == rounds["MLXLLM"]  # same weights, same greedy steps


def test_a_model_whose_template_ignores_tools_is_refused_at_setup(tiny_llama: TinyLlama, tmp_path):
    with pytest.raises(ConfigError, match=r"never mentions tools.*Qwen3"):
        local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, tools=[WEATHER], **GREEDY)

