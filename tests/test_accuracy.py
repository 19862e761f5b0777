"""A run scored against the corpus it played: turns cut off before the user had finished
(false ends) and the WER of the final transcripts, from metrics.json, prompts.json and
transcript.jsonl as the engine writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from s2s_flow import accuracy

PROMPTS = [
    {"file": "01-what-time-is-it.wav", "text": "What time is it?", "speech_start_s": 0.5, "speech_end_s": 1.5},
    {"file": "02-set-a-timer-for.wav", "text": "Set a timer for, [600 ms] twenty minutes please.",
     "speech_start_s": 0.5, "speech_end_s": 3.0},
]


def turn(n: int, conversation: str, speech_end_s: float, **kw) -> dict:
    return {"turn": n, "conversation": conversation, "speech_end_s": speech_end_s, "reply": True, **kw}


def run_metrics(*turns: dict, sessions: dict | None = None) -> dict:
    return {"turns": list(turns),
            "sessions": sessions if sessions is not None else {"01-what-time-is-it": 10.0,
                                                                "02-set-a-timer-for": 20.0}}


def test_words_are_compared_without_case_punctuation_or_the_voices_stage_directions():
    assert accuracy.normalise("Set a timer for, [600 ms] twenty minutes please.") == \
        ["set", "a", "timer", "for", "twenty", "minutes", "please"]
    assert accuracy.word_errors("Set a timer for, [600 ms] 20 minutes please.",
                                "set a timer for twenty minutes, please") == (0, 7)
    assert accuracy.word_errors("What's the time?", "what is the time") == (2, 3)  # one sub, one insertion


def test_numbers_are_compared_as_a_voice_says_them():
    # an LLM writes digits, the TTS reads them as words and Whisper writes either (a WebRTC test's
    # reply "1000000000000." was heard as "one trillion")
    assert accuracy.word_errors("1000000000000.", "one trillion") == (0, 2)
    assert accuracy.word_errors("It is 42,195 meters.", "It is forty-two thousand one hundred ninety-five meters") \
        == (0, 10)
    assert accuracy.normalise("1,000,000 and 3,5") == ["one", "million", "and", "three", "five"]
    assert accuracy.normalise("10" + "0" * 15) == ["1" + "0" * 16]  # beyond trillions: the digits
    # a decimal is read digit by digit after its point (a talk test's reply "There are 2.5607374
    # kilometers in a mile." was heard as "two point five six zero seven three seven four")
    assert accuracy.word_errors("There are 2.5607374 kilometers.",
                                "There are two point five six zero seven three seven four kilometers") == (0, 12)
    assert accuracy.normalise("It is 3.5.") == ["it", "is", "three", "point", "five"]
    # units as Whisper writes them (a G.711 read-back of "26.112 kilometers" was "26.11 km")
    assert accuracy.word_errors("A marathon is 26 kilometers.", "A marathon is 26 km.") == (0, 6)
    assert accuracy.normalise("5% at 90km/h") == ["five", "percent", "at", "ninety", "kilometers", "per", "hour"]
    assert accuracy.normalise("the 1st km") == ["the", "1st", "kilometers"]  # an ordinal stays one word


def test_a_turn_that_ends_at_the_hesitation_is_a_false_end():
    metrics = run_metrics(
        turn(1, "01-what-time-is-it", 11.52),  # ended where the prompt did (+ the VAD's estimate)
        turn(2, "02-set-a-timer-for", 21.1),   # ended at the pause, 1.9 s before the true end: cut off
        turn(3, "02-set-a-timer-for", 23.0),   # the rest of the sentence
    )
    result = accuracy.score(metrics, PROMPTS)
    assert result["prompts"] == 2 and result["hesitant_prompts"] == 1
    assert result["false_ends"] == 1 and result["false_ends_hesitant"] == 1
    cut = {d["conversation"]: d["cut_off_turns"] for d in result["conversations"]}
    assert cut == {"01-what-time-is-it": [], "02-set-a-timer-for": [2]}
    assert result["wer"] is None  # no transcript: nothing to score words against


def test_a_withdrawn_speculation_is_not_a_false_end_and_its_words_are_not_counted():
    metrics = run_metrics(
        turn(1, "01-what-time-is-it", 11.5),
        turn(2, "02-set-a-timer-for", 21.1, reply=False, speculation="wasted"),  # the user went on
        turn(3, "02-set-a-timer-for", 23.0, speculation="confirmed"),
    )
    transcripts = [
        {"conversation": "01-what-time-is-it", "turn": 1, "user": "What time is it?"},
        {"conversation": "02-set-a-timer-for", "turn": 2, "user": "Set a timer for."},
        {"conversation": "02-set-a-timer-for", "turn": 3, "user": "Set a timer for 20 minutes please."},
    ]
    result = accuracy.score(metrics, PROMPTS, transcripts)
    assert result["false_ends"] == 0 and result["wer"] == 0.0


def test_wer_joins_the_turns_of_a_cut_utterance_and_counts_repeats_as_their_own_conversations():
    metrics = run_metrics(
        turn(1, "01-what-time-is-it", 11.5),
        turn(2, "02-set-a-timer-for", 21.1),
        turn(3, "02-set-a-timer-for", 23.0),
        turn(4, "01-what-time-is-it_2", 31.5),
        sessions={"01-what-time-is-it": 10.0, "02-set-a-timer-for": 20.0, "01-what-time-is-it_2": 30.0},
    )
    transcripts = [
        {"conversation": "01-what-time-is-it", "turn": 1, "user": "What time is it?"},
        {"conversation": "02-set-a-timer-for", "turn": 2, "user": "Set a timer for."},
        {"conversation": "02-set-a-timer-for", "turn": 3, "user": "Twenty minutes, please."},
        {"conversation": "01-what-time-is-it_2", "turn": 4, "user": "What time is this?"},
    ]
    result = accuracy.score(metrics, PROMPTS, transcripts)
    assert result["prompts"] == 3 and result["false_ends"] == 1
    assert result["wer"] == pytest.approx(1 / 15)  # one substitution in 4 + 7 + 4 words


def test_a_prompt_the_vad_never_heard_is_all_deletions():
    metrics = run_metrics(turn(1, "01-what-time-is-it", 11.5))  # the second conversation made no turn
    transcripts = [{"conversation": "01-what-time-is-it", "turn": 1, "user": "What time is it?"}]
    result = accuracy.score(metrics, PROMPTS, transcripts)
    assert result["prompts"] == 2 and result["wer"] == pytest.approx(7 / 11)


def test_false_ends_need_real_time_playback():
    metrics = run_metrics(turn(1, "02-set-a-timer-for", 20.1))
    assert accuracy.score(metrics, PROMPTS, realtime=False)["false_ends"] is None
    assert accuracy.score({"turns": metrics["turns"]}, PROMPTS)["false_ends"] is None  # no session times


def test_a_job_that_played_a_corpus_is_scored_from_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from s2s_flow import corpus

    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "cache"))
    bench = {"prompts": [p["text"] for p in PROMPTS], "repeat": 1, "lead_silence_s": 0.5, "tail_silence_s": 0.5,
             "voice": {"_target_": "nodes.tts.piper.PiperTTS", "noise_scale": 0, "noise_w_scale": 0}}
    config = OmegaConf.create({"bench": bench, "io": {"realtime": True, "output_dir": None,
                                                      "source": {"corpus": "${bench}"},
                                                      "sink": {"output_dir": "${..output_dir}"}}})
    run = tmp_path / "run"
    run.mkdir()
    assert accuracy.for_job(config, run) is None  # no metrics.json: nothing ran
    directory = corpus.corpus_dir(corpus.check(bench))
    directory.mkdir(parents=True)
    (directory / "prompts.json").write_text(json.dumps({"files": PROMPTS}))
    (run / "metrics.json").write_text(json.dumps(run_metrics(turn(1, "01-what-time-is-it", 11.5),
                                                             turn(2, "02-set-a-timer-for", 21.0))))
    (run / "transcript.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"conversation": "01-what-time-is-it", "turn": 1, "user": "What time is it?"},
        {"conversation": "02-set-a-timer-for", "turn": 2, "user": "Set a timer for"}]))
    result = accuracy.for_job(config, run)
    assert result["false_ends"] == 1 and result["wer"] == pytest.approx(3 / 11)
    assert json.loads((run / "accuracy.json").read_text())["corpus"] == str(directory)
    assert accuracy.for_job(OmegaConf.create({"io": {"source": {"input": "a.wav"}}}), run) is None
