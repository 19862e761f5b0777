"""Barge-in end to end: a user talks over the agent's answer on a live audio path.

Real components throughout: a scripted user whose speech (Piper) comes in at real-time
pace, Silero VAD, Whisper tiny.en, SmolLM2 in llama-server, espeak-ng, and the speaker
sink playing into a PulseAudio null sink whose monitor is recorded. The user asks for a
long story, lets the agent speak for a second, then talks over it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from nodes._playback import playback_of
from tests.support.pulse import pulse_server, run_barge_in
from tests.support.wer import normalize

ROOM_SLACK_S = 0.04  # the cut's 5 ms fade, and a 10 ms recording block at each end of the span
STACK = ["tts=espeak", "stt=whisper", "llm=chat", "llm.max_tokens=400", "llm.temperature=0", "llm.seed=1"]


@pytest.fixture(scope="module")
def pulse() -> Iterator[object]:
    with pulse_server(("agent",)) as server:
        yield server


def test_talking_over_the_agent_silences_it_closes_the_llm_stream_and_keeps_what_was_heard(
        pulse, smollm2_server, tmp_path, capsys):
    run = run_barge_in(STACK, smollm2_server, tmp_path)

    cut = run.cut
    assert cut["turn"] == 2 and cut["reason"] == "barge-in"
    assert run.user.talk_over_t is not None and 0.2 < cut["t"] - run.user.talk_over_t < 1.5  # the VAD confirms
    spoke = [t for t in run.loud if t < cut["t"]]
    assert spoke and spoke[-1] - spoke[0] > 0.8  # the agent was talking when the user began
    # silent at once: the room heard no more of the reply than the speaker had handed to the device
    # when it was cut (the block in flight and the device's buffer are part of that) and a 5 ms fade;
    # measured in samples recorded (how soon, in ms: benchmarks/bench_live.py, target < 150 ms)
    playback = playback_of(run.sink.ctx)
    [played] = [c["played_s"] for c in playback.cuts if c["turn"] == 1]
    assert run.room.voiced_span(until=playback.started_at(2) or float("inf")) <= played + ROOM_SLACK_S
    assert run.server_idle_after_s is not None  # the LLM request was closed: the server stopped generating

    heard = playback.heard(1)
    rows = {r["turn"]: r for r in map(json.loads, (tmp_path / "transcript.jsonl").read_text().splitlines())}
    assert rows[1]["interrupted"] is True and rows[1]["heard"] == heard and heard
    said, kept = normalize(rows[1]["agent"]), normalize(heard)  # streamed by the cut / played
    assert kept == said[: len(kept)] and len(kept) < len(said)
    assert [turn for turn, _, _ in run.history] == [1, 2]
    assert run.history[0][2] == heard  # the next request carries only what the user heard

    out = capsys.readouterr().out
    assert "you" in out and "agent" in out and "(interrupted after" in out
