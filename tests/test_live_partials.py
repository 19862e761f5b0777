"""Live partial transcripts on real speech: Silero VAD cuts, Whisper tiny.en re-transcribes the
growing utterance while it is spoken; the console shows them live and replaces them."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from nodes.io._console import ConsoleView
from nodes.stt.partials import PartialTranscriber
from s2s_flow.messages import AudioChunk, Speech, SpeechStarted, Transcript
from s2s_flow.node import Context
from tests.support.loads import count_loads, fresh_models
from tests.support.speech import speech_with_pauses
from tests.support.wer import word_errors

TEXT = "Please tell me a short story about a cat who lives in a lighthouse by the sea."
WHISPER = {"_target_": "nodes.stt.whisper.WhisperSTT", "model": "tiny.en", "language": "en"}


def test_partials_grow_with_the_utterance_while_it_is_spoken_and_stop_at_its_end(tmp_path):
    pytest.importorskip("faster_whisper", reason="needs the whisper extra: pip install 's2s-flow[whisper]'")
    from nodes.vad.silero import SileroVAD

    partials = PartialTranscriber(stt=WHISPER, interval_ms=300)
    partials.ctx = Context("partials", tmp_path)
    partials.setup()
    vad = SileroVAD()
    vad.ctx = Context("vad", tmp_path)
    vad.setup()
    pcm, [(start, end)] = speech_with_pauses([TEXT], 16000, lead_s=0.5, tail_s=1.0)

    got: list[tuple[float, Transcript]] = []
    ended_at = None
    t0 = time.monotonic()
    for i in range(0, len(pcm), 320):  # a live microphone: one 20 ms chunk every 20 ms
        time.sleep(max(0.0, t0 + (i + 320) / 16000 - time.monotonic()))
        chunk = AudioChunk(pcm=pcm[i : i + 320], rate=16000, start=i / 16000)
        msgs = [chunk, *vad.process("audio", chunk)]
        for msg in msgs:
            port = {AudioChunk: "audio", SpeechStarted: "started", Speech: "speech"}[type(msg)]
            got += [(time.monotonic() - t0, m) for m in partials.process(port, msg)]
            if isinstance(msg, Speech):
                ended_at = time.monotonic() - t0
    partials.close()

    assert ended_at is not None
    assert len(got) >= 3, got
    assert all(not m.final and m.turn == 1 and m.language == "en" for _, m in got)
    assert all(start < t < ended_at for t, _ in got)  # while the user speaks, never after
    counts = [len(m.text.split()) for _, m in got]
    assert counts[-1] > counts[0] and counts[-1] >= 0.6 * len(TEXT.split())
    assert np.all(np.diff([t for t, _ in got]) >= 0.3)  # the interval counts from the end of the last one
    errors, n = word_errors(TEXT, got[-1][1].text)
    assert errors <= 0.6 * n  # the last partial is most of the sentence (its end not yet spoken)


def test_partials_are_idle_when_switched_off_and_load_no_model(tmp_path, monkeypatch):
    faster_whisper = pytest.importorskip("faster_whisper", reason="needs the whisper extra: "
                                                          "pip install 's2s-flow[whisper]'")
    fresh_models(monkeypatch)  # a model an earlier test still holds would hide a load
    loads = count_loads(faster_whisper, "WhisperModel", monkeypatch)
    node = PartialTranscriber(stt=WHISPER, interval_ms=0)
    node.ctx = Context("partials", tmp_path)
    node.setup()
    assert loads == []
    assert list(node.process("started", SpeechStarted(turn=1))) == []
    assert list(node.process("audio", AudioChunk(pcm=np.ones(320, np.float32), rate=16000))) == []
    on = PartialTranscriber(stt=WHISPER, interval_ms=300)  # the count sees a load when there is one
    on.ctx = Context("partials", tmp_path)
    on.setup()
    on.close()
    assert len(loads) == 1


def test_the_console_shows_the_partial_live_then_the_final_line_in_its_place():
    out = io.StringIO()
    from rich.console import Console

    view = ConsoleView(Console(file=out, force_terminal=True, width=100, color_system=None))
    view.partial("please tell me")
    view.partial("please tell me a story")
    view.user("Please tell me a story.")
    view.agent(1, "Once upon a time.")
    view.agent(1, "There was a cat.")
    view.interrupted("Once upon a time. There")
    view.close()
    text = out.getvalue()
    assert "please tell me a story ..." in text  # drawn live
    final = text[text.rindex("Please tell me a story.") - 5:]
    assert final.startswith("you  Please tell me a story.")
    assert "agent Once upon a time." in final and "      There was a cat." in final
    assert '(interrupted after "...upon a time. There")' in final
