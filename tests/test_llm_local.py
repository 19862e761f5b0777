"""llm=transformers and llm=mlx on the tiny random Llama, checked against llama.cpp.

The reference reply comes from our own ``llm=chat`` node talking to a real llama-server
that serves the same weights as a GGUF, so one greedy reply is compared across three
runtimes and two code paths (local chat template vs. the server's).
"""

from __future__ import annotations

import copy
import gc
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodes.llm._local import LocalLLM, _without_thinking
from nodes.llm.chat import ChatCompletionsLLM
from nodes.llm.mlx import MLXLLM
from nodes.llm.transformers import TransformersLLM
from s2s_flow.errors import ConfigError, MissingDependency, ModelNotAvailable
from s2s_flow.messages import TextDelta, Transcript
from s2s_flow.node import Context, SessionHooks, keep_shared
from tests.support.loads import count_loads, fresh_models, warm_ups
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.tiny_llama import TinyLlama

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful voice assistant."
USER = "Hello! How are you today?"
N_TOKENS = 24  # the tiny model never emits eos: every reply is exactly this long
LONG = 400  # a reply much longer than any interrupt test waits for (context is 512)
GREEDY = {"temperature": 0.0, "system_prompt": SYSTEM}
LIBRARY = {TransformersLLM: "transformers", MLXLLM: "mlx_lm"}
BOTH = pytest.mark.parametrize("cls", [TransformersLLM, MLXLLM], ids=["transformers", "mlx"])
QWEN3_STYLE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def local_node(cls: type[LocalLLM], model: Path | str, tmp_path: Path, said: list[str] | None = None,
               **options) -> LocalLLM:
    """A local LLM node with a context, loaded and warmed up (skipped if its library is missing);
    what its setup() shows as progress goes to ``said``."""
    pytest.importorskip(LIBRARY[cls])
    node = cls(model=str(model), **options)
    node.ctx = Context("llm", tmp_path, progress=None if said is None else said.append)
    t0 = time.monotonic()
    node.setup()
    print(f"{cls.__name__} setup (load + warm-up): {time.monotonic() - t0:.2f} s")
    return node


def generation_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-generate") and t.is_alive()]


