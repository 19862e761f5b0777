"""The LLM server serves sessions in parallel: recipe=local_cpu with io=realtime starts llama-server
with a slot per session (continuous batching), so a second session's request streams while the
first session's reply is still being generated, where one slot makes it wait for that whole reply.
Real llama-server, real SmolLM2; the order of events is asserted, not their times."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from nodes.llm.chat import ChatCompletionsLLM
from s2s_flow import inference
from s2s_flow.compose import compose
from s2s_flow.messages import SpeechStarted, Transcript
from s2s_flow.model_server import managed_server
from s2s_flow.model_server_spec import ServerSpec
from tests.support.remote_llm import llm_node, text_of, turn
from tests.support.servers import free_port, running_llama_server

REPLY_TOKENS = 256  # long enough that the second request is sent while the first still streams


def _stream(base_url: str, name: str, events: list[str], lock: threading.Lock, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": REPLY_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=120, trust_env=False) as client, client.stream(
            "POST", f"{base_url}/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line and f"{name} first" not in events:
                with lock:
                    events.append(f"{name} first")
                started.set()
    with lock:
        events.append(f"{name} done")


def two_sessions(base_url: str) -> list[str]:
    """A's request streams; once its first token is in, B's is sent. The order their first tokens
    and their ends arrived in."""
    events: list[str] = []
    lock, a_started, b_started = threading.Lock(), threading.Event(), threading.Event()
    a = threading.Thread(target=_stream, args=(base_url, "A", events, lock, a_started))
    a.start()
    assert a_started.wait(120), "A never streamed"
    b = threading.Thread(target=_stream, args=(base_url, "B", events, lock, b_started))
    b.start()
    a.join(180)
    b.join(180)
    assert sorted(events) == ["A done", "A first", "B done", "B first"], events
    return events


def test_the_realtime_recipe_starts_llama_server_with_a_slot_per_session(llama_server_binary, smollm2_gguf,
                                                                          tmp_path: Path):
    port = free_port()
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=2", f"llm.base_url=http://127.0.0.1:{port}/v1"])
    argv = ServerSpec.from_config(cfg.server).argv(lambda: str(llama_server_binary))
    assert argv[argv.index("-np") + 1] == "3"  # two sessions and the text turn scorer
    with managed_server(cfg.server, tmp_path) as handle:
        assert handle is not None and handle.started
        slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=5, trust_env=False).json()
        assert len(slots) == 3 and {s["n_ctx"] for s in slots} == {1536}  # each keeps a one-session slot's context
        events = two_sessions(f"http://127.0.0.1:{port}/v1")
    # both in flight at once: B streamed before A's reply was done
    assert events.index("B first") < events.index("A done"), events


GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 24,
          "system_prompt": "You are a helpful voice assistant. Answer briefly in plain spoken sentences."}


def _prompt_tokens_read(root: str) -> int:
    """The prompt tokens llama-server has evaluated so far (its /metrics; cached ones are not counted)."""
    text = httpx.get(f"{root}/metrics", timeout=5, trust_env=False).text
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("llamacpp:prompt_tokens_total"))))


def test_each_session_keeps_a_slot_of_its_own_on_the_server_this_process_started(llama_server_binary,
                                                                                 smollm2_gguf, tmp_path: Path):
    """Without a slot of its own, B's first request (it shares only the system prompt with A's
    conversation) went to A's idle slot, the most alike, and A's next turn read its whole history
    again: the recipe's llama-server keeps no copy of it (--cache-ram 0)."""
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=2", f"llm.base_url={root}/v1",
                      "+server.env.LLAMA_ARG_ENDPOINT_METRICS=1"])
    with managed_server(cfg.server, tmp_path):
        a = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "a", **GREEDY)
        b = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "b", **GREEDY)
        assert (a.slot.id, b.slot.id) == (0, 1)  # the third slot is the end-of-turn scorer's
        turn(a, "What is the capital of Italy? Tell me about it.", 1)
        turn(b, "Name a fruit.", 1)
        before = _prompt_tokens_read(root)
        turn(a, "And of France?", 2)  # 60-70 tokens of prompt, the first turn's ~50 among them
        read = _prompt_tokens_read(root) - before
        assert 0 < read < 25, f"A's second turn read {read} prompt tokens: its history again"
        a.close()
        c = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "c", **GREEDY)
        assert c.slot.id == 0  # A's slot, given back when its session ended
        c.close()
        b.close()


def _shifts(log: str) -> tuple[list[str], dict[str, int]]:
    """The server log's requests that shifted the KV cache, in order, and each request's tokens written."""
    shifted = list(dict.fromkeys(re.findall(r"task (\d+) \| reusing chunk with size \d+, shifting KV cache", log)))
    written = {task: int(n) for task, n in re.findall(r"task (\d+) \|\s+eval time =\s+[\d.]+ ms /\s+(\d+) tokens", log)}
    return shifted, written


