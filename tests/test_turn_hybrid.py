"""vad.turn=text|hybrid on real components: the LLM (SmolLM2 in llama-server) reads the speculative
transcript and posts the chance that the user is done; the VAD ends the turn after the short silence
only when the words (and, hybrid, the sound: Smart Turn v3.2) say finished, else after the long one.

Time in the VAD tests is the stream's own (samples fed), never the wall clock: the text signal is
made at the speculation (real Whisper, then the real llm=chat node) and is there for the VAD's next
window, which is the earliest it could be in a live run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from nodes._turn_text import cut_end_token, end_probability, normalise, turn_text_of
from nodes.vad.silero import SileroVAD
from s2s_flow.errors import ConfigError
from s2s_flow.messages import AudioChunk, Speech, Transcript
from s2s_flow.node import Context
from tests.support.fixtures import llama_server_binary, smollm2_gguf, smollm2_server  # noqa: F401
from tests.support.speech import synthesize

RATE = 16000
QUESTION = "What is the capital of Australia?"
# Smart Turn hears Piper's first half as a finished sentence (p 0.98): the words must hold the turn
FIRST_HALF, SECOND_HALF = "Set a timer for", "twenty minutes please."
EARLY = {"min_silence_ms": 200, "max_silence_ms": 1000, "speculate_ms": 64}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from nodes.stt.whisper import WhisperSTT

    node = WhisperSTT(window_s=10, beam_size=3)
    node.ctx = Context("stt", tmp_path_factory.mktemp("stt"))
    node.setup()
    yield node
    node.close()


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def _hesitant() -> tuple[np.ndarray, float]:
    """The request with a 600 ms pause after its unfinished clause; where the speech ends (s)."""
    first, second = synthesize(FIRST_HALF), synthesize(SECOND_HALF)
    pcm = np.concatenate([_silence(0.5), first, _silence(0.6), second])
    return np.concatenate([pcm, _silence(2.0)]), len(pcm) / RATE


def _run(pcm: np.ndarray, whisper, llm, **params) -> tuple[list[Speech], list[dict]]:
    """The VAD in stream time; each speculative utterance heard by Whisper and read by the LLM node
    (the engine's path: Transcript(speculative) -> llm=chat, which scores it before it replies)."""
    events: list[dict] = []
    shared: dict = {}
    record = lambda kind, **fields: events.append({"kind": kind, **fields})  # noqa: E731
    vad = SileroVAD(**params)
    vad.ctx = Context("vad", Path("."), record=record, run_state=shared)
    vad.setup()
    if llm is not None:
        llm.ctx = Context("llm", Path("."), record=record, run_state=shared)
        llm.setup()
    turns = []
    for i in range(0, len(pcm), 320):
        chunk = AudioChunk(pcm=pcm[i : i + 320], rate=RATE, start=i / RATE, t=1000.0 + (i + 320) / RATE)
        for m in vad.process("audio", chunk):
            if not isinstance(m, Speech):
                continue
            if not m.speculative:
                turns.append(m)
            elif llm is not None:
                for heard in whisper.process("audio", m):
                    list(llm.process("text", heard))
                    llm.scored()  # there for the VAD's next window: the soonest it could be live
    return turns + [m for m in vad.finish() or [] if isinstance(m, Speech)], events


def _llm(server: str):
    from nodes.llm.chat import ChatCompletionsLLM

    return ChatCompletionsLLM(base_url=server + "/v1", max_tokens=1, temperature=0.0)


def test_the_words_are_read_as_livekit_reads_them():
    assert normalise("Set a timer for... twenty, please!") == "set a timer for twenty please"
    assert normalise("What's the time?") == "what's the time"
    prompt = "<|im_start|>user\nset a timer for<|im_end|>\n<|im_start|>assistant\n"
    assert cut_end_token(prompt, "set a timer for") == ("<|im_start|>user\nset a timer for", "<|im_end|>")
    assert cut_end_token("[INST] hello [/INST]", "hello") == ("[INST] hello", "[/INST]")
    assert cut_end_token("user: hello\nassistant:", "hello") is None  # no end token to read
    top = {" ": 0.5, "?": 0.3, "<|im_end|>": 0.01, ".": 0.1, " music": 0.05}
    assert end_probability(top, "<|im_end|>") == pytest.approx(0.41)


def test_the_llm_scores_a_speculative_transcript_before_it_replies(smollm2_server, tmp_path):  # noqa: F811
    events: list[dict] = []
    llm = _llm(smollm2_server)
    llm.ctx = Context("llm", tmp_path, record=lambda kind, **f: events.append({"kind": kind, **f}))
    llm.setup()
    board = turn_text_of(llm.ctx)
    board.wanted = True
    for turn, text in enumerate([FIRST_HALF, QUESTION, "Please play some"], 1):
        list(llm.process("text", Transcript(turn=turn, text=text, speculative=True)))
        llm.scored()
    list(llm.process("text", Transcript(turn=4, text="Thanks.")))  # a confirmed transcript: no score
    llm.close()
    scores = [board.get(t) for t in (1, 2, 3, 4)]
    assert scores[3] is None
    threshold = SileroVAD().text_threshold
    assert scores[1] >= threshold > max(scores[0], scores[2])  # the question reads finished, the clauses not
    assert [e["turn"] for e in events if e["kind"] == "turn_text"] == [1, 2, 3]


def test_a_continuation_after_an_early_pause_is_never_cut_off_with_hybrid(
        smart_turn_wheel, whisper, smollm2_server):  # noqa: F811
    pcm, speech_end = _hesitant()
    heard, _ = _run(pcm, whisper, None, turn="smart_turn", **{k: v for k, v in EARLY.items() if k != "speculate_ms"})
    assert len(heard) == 2  # the sound alone takes the pause for the end

    turns, events = _run(pcm, whisper, _llm(smollm2_server), turn="hybrid", **EARLY)
    [speech] = turns
    assert speech.end >= speech_end - 0.1  # one turn, to the end of the request
    [score] = [e for e in events if e["kind"] == "turn_text"][:1]
    assert score["probability"] < SileroVAD().text_threshold  # "set a timer for" does not read as finished
    # no turn ended at the early pause; the whole request may end after the short silence (both signals
    # finished: SmolLM2 read it so on AMD EPYC family 25 model 1, p 0.57) or after the long one (elsewhere)
    assert not [e for e in events if e["kind"] == "turn_end" and e["turn"] == score["turn"]], events


def test_a_finished_question_ends_after_the_short_silence_with_hybrid(smart_turn_wheel, whisper, smollm2_server):  # noqa: F811
    speech = synthesize(QUESTION)
    pcm = np.concatenate([_silence(0.5), speech, _silence(2.0)])
    [turn], events = _run(pcm, whisper, _llm(smollm2_server), turn="hybrid", **EARLY)
    [end] = [e for e in events if e["kind"] == "turn_end"]
    assert end["by"] == "hybrid" and end["probability"] >= 0.5 and end["text_probability"] >= SileroVAD().text_threshold
    assert end["silence_ms"] < 500  # sooner than the fixed 500 ms


def test_tiered_hybrid_ends_the_turn_at_the_middle_silence_when_one_signal_says_finished(
        smart_turn_wheel, whisper, smollm2_server):  # noqa: F811
    """vad.one_silence_ms: the sound hears "Set a timer for" as finished, the words do not; plain hybrid
    waits (the test above), tiered ends the turn once the pause has lasted one_silence_ms: the price of
    its lower p95 (bench_turn.py counts it)."""
    pcm, _ = _hesitant()  # a 600 ms pause
    turns, events = _run(pcm, whisper, _llm(smollm2_server), turn="hybrid", one_silence_ms=400, **EARLY)
    first = [e for e in events if e["kind"] == "turn_end"][0]
    assert first["by"] == "hybrid_one" and 400 <= first["silence_ms"] < 600
    assert first["probability"] >= 0.5 and first["text_probability"] < SileroVAD().text_threshold
    assert len(turns) == 2


def test_without_a_scorer_text_waits_for_the_long_silence(whisper):
    """No LLM gives scores (llm=responses, a server without the endpoints): vad.turn=text cannot read
    the words, so the turn ends only after max_silence_ms, never early."""
    speech = synthesize(QUESTION)
    pcm = np.concatenate([_silence(0.5), speech, _silence(2.0)])
    [turn], events = _run(pcm, whisper, None, turn="text", **EARLY)
    assert [e["by"] for e in events if e["kind"] == "turn_end"] == ["max_silence"]


@pytest.mark.parametrize(("params", "option"), [
    ({"turn": "hybrid", "min_silence_ms": 200, "max_silence_ms": 1000}, "vad.speculate_ms"),
    ({"turn": "text", "min_silence_ms": 200, "max_silence_ms": 1000, "speculate_ms": 64, "text_threshold": 1.5},
     "vad.text_threshold"),
    ({"turn": "hybrid", "min_silence_ms": 200, "max_silence_ms": 150, "speculate_ms": 64}, "vad.max_silence_ms"),
    ({"turn": "smart_turn", "min_silence_ms": 200, "max_silence_ms": 1000, "one_silence_ms": 400},
     "vad.one_silence_ms"),
    ({"turn": "hybrid", "min_silence_ms": 200, "max_silence_ms": 1000, "speculate_ms": 64, "one_silence_ms": 1000},
     "vad.one_silence_ms"),
])
def test_bad_text_turn_settings_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        SileroVAD(**params)


def test_hybrid_in_the_engine_ends_a_question_early_and_keeps_a_hesitant_request_whole(
        tmp_path, smart_turn_wheel, smollm2_server):  # noqa: F811
    """Real time, the whole stack (recipe=local_cpu's stages on a test llama-server): the LLM scores
    the speculative transcripts, the request with a 600 ms pause after "Set a timer for" is one turn.
    Whether the question's turn ends early depends on how soon its score comes on this machine (on a
    busy one after the long silence: the VAD never ends a turn on words it has not read yet)."""
    question = synthesize(QUESTION)
    request, _ = _hesitant()
    wav = tmp_path / "two.wav"
    sf.write(wav, np.concatenate([_silence(0.5), question, _silence(3.0), request]), RATE, subtype="PCM_16")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "s2s_flow.cli", "recipe=local_cpu", "server=null", f"llm.base_url={smollm2_server}/v1",
         "llm.max_tokens=16", "llm.temperature=0", "tts=espeak", f"io.input={wav}", "io.realtime=true",
         "vad.turn=hybrid", "vad.min_silence_ms=200", "vad.max_silence_ms=1000", f"hydra.run.dir={run}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "S2S_LOG_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads((run / "trace.json").read_text())
    ends = [e for e in trace["events"] if e["kind"] == "turn_end"]
    assert len(ends) == 2 and {e["by"] for e in ends} <= {"hybrid", "max_silence"}
    scored = [e for e in trace["events"] if e["kind"] == "turn_text"]
    assert scored and scored[0]["turn"] == ends[0]["turn"]  # the question's words were read
    rows = [json.loads(line) for line in (run / "transcript.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert "australia" in rows[0]["user"].lower()
    assert "timer" in rows[1]["user"].lower() and "minutes" in rows[1]["user"].lower()