@pytest.fixture(scope="module")
def llama_cpp_reply(tiny_llama_server: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The greedy reply of llama.cpp (llama-server + the GGUF), asked through llm=chat."""
    node = llm_node(ChatCompletionsLLM, tiny_llama_server + "/v1", tmp_path_factory.mktemp("chat"),
                    max_tokens=N_TOKENS, **GREEDY)
    reply = text_of(turn(node, USER))
    node.close()
    return reply


# -- same greedy text as llama.cpp ----------------------------------------------------------


@BOTH
def test_a_model_directory_given_from_home_loads(cls, tiny_llama: TinyLlama, tmp_path, monkeypatch):
    """The loaders do not expand ``~``: the node must, or '~/x' is taken for a bad hub id."""
    monkeypatch.setenv("HOME", str(tiny_llama.hf_dir.parent))
    node = local_node(cls, f"~/{tiny_llama.hf_dir.name}", tmp_path, max_tokens=4, **GREEDY)
    assert node.model == str(tiny_llama.hf_dir.resolve())
    assert text_of(turn(node, USER))


@BOTH
def test_greedy_reply_is_the_same_text_as_llama_cpp_through_the_chat_node(
    cls, tiny_llama: TinyLlama, llama_cpp_reply: str, tmp_path
):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    t0 = time.monotonic()
    reply = text_of(turn(node, USER))
    print(f"{cls.__name__}: {N_TOKENS} tokens in {time.monotonic() - t0:.3f} s")
    assert node.last_reply_tokens == N_TOKENS and node.last_stop == "length"
    assert len(llama_cpp_reply) > N_TOKENS // 2
    if cls is MLXLLM:
        # mlx-lm's streaming BPE detokenizer drops the space that opens a reply's first
        # token, by design (trim_space); every other character is the same.
        assert llama_cpp_reply.startswith(" ")
        assert reply == llama_cpp_reply[1:]
    else:
        assert reply == llama_cpp_reply


def test_second_turn_with_history_is_the_same_text_as_llama_cpp(
    tiny_llama: TinyLlama, tiny_llama_server: str, tmp_path
):
    """The bounded history (user, assistant, user) renders the same in both chat templates."""
    chat = llm_node(ChatCompletionsLLM, tiny_llama_server + "/v1", tmp_path, max_tokens=N_TOKENS, **GREEDY)
    local = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    for n, user in enumerate([USER, "Tell me a short story, please."], start=1):
        assert text_of(turn(local, user, n)) == text_of(turn(chat, user, n))
    assert [e.reply for e in local.conversation.exchanges] == [e.reply for e in chat.conversation.exchanges]
    chat.close()


class HoldingSession(SessionHooks):
    """A server's session as its LLM sees it: turn 1 waits for the client, and requests carry
    a system prompt of the session's own (a response's instructions)."""

    def answers(self, turn: int) -> bool:
        return turn != 1

    def history(self, conversation):
        view = copy.copy(conversation)
        view.system_prompt = "Answer in French."
        return view


@BOTH
def test_the_session_decides_which_turns_are_answered_and_what_history_the_model_sees(cls, tiny_llama: TinyLlama,
                                                                                      tmp_path):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    node.ctx.session = HoldingSession()
    assert turn(node, USER, 1) == [] and node.conversation.exchanges == [], "a held turn is not answered"
    prompts: list[list[dict]] = []
    chat_prompt = node.chat_prompt
    node.chat_prompt = lambda messages, *rest: (prompts.append(messages), chat_prompt(messages, *rest))[1]
    assert text_of(turn(node, USER, 2))
    assert prompts[-1][0] == {"role": "system", "content": "Answer in French."}
    assert node.conversation.system_prompt != "Answer in French.", "the view changes the request, not the history"


# -- prompt cache ------------------------------------------------------------------------------


@BOTH
def test_later_turns_take_what_they_share_from_the_cache_and_answer_the_same(cls, tiny_llama: TinyLlama, tmp_path):
    cached = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    plain = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, prompt_cache=False, **GREEDY)
    reused = []
    for n, user in enumerate([USER, "Tell me a short story, please.", "What did I ask first?"], start=1):
        assert text_of(turn(cached, user, n)) == text_of(turn(plain, user, n))
        reused.append(cached.last_prompt_reused)
        assert plain.last_prompt_reused == 0
    system_prompt = len(cached._tokenizer.encode(SYSTEM, add_special_tokens=False))
    # turn 1 takes the system prompt this session primed its cache with while it started (the
    # process's warm-up left no session a cache); later turns take the whole history before them
    assert system_prompt <= reused[0] < reused[1] < reused[2]
    print(f"{cls.__name__}: prompt tokens taken from the cache per turn: {reused}")


@BOTH
def test_after_an_interrupted_reply_the_next_turn_answers_as_without_the_cache(cls, tiny_llama: TinyLlama, tmp_path):
    cached = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    gen = cached.process("text", Transcript(turn=1, text=USER))
    [next(gen) for _ in range(3)]
    gen.close()  # barge-in: the cache holds more of the reply than the history keeps
    plain = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, prompt_cache=False, **GREEDY)
    plain.conversation = copy.deepcopy(cached.conversation)
    cached.max_tokens = N_TOKENS
    follow_up = "Tell me a short story, please."
    assert text_of(turn(cached, follow_up, 2)) == text_of(turn(plain, follow_up, 2))
    assert cached.last_prompt_reused > 0


# -- streaming ---------------------------------------------------------------------------------


@BOTH
def test_a_reply_streams_as_several_deltas_and_one_end_marker(cls, tiny_llama: TinyLlama, tmp_path):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    deltas = turn(node, USER, 7)
    assert all(isinstance(d, TextDelta) and d.turn == 7 for d in deltas)
    assert len([d for d in deltas if d.text]) >= 5
    assert sum(d.end for d in deltas) == 1 and deltas[-1].end and deltas[-1].text == ""
    assert deltas[-1].sentence_end  # the end marker closes the last sentence for TTS
    assert node.conversation.exchanges[-1].reply == text_of(deltas)
    node.reset()
    assert node.conversation.exchanges == []


def test_the_first_text_arrives_while_transformers_is_still_generating(tiny_llama: TinyLlama, tmp_path):
    node = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    gen = node.process("text", Transcript(turn=1, text=USER))
    first = next(gen)
    assert first.text and not first.end
    assert generation_threads(), "the first delta came only after generation ended"
    gen.close()


def test_empty_and_partial_transcripts_get_no_reply(tiny_llama: TinyLlama, tmp_path):
    node = local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    assert list(node.process("text", Transcript(turn=1, text="  "))) == []
    assert list(node.process("text", Transcript(turn=1, text="Hello", final=False))) == []
    assert node.conversation.exchanges == []


# -- interrupts ------------------------------------------------------------------------------


@BOTH
def test_closing_the_reply_stops_generation_at_once_and_leaves_no_thread(cls, tiny_llama: TinyLlama, tmp_path):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    gen = node.process("text", Transcript(turn=1, text=USER))
    got = [next(gen) for _ in range(3)]
    t0 = time.monotonic()
    gen.close()  # the engine closes a stale turn's generator at its next yield
    stopped_in = time.monotonic() - t0
    print(f"{cls.__name__}: generation stopped {stopped_in * 1000:.1f} ms after close, "
          f"{node.last_reply_tokens} of {LONG} tokens generated")
    assert generation_threads() == []
    assert node.last_stop == "interrupted" and node.last_reply_tokens < LONG // 4
    assert node.conversation.exchanges[-1].reply == text_of(got)


@BOTH
def test_on_interrupt_from_another_thread_ends_the_reply(cls, tiny_llama: TinyLlama, tmp_path):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    gen = node.process("text", Transcript(turn=1, text=USER))
    first = next(gen)
    barge_in = threading.Thread(target=node.on_interrupt, args=(2,))
    t0 = time.monotonic()
    barge_in.start()
    barge_in.join()
    rest = list(gen)  # ends by itself
    ended_in = time.monotonic() - t0
    print(f"{cls.__name__}: reply ended {ended_in * 1000:.1f} ms after on_interrupt, "
          f"{node.last_reply_tokens} of {LONG} tokens generated")
    assert rest and rest[-1].end and sum(d.end for d in rest) == 1
    assert node.last_stop == "interrupted" and node.last_reply_tokens < LONG // 4
    assert generation_threads() == []
    assert node.conversation.exchanges[-1].reply == text_of([first, *rest])


@BOTH
def test_a_turn_interrupted_before_it_starts_is_not_generated(cls, tiny_llama: TinyLlama, tmp_path):
    node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    node.on_interrupt(5)
    deltas = turn(node, USER, 4)
    assert [(d.text, d.end) for d in deltas] == [("", True)]


# -- sessions: one model per process, a history per session ---------------------------------------


def count_model_loads(cls: type[LocalLLM], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    library = pytest.importorskip(LIBRARY[cls])
    if cls is MLXLLM:
        return count_loads(library, "load", monkeypatch)
    return count_loads(library.AutoModelForCausalLM, "from_pretrained", monkeypatch)


A_TURNS = [USER, "What did I ask first?"]
B_TURNS = ["Tell me a short story, please.", "Numbers are useful too."]


@BOTH
def test_sessions_of_one_model_load_and_warm_it_up_once(cls, tiny_llama: TinyLlama, tmp_path, monkeypatch):
    fresh_models(monkeypatch)
    loads, said = count_model_loads(cls, monkeypatch), []
    first = local_node(cls, tiny_llama.hf_dir, tmp_path, said, max_tokens=N_TOKENS, **GREEDY)
    assert len(loads) == 1 and warm_ups(said) == 1
    # other generation and history options: the same weights
    second = local_node(cls, tiny_llama.hf_dir, tmp_path, said, max_tokens=4, temperature=0.5, seed=3,
                        system_prompt="Be brief.", max_history_turns=2)
    assert len(loads) == 1 and warm_ups(said) == 1, "the second session loads nothing and generates nothing"
    assert second._model is first._model and second._tokenizer is first._tokenizer
    assert second.shared_key() == first.shared_key()


@BOTH
def test_a_server_preloads_the_model_without_a_setup_and_its_sessions_load_nothing(cls, tiny_llama: TinyLlama,
                                                                                   tmp_path, monkeypatch):
    fresh_models(monkeypatch)
    loads, said = count_model_loads(cls, monkeypatch), []
    with keep_shared():  # what io=realtime's preload does: shared() on a node never set up
        preloading = cls(model=str(tiny_llama.hf_dir), **GREEDY)
        preloading.ctx = Context("llm", tmp_path, progress=said.append)
        preloading.shared()
        del preloading
        gc.collect()
        node = local_node(cls, tiny_llama.hf_dir, tmp_path, said, max_tokens=N_TOKENS, **GREEDY)
        assert len(loads) == 1 and warm_ups(said) == 1
        assert text_of(turn(node, USER))


@BOTH
def test_each_session_keeps_its_own_history_and_answers_as_if_alone(cls, tiny_llama: TinyLlama, tmp_path,
                                                                   monkeypatch):
    fresh_models(monkeypatch)
    alone = {}
    for name, turns in (("a", A_TURNS), ("b", B_TURNS)):
        node = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
        alone[name] = [text_of(turn(node, user, n)) for n, user in enumerate(turns, start=1)]
    reference_model = node._model
    fresh_models(monkeypatch)  # the two sessions load a model of their own: no state from the reference
    a = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    b = local_node(cls, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    assert a._model is b._model and a._model is not reference_model
    got: dict[str, list[str]] = {"a": [], "b": []}
    for n in (1, 2):  # the turns interleave: a, b, a, b
        got["a"].append(text_of(turn(a, A_TURNS[n - 1], n)))
        got["b"].append(text_of(turn(b, B_TURNS[n - 1], n)))
    assert got == alone
    assert [e.user for e in a.conversation.exchanges] == A_TURNS
    assert [e.user for e in b.conversation.exchanges] == B_TURNS
    assert a.last_prompt_reused > 0, "its own cache survived the other session's turn"


def test_transformers_sessions_generate_at_the_same_time_on_the_shared_weights(tiny_llama: TinyLlama, tmp_path,
                                                                             monkeypatch):
    """``thread-safe``: two sessions' generations overlap, and each answers as it does alone."""
    fresh_models(monkeypatch)
    options = {"max_tokens": 160, **GREEDY}
    sessions = [local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, **options) for _ in range(2)]
    alone = [text_of(turn(local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, **options), user))
             for user in (A_TURNS[0], B_TURNS[0])]
    start, spans, replies = threading.Barrier(2, timeout=30), [(0.0, 0.0)] * 2, [""] * 2

    def converse(i: int) -> None:
        start.wait()
        deltas, t0 = [], time.monotonic()
        for delta in sessions[i].process("text", Transcript(turn=1, text=(A_TURNS[0], B_TURNS[0])[i])):
            deltas.append(delta)
            if len(deltas) == 1:
                t0 = time.monotonic()
        spans[i], replies[i] = (t0, time.monotonic()), text_of(deltas)

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert replies == alone
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, "one session's reply streamed while the other's did"