@contextmanager
def history_of_four(tmp_path: Path, *, vad: bool) -> Iterator[tuple[str, ChatCompletionsLLM]]:
    """recipe=local_cpu's llama-server (its metrics, and a log that shows each shift) and one session's
    LLM node on it with a window of 4 turns; ``vad``: its ``started`` input wired, as in every graph
    with a VAD. Yields the server's root URL and the node, closed on the way out."""
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cfg, _ = compose(["recipe=local_cpu", f"llm.base_url={root}/v1", "+server.env.LLAMA_ARG_ENDPOINT_METRICS=1",
                      "+server.env.LLAMA_ARG_LOG_VERBOSITY=4"])
    with managed_server(cfg.server, tmp_path):
        node = llm_node(ChatCompletionsLLM, f"{root}/v1", tmp_path / "a", max_history_turns=4, **GREEDY)
        if vad:
            node.ctx.inputs_connected = frozenset({"text", "started"})
        try:
            yield root, node
        finally:
            node.close()


def test_a_conversation_longer_than_its_history_reads_only_its_new_words_and_never_waits_for_a_shift(
        llama_server_binary, smollm2_gguf, tmp_path: Path):
    """Past llm.max_history_turns older turns leave the prompt: it then differs from the slot's cache
    right after the system prompt, and llama-server read the whole history again (seconds on one
    core) until the recipe's --cache-reuse let it shift the kept turns in its KV cache instead. The
    shift runs over every slot's cells, every slot's generation waiting: in a graph without a VAD (its
    ``started`` input not wired, as here) the node trims a full window once its reply is written and
    sends the trimmed prompt with one token to write, so each shift
    happens in that request, none in a turn's own, also after a turn answered on its speculative
    transcript (seen failing: every shift in a turn's request, when the window was trimmed only as
    the next turn began; the speculative turn's, when the node went by its own record of the turn,
    which the confirming transcript updates only after the reply)."""
    with history_of_four(tmp_path, vad=False) as (root, node):
        questions = ["What is the capital of France?", "How many people live there?", "What is it famous for?",
                     "What food should I try there?", "Is it expensive?", "Where should I stay?", "When should I go?"]
        read, replies = [], []
        for n, question in enumerate(questions, 1):
            before = _prompt_tokens_read(root)
            if n == 4:  # answered on its speculative transcript, confirmed by the VAD while the reply
                # is written, its confirming transcript reaching the node after it (vad.speculate_ms)
                node.ctx.work.speculate(n)
                reply = node.process("text", Transcript(turn=n, text=question, speculative=True))
                deltas = [next(reply)]
                node.ctx.work.confirm(n)
                replies.append(text_of([*deltas, *reply]))
                assert not list(node.process("text", Transcript(turn=n, text=question)))
            else:
                replies.append(text_of(turn(node, question, n)))
            read.append(_prompt_tokens_read(root) - before)
    assert all(replies), replies
    # turns 5-7 follow a trim (~100 tokens of kept turns behind it); their own new words are ~15
    assert max(read[4:]) < 30, f"prompt tokens read per turn: {read}"
    shifted, written = _shifts((tmp_path / "server.log").read_text())
    # the window of 4 is full after turns 4 and 6: two prepared prompts, each with one shift
    assert len(shifted) == 2, f"requests that shifted the cache: {sorted(shifted)}"
    assert all(written.get(task) == 1 for task in shifted), f"tokens written by the requests that shifted: {written}"


QUESTIONS = ["What is the capital of France?", "How many people live there?", "What is it famous for?",
             "What food should I try there?", "Is it expensive?", "Where should I stay?"]


def test_with_a_vad_the_trimmed_prompt_is_sent_when_the_user_speaks_again_and_a_call_that_ends_never_shifts(
        llama_server_binary, smollm2_gguf, tmp_path: Path):
    """With the VAD's SpeechStarted wired to the LLM (every graph with a VAD), a full window's trim waits
    for the user's next words: the shift runs in a one-token request while the question is spoken,
    not in the turn's own request, and a conversation that ends right after a full window's reply
    (here: the window of 4 is full after turns 4 and 6, and the call ends after turn 6) never shifts.
    Seen failing with the trim sent as the reply is written: two shifts, the second one for nobody.
    A barge-in's interrupt at the user's speech start does not stop it (the kept turns are the same)."""
    with history_of_four(tmp_path, vad=True) as (root, node):
        read = []
        for n, question in enumerate(QUESTIONS, 1):
            if n == 5:
                node.on_interrupt(n)  # the user talked over the end of turn 4's reply
            assert not list(node.process("started", SpeechStarted(turn=n)))
            if node._preparing is not None:
                node._preparing.join(60)  # the user speaks for seconds: the prepare is done before the words
            before = _prompt_tokens_read(root)
            if n == 4:  # the turn that fills the window, answered on its speculative transcript and confirmed
                # while the reply is written, its confirming transcript after it (seen failing: that
                # transcript was taken for the next turn, and the trim was never sent)
                node.ctx.work.speculate(n)
                reply = node.process("text", Transcript(turn=n, text=question, speculative=True))
                deltas = [next(reply)]
                node.ctx.work.confirm(n)
                assert text_of([*deltas, *reply])
                assert not list(node.process("text", Transcript(turn=n, text=question)))
            else:
                assert text_of(turn(node, question, n))
            read.append(_prompt_tokens_read(root) - before)
        time.sleep(1.0)  # a prepare sent after the last reply would be in the log by now
    assert max(read[4:]) < 30, f"prompt tokens read per turn: {read}"  # turn 5 follows the trim
    shifted, written = _shifts((tmp_path / "server.log").read_text())
    assert len(shifted) == 1, f"requests that shifted the cache: {shifted}"
    assert written.get(shifted[0]) == 1, f"tokens written by the request that shifted: {written}"


