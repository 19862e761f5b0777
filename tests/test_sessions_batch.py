"""A batch of files (io=wav with a directory) runs as sessions, like a server's connections: a fresh
instance of the graph per file (its own rings, threads, history and VAD state), the heavy parts
(weights, ONNX / CTranslate2 sessions) loaded once for the whole batch."""

from __future__ import annotations

import json
import weakref

from s2s_flow.cli import plan
from s2s_flow.compose import compose
from s2s_flow.scheduler import Scheduler
from tests.support.fixtures import llama_server_binary, smollm2_gguf, smollm2_server  # noqa: F401
from tests.support.loads import fresh_models
from tests.support.managed import question_wav


def test_each_file_of_a_batch_is_a_session_of_its_own_on_the_models_loaded_once(
        tmp_path, smollm2_server, monkeypatch):  # noqa: F811
    from nodes.stt.whisper import WhisperSTT
    from nodes.tts.piper import PiperTTS
    from nodes.vad.silero import SileroVAD

    fresh_models(monkeypatch)
    loads: list[str] = []
    for cls in (SileroVAD, WhisperSTT, PiperTTS):
        def counting(node, load=cls.load_shared):
            loads.append(type(node).__name__)
            return load(node)
        monkeypatch.setattr(cls, "load_shared", counting)
    batch = tmp_path / "batch"
    batch.mkdir()
    question_wav(batch / "a.wav", "How many kilometers are there in a marathon?")
    question_wav(batch / "b.wav", "What is the capital of France?")
    cfg, choices = compose(["io=wav", f"io.input={batch}", "vad=silero", "stt=whisper", "tts=piper", "llm=chat",
                            f"llm.base_url={smollm2_server}/v1", "llm.max_tokens=24", "llm.temperature=0",
                            "server=null"])
    scheduler = Scheduler(plan(cfg, choices), tmp_path / "run")
    # only weak references to the first file's nodes (and its LLM, which shares nothing): were the
    # run not to keep its models, they would go with those nodes and load again for the next file
    first = {name: weakref.ref(spec.node) for name, spec in scheduler.graph.nodes.items()}
    first_llm = scheduler.graph.nodes["llm"].node
    scheduler.run()
    last = {name: spec.node for name, spec in scheduler.graph.nodes.items()}

    assert all(ref() is not last[name] for name, ref in first.items()), "every node is the session's own"
    assert sorted(loads) == ["PiperTTS", "SileroVAD", "WhisperSTT"], "each model loaded once for the run"
    for llm, question in ((first_llm, "marathon"), (last["llm"], "france")):
        users = [m["content"] for m in llm.conversation.messages() if m["role"] == "user"]
        assert len(users) == 1 and question in users[0].lower(), "each history holds its own question only"
    rows = [json.loads(line) for line in (tmp_path / "run" / "transcript.jsonl").read_text().splitlines()]
    assert [(r["conversation"], r["turn"]) for r in rows] == [("a", 1), ("b", 2)]
    assert all(r["reply_wav"] and r["agent"] for r in rows)
    assert set(scheduler.trace.conversations.values()) == {"a", "b"}