def test_mlx_sessions_take_turns_generating(tiny_llama: TinyLlama, tmp_path, monkeypatch):
    """``locked``: a session's reply waits for the other's last token, then answers as it does alone."""
    fresh_models(monkeypatch)
    alone = text_of(turn(local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY), B_TURNS[0]))
    a = local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    b = local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    reply_a = a.process("text", Transcript(turn=1, text=USER))
    next(reply_a)  # a is generating
    got: list[TextDelta] = []
    waiting = threading.Thread(target=lambda: got.extend(turn(b, B_TURNS[0])))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and got == [], "b's reply waits while a generates"
    reply_a.close()  # a's barge-in: its generation ends, b's begins
    waiting.join(timeout=30)
    assert text_of(got) == alone and a.last_stop == "interrupted"


def test_a_session_waiting_its_turn_on_mlx_stops_waiting_at_a_barge_in(tiny_llama: TinyLlama, tmp_path,
                                                                       monkeypatch):
    fresh_models(monkeypatch)
    a = local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=LONG, **GREEDY)
    b = local_node(MLXLLM, tiny_llama.hf_dir, tmp_path, max_tokens=N_TOKENS, **GREEDY)
    reply_a = a.process("text", Transcript(turn=1, text=USER))
    next(reply_a)
    got: list[TextDelta] = []
    waiting = threading.Thread(target=lambda: got.extend(turn(b, B_TURNS[0], 3)))
    waiting.start()
    waiting.join(timeout=0.3)
    t0 = time.monotonic()
    b.on_interrupt(4)
    waiting.join(timeout=5)
    assert not waiting.is_alive() and time.monotonic() - t0 < 1
    assert b.last_stop == "interrupted" and text_of(got) == ""
    assert next(reply_a).text, "a generates on"
    reply_a.close()