def test_a_turn_that_comes_while_its_prompt_waits_to_be_prepared_shifts_the_cache_itself(
        llama_server_binary, smollm2_gguf, tmp_path: Path):
    """The prepare waits (up to PREPARE_WAIT_S) for other sessions' first words on the machine's critical
    path; a question shorter than that wait makes its request first: the waiting prepare is dropped,
    never sent after the turn's own request (it would shift a cache the request already shifted), and
    the turn is answered with the shift in its own request."""
    with history_of_four(tmp_path, vad=True) as (_, node):
        for n, question in enumerate(QUESTIONS[:4], 1):
            assert text_of(turn(node, question, n))
        with inference.critical.holding():  # another session's first words are in flight
            assert not list(node.process("started", SpeechStarted(turn=5)))
            assert node._preparing is not None and node._preparing.is_alive()  # waiting for them
            assert text_of(turn(node, QUESTIONS[4], 5))
        node._preparing.join(10)
        time.sleep(1.0)  # a prepare sent late would be in the log by now
    shifted, written = _shifts((tmp_path / "server.log").read_text())
    assert len(shifted) == 1, f"requests that shifted the cache: {shifted}"
    assert written.get(shifted[0], 0) > 1, f"the shift was not in the turn's own request: {written}"


def test_a_server_this_process_did_not_start_places_requests_itself(llama_server_binary, smollm2_gguf, tmp_path):
    """Other processes may send it requests (two s2s-run behind a load balancer share one llama-server):
    a slot taken here could be another process' conversation, so no request names one."""
    with running_llama_server(smollm2_gguf, binary=llama_server_binary, extra_args=("-np", "3")) as root:
        node = llm_node(ChatCompletionsLLM, root + "/v1", tmp_path, **GREEDY)
        assert node.slot.id is None and "id_slot" not in node.request_body()
        node.close()


def _anonymous_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def _conversation(base_url: str, k: int) -> None:
    """One conversation of its own (a caller who hangs up after two questions)."""
    messages = [{"role": "system", "content": f"You are caller {k}'s voice assistant. " + "Answer briefly. " * 20}]
    with httpx.Client(timeout=120, trust_env=False) as client:
        for question in (f"My number is {k * 7919}. What is it times two?", "And what is half of it?"):
            messages.append({"role": "user", "content": question})
            answer = client.post(f"{base_url}/chat/completions", json={
                "messages": messages, "max_tokens": 24, "temperature": 0}).json()
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


def test_the_recipes_llama_server_keeps_nothing_of_conversations_that_ended(llama_server_binary, smollm2_gguf,
                                                                           tmp_path: Path):
    """llama-server's host prompt cache (--cache-ram, 8 GiB by default) keeps every finished
    conversation's KV state: ~5 MB each here, so a server's memory grew with every call it had ever
    served. The recipe turns it off (each live session has a slot of its own)."""
    port = free_port()
    cfg, _ = compose(["recipe=local_cpu", "io=realtime", "io.max_sessions=2", f"llm.base_url=http://127.0.0.1:{port}/v1"])
    with managed_server(cfg.server, tmp_path) as handle:
        assert handle is not None and handle.started and handle.pid
        base_url = f"http://127.0.0.1:{port}/v1"
        for k in range(3):  # the slots and the server's buffers warmed
            _conversation(base_url, k)
        before = _anonymous_mb(handle.pid)
        for k in range(3, 15):
            _conversation(base_url, k)
        grown = _anonymous_mb(handle.pid) - before
    # with the cache on: +55-65 MB for these 12 conversations; off: under 1 MB
    assert grown < 12, f"llama-server grew {grown:.1f} MB over 12 conversations that ended"


def test_with_one_slot_the_second_request_waits_for_the_whole_first_reply(llama_server_binary, smollm2_gguf):
    with running_llama_server(smollm2_gguf, binary=llama_server_binary) as root:  # --parallel 1
        events = two_sessions(root + "/v1")
    assert events.index("A done") < events.index("B first"), events


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
