"""Sessions and shared resources in the node contract: a session is one conversation (one
instance of the graph: a file of a batch, the microphone, a server's connection); what is per
session lives on the node, what is heavy is loaded once per process per ``shared_key()``."""

from __future__ import annotations

import gc
import threading

from s2s_flow.cli import plan
from s2s_flow.compose import compose
from s2s_flow.node import Context, Node, keep_shared


class Weights:
    """Stands for a model: any object that can be weakly referenced."""

    def __init__(self, name: str) -> None:
        self.name = name


class Model(Node):
    outputs = {}
    loads = 0
    gate: threading.Barrier | None = None

    def __init__(self, *, name: str = "tiny") -> None:
        self.name = name

    def shared_key(self):
        return (self.name,)

    def load_shared(self):
        type(self).loads += 1
        return Weights(self.name)

    def setup(self) -> None:
        if self.gate is not None:
            self.gate.wait()  # every session asks at the same moment
        self.weights = self.shared()


def _fresh(cls: type[Model]) -> None:
    cls.loads, cls.gate = 0, None
    gc.collect()


def test_sessions_asking_at_once_share_one_load_per_key():
    _fresh(Model)
    nodes = [Model() for _ in range(4)] + [Model(name="other")]
    Model.gate = threading.Barrier(len(nodes), timeout=30)
    threads = [threading.Thread(target=n.setup) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Model.loads == 2, "one load per shared_key(), however many sessions ask at once"
    assert len({id(n.weights) for n in nodes[:4]}) == 1 and nodes[4].weights is not nodes[0].weights


def test_shared_resources_are_freed_with_their_last_session_unless_kept():
    _fresh(Model)
    first = Model()
    first.setup()
    second = Model()
    second.setup()
    assert Model.loads == 1
    del first, second
    gc.collect()
    Model().setup()
    assert Model.loads == 2, "nobody held it: loaded again (a sweep's next job frees its models)"
    with keep_shared():
        node = Model()
        node.setup()
        del node
        gc.collect()
        Model().setup()
        assert Model.loads == 3, "a server keeps what it loaded warm between sessions"


def test_new_turns_rise_across_the_nodes_of_a_run(tmp_path):
    run_state: dict = {}
    a, b = Context("vad", tmp_path, run_state=run_state), Context("source", tmp_path, run_state=run_state)
    turns = [a.new_turn(), b.new_turn(), a.new_turn()]
    assert turns == [1, 2, 3]
    assert Context("vad", tmp_path).new_turn() == 1, "another session counts on its own"


def test_typed_messages_join_the_transcripts_on_their_way_to_the_llm():
    cfg, choices = compose(["io=realtime"])
    edges = {e.key for e in plan(cfg, choices).edges}
    assert {"stt.text -> llm.text", "source.text -> llm.text", "stt.text -> sink.user"} <= edges
    cfg, choices = compose(["io=realtime", "stt=none", "llm=chat"])
    edges = [e.key for e in plan(cfg, choices).edges]
    assert edges.count("source.text -> llm.text") == 1 and "vad.speech -> llm.audio" in edges


def test_built_in_backends_say_how_their_sessions_use_what_they_share():
    from nodes.llm.chat import ChatCompletionsLLM
    from nodes.llm.mlx import MLXLLM
    from nodes.llm.transformers import TransformersLLM
    from nodes.stt.parakeet import ParakeetSTT
    from nodes.stt.whisper import WhisperSTT
    from nodes.stt.whisper_hf import WhisperHFSTT
    from nodes.tts.espeak import EspeakTTS
    from nodes.tts.kokoro import KokoroTTS
    from nodes.tts.piper import PiperTTS
    from nodes.tts.qwen3 import Qwen3TTS
    from nodes.vad.silero import SileroVAD

    for cls in (SileroVAD, WhisperSTT, PiperTTS, TransformersLLM, WhisperHFSTT):
        assert cls.shared_safety.startswith("thread-safe: "), cls
    for cls in (EspeakTTS, MLXLLM, ParakeetSTT, KokoroTTS, Qwen3TTS):
        assert cls.shared_safety.startswith("locked: "), cls
    assert ChatCompletionsLLM.shared_safety.startswith("per session")
    assert SileroVAD().shared_key() == SileroVAD(threshold=0.7).shared_key(), "one ONNX session for all settings"


def test_what_decides_a_local_backends_load_is_its_shared_key_and_nothing_else():
    """Weights, device and dtype make the key; a session's own options (prompt, sampling,
    language, voice, speed) do not, so sessions that differ only in those share one load."""
    from nodes.llm.mlx import MLXLLM
    from nodes.llm.transformers import TransformersLLM
    from nodes.stt.parakeet import ParakeetSTT
    from nodes.stt.whisper_hf import WhisperHFSTT
    from nodes.tts.kokoro import KokoroTTS
    from nodes.tts.qwen3 import Qwen3TTS

    same = [
        (TransformersLLM(model="m"), TransformersLLM(model="m", system_prompt="Be brief.", temperature=0.1, seed=1,
                                                     max_tokens=8, prompt_cache=False)),
        (MLXLLM(model="m"), MLXLLM(model="m", top_p=0.5, enable_thinking=True)),
        (WhisperHFSTT(model="m"), WhisperHFSTT(model="m", language="auto", beam_size=4)),
        (ParakeetSTT(model="m", backend="mlx"), ParakeetSTT(model="m", backend="mlx")),
        (KokoroTTS(voice="af_heart"), KokoroTTS(voice="af_bella", speed=1.5, sample_rate=16000)),
        (Qwen3TTS(backend="cuda"), Qwen3TTS(backend="cuda", speaker="Aiden", chunk_frames=8)),
    ]
    for first, second in same:
        assert first.shared_key() == second.shared_key(), type(first)
    apart = [
        (TransformersLLM(model="m"), TransformersLLM(model="m", dtype="bfloat16")),
        (TransformersLLM(model="m"), TransformersLLM(model="m", device="cpu")),
        (TransformersLLM(model="m"), TransformersLLM(model="n")),
        (WhisperHFSTT(model="m"), WhisperHFSTT(model="m", dtype="float16")),
        (ParakeetSTT(model="m", backend="mlx"), ParakeetSTT(model="m", backend="mlx", dtype="bfloat16")),
        (KokoroTTS(), KokoroTTS(lang_code="b")),
        (Qwen3TTS(backend="cuda"), Qwen3TTS(backend="ggml")),
    ]
    for first, second in apart:
        assert first.shared_key() != second.shared_key(), type(first)


def test_two_servers_keep_the_same_models_and_each_lets_go_of_its_own():
    _fresh(Model)
    outer = keep_shared()
    outer.__enter__()
    with keep_shared():
        Model().setup()
    outer.__exit__(None, None, None)  # both held the same weights: each leaves with its own list
    gc.collect()
    Model().setup()
    assert Model.loads == 2


def test_a_server_keeps_what_was_loaded_before_it_started_too():
    _fresh(Model)
    early = Model()
    early.setup()  # another server (or a run) loaded it first
    with keep_shared() as held:
        Model().setup()
        assert any(w is early.weights for w in held)
        del early
        gc.collect()
        Model().setup()
        assert Model.loads == 1