def test_another_dtype_or_model_is_loaded_apart(tiny_llama: TinyLlama, qwen3_style_model: Path, tmp_path,
                                                monkeypatch):
    fresh_models(monkeypatch)
    loads = count_model_loads(TransformersLLM, monkeypatch)
    f32 = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, dtype="float32", max_tokens=N_TOKENS, **GREEDY)
    bf16 = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, dtype="bfloat16", max_tokens=N_TOKENS, **GREEDY)
    other = local_node(TransformersLLM, qwen3_style_model, tmp_path, dtype="float32", max_tokens=N_TOKENS, **GREEDY)
    again = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, dtype="float32", max_tokens=4)
    assert loads == [str(tiny_llama.hf_dir), str(tiny_llama.hf_dir), str(qwen3_style_model)]
    assert again._model is f32._model and len({id(f32._model), id(bf16._model), id(other._model)}) == 3
    assert str(next(bf16._model.parameters()).dtype) == "torch.bfloat16"
    assert all(text_of(turn(node, USER)) for node in (f32, bf16, other))


@pytest.fixture(scope="module")
def templateless_model(tiny_llama: TinyLlama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without a chat template, as a base model comes."""
    path = tmp_path_factory.mktemp("base-model") / "hf"
    shutil.copytree(tiny_llama.hf_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@BOTH
def test_a_model_without_a_chat_template_is_refused_to_every_session(cls, templateless_model: Path, tmp_path,
                                                                    monkeypatch):
    fresh_models(monkeypatch)
    loads, said, refused = count_model_loads(cls, monkeypatch), [], []
    for _ in range(2):
        node = cls(model=str(templateless_model), **GREEDY)
        node.ctx = Context("llm", tmp_path, progress=said.append)
        with pytest.raises(ConfigError, match=r"has no chat template \(a base model\?\): choose an instruct"):
            node.setup()
        refused.append(node)  # a run closes it; held here, its model stays loaded
    assert len(loads) == 1 and warm_ups(said) == 0


def test_a_session_asking_for_tools_the_template_ignores_is_refused_alone(tiny_llama: TinyLlama, tmp_path,
                                                                          monkeypatch):
    """The tools are a session's option: checked in each setup() against the one loaded model."""
    fresh_models(monkeypatch)
    loads = count_model_loads(TransformersLLM, monkeypatch)
    plain = local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, max_tokens=4, **GREEDY)
    with pytest.raises(ConfigError, match="never mentions tools"):
        local_node(TransformersLLM, tiny_llama.hf_dir, tmp_path, tools=["tests.support.tools:get_weather"])
    assert len(loads) == 1 and text_of(turn(plain, USER))


# -- chat template ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_style_model(tiny_llama: TinyLlama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that reads ``enable_thinking``, as Qwen3's does."""
    path = tmp_path_factory.mktemp("qwen3-style") / "hf"
    shutil.copytree(tiny_llama.hf_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_STYLE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@BOTH
@pytest.mark.parametrize("thinking", [False, True], ids=["default", "thinking"])
def test_thinking_is_off_by_default_for_templates_that_read_the_switch(cls, thinking, qwen3_style_model, tmp_path):
    options = {"enable_thinking": True} if thinking else {}
    node = local_node(cls, qwen3_style_model, tmp_path, max_tokens=4, **GREEDY, **options)
    node.conversation.add_user(USER, 1)
    prompt = node._tokenizer.decode(node.chat_prompt(node.conversation.messages()))
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (not thinking)


@pytest.mark.parametrize(
    "pieces, opened, spoken",
    [
        (["Hello", " there."], False, "Hello there."),
        (["<thi", "nk>\nLet me think.", "</th", "ink>\n\nHi", " there."], False, "Hi there."),
        (["  <think>x</think>Hi."], False, "Hi."),
        (["Let me think.", "</think>", "Hi."], True, "Hi."),
        (["<think>thoughts that never end"], False, ""),
        (["<", "b>bold</b>"], False, "<b>bold</b>"),
    ],
)
def test_a_think_section_is_never_spoken(pieces, opened, spoken):
    assert "".join(_without_thinking(iter(pieces), opened=opened)) == spoken


def test_text_after_the_think_section_streams_piece_by_piece():
    out = list(_without_thinking(iter(["<think>a</think>", "One.", " Two.", " Three."]), opened=False))
    assert out == ["One.", " Two.", " Three."]


# -- failures that must be answers -----------------------------------------------------------


@BOTH
@pytest.mark.parametrize("offline_env", [True, False], ids=["HF_HUB_OFFLINE=1", "no-network"])
def test_a_hub_model_offline_fails_within_5s_with_model_not_available(cls, offline_env, monkeypatch, tmp_path,
                                                                     offline_hub):
    pytest.importorskip(LIBRARY[cls])
    if offline_env:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # else: offline_hub's endpoint refuses connections, the same on a machine that reaches the hub
    model = "s2s-flow-tests/no-such-model"  # never in any cache
    node = cls(model=model)
    node.ctx = Context("llm", tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ModelNotAvailable) as err:
        node.setup()
    elapsed = time.monotonic() - t0
    print(f"{cls.__name__}: ModelNotAvailable after {elapsed:.2f} s")
    assert elapsed < 5
    assert model in str(err.value) and cls.backend in str(err.value)


@pytest.mark.parametrize("cls, module, extra", [
    (TransformersLLM, "torch", "transformers"),
    (TransformersLLM, "transformers", "transformers"),
    (MLXLLM, "mlx_lm", "mlx"),
])
def test_a_missing_library_names_the_extra_to_install(cls, module, extra, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without it looks like to import
    node = cls(model="s2s-flow-tests/no-such-model")
    node.ctx = Context("llm", tmp_path)
    with pytest.raises(MissingDependency) as err:
        node.setup()
    assert f"pip install 's2s-flow[{extra}]'" in str(err.value) and module in str(err.value)


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("option, cls", [("transformers", TransformersLLM), ("mlx", MLXLLM)])
def test_the_config_composes_and_validates_without_loading_a_model_library(option, cls):
    code = (f"import sys; sys.argv=['s2s-run','llm={option}','dry_run=true']; from s2s_flow.cli import main; "
            "main(); heavy=[m for m in ('torch','transformers','mlx','mlx_lm') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{cls.__module__}.{cls.__name__}" in out.stdout and "stt.text -> llm.text" in out.stdout
    assert "llm.text -> tts.text" in out.stdout and "HEAVY []" in out.stdout


@pytest.mark.parametrize("override, named", [
    ("llm.dtype=float8", "llm.dtype"),
    ("llm.device=gpu", "llm.device"),
    ("llm.temperature=-1", "llm.temperature"),
    ("llm.max_new_tokens=64", "llm.max_tokens"),  # did-you-mean: one spelling for every llm
])
def test_bad_options_are_one_paragraph_naming_the_option(override, named):
    out = subprocess.run([sys.executable, "-m", "s2s_flow.cli", "llm=transformers", override, "dry_run=true"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert named in out.stderr and "Traceback" not in out.stderr


def test_mlx_leaves_the_processs_open_file_limit_as_it_found_it():
    """mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096) at import: a server's connections would share
    2048 descriptors. Run in a fresh interpreter (an imported mlx_lm does not run its import again)."""
    code = ("import resource, sys\n"
            "from nodes.llm.mlx import MLXLLM\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (3000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "node = MLXLLM.__new__(MLXLLM)\n"
            "node.temperature, node.top_p = 0.0, 1.0\n"
            "node._import()\n"
            "assert 'mlx_lm.utils' in sys.modules\n"
            "print(before, resource.getrlimit(resource.RLIMIT_NOFILE))\n"
            "sys.exit(resource.getrlimit(resource.RLIMIT_NOFILE)[0] != before[0])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
