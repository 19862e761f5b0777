"""How well a run heard its user, scored against a corpus whose truth is known (bench=latency,
bench=hesitation): turns that ended before the user had finished, and the word error rate.

A false end is a confirmed turn that ends before its prompt's true end of speech: the VAD cut
the user off mid-utterance (a withdrawn speculation is not one: it was never a turn). The
run's metrics.json says when each turn's speech ended and when each conversation's audio
began, the corpus's prompts.json when each prompt really ended and what it said, and the
sink's transcript.jsonl what STT heard: the user's final transcripts of a conversation,
joined, against its prompt. A sweep adds these figures to the row of every job that played a
corpus (s2s_flow/sweep.py); for one run: ``python -m s2s_flow.accuracy RUN_DIR``.

    result = accuracy.score(metrics_json, prompts_json["files"], transcript_rows)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["normalise", "word_errors", "score", "score_run", "for_job", "FIGURES", "main"]

#: a turn whose speech ends this much before the prompt's true end was cut off. The VAD's end
#: is within a window (32 ms) of the truth, and playback starts a few ms after the session;
#: a cut at a hesitation leaves the pause and the rest of the sentence, 0.5 s and more.
MARGIN_S = 0.25

#: what a job's row gets: (key, meaning)
FIGURES: tuple[tuple[str, str], ...] = (
    ("prompts", "conversations scored against their prompt"),
    ("false_ends", "confirmed turns that ended before the user had finished"),
    ("hesitant_prompts", "prompts with a hesitation (a [N ms] pause in their text)"),
    ("false_ends_hesitant", "of the false ends, those in a hesitant prompt"),
    ("wer", "word error rate of the final user transcripts (fraction)"),
)

_DIRECTION = re.compile(r"\[[^\]]*\]")  # "[600 ms]": said to the voice, not spoken
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
            "nineteen", "twenty"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ["", "thousand", "million", "billion", "trillion"]
_GROUPED = re.compile(r"(?<=\d),(?=\d{3}\b)")  # "1,000,000": one number
_DECIMAL = re.compile(r"\b(\d+)\.(\d+)\b")  # "2.56": "two point five six", as a voice reads it
#: units as Whisper may write them ("26 km") for what a voice said in full
_UNITS = {"km": ["kilometers"], "kg": ["kilograms"], "cm": ["centimeters"], "mm": ["millimeters"],
          "mph": ["miles", "per", "hour"], "kmh": ["kilometers", "per", "hour"]}
_UNIT_AFTER_DIGIT = re.compile(rf"(?<=\d)(?=(?:{'|'.join(_UNITS)})\b)")


def _spoken(n: int) -> list[str]:
    """An integer as a voice says it: 42 -> forty two, 1000000000000 -> one trillion (from 10^15 on:
    the digits)."""
    if n < len(_NUMBERS):
        return [_NUMBERS[n]]
    if n < 100:
        return [_TENS[n // 10], *([_NUMBERS[n % 10]] if n % 10 else [])]
    if n < 1000:
        return [_NUMBERS[n // 100], "hundred", *(_spoken(n % 100) if n % 100 else [])]
    power = min((len(str(n)) - 1) // 3, len(_SCALES))
    if power == len(_SCALES):
        return [str(n)]
    head, rest = divmod(n, 1000 ** power)
    return [*_spoken(head), _SCALES[power], *(_spoken(rest) if rest else [])]


def normalise(text: str) -> list[str]:
    """Lower-case words without punctuation or stage directions; numbers spelled out as a voice says
    them ('10' = 'ten', '1,000,000' = 'one million', '2.56' = 'two point five six': a TTS reads
    digits as words, Whisper writes either); units in full ('26 km' = '26 kilometers', '5%' = '5 percent')."""
    text = _GROUPED.sub("", _DIRECTION.sub(" ", text))
    text = _DECIMAL.sub(lambda m: f"{m[1]} point {' '.join(m[2])}", text).lower().replace("-", " ")
    text = _UNIT_AFTER_DIGIT.sub(" ", text.replace("%", " percent").replace("km/h", "kmh"))  # "26km": "26 km"
    words = re.sub(r"[^a-z0-9' ]+", " ", text).split()
    return [s for w in words for s in (_spoken(int(w)) if w.isdigit() else _UNITS.get(w, [w.strip("'")]))]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference word count): Levenshtein over words."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1], len(ref)


def _prompt_file(conversation: str) -> str:
    return re.sub(r"_\d+$", "", conversation)  # the WAV source names repeats p, p_2, p_3


def score(metrics: Mapping[str, Any], prompts: Iterable[Mapping[str, Any]],
          transcripts: Iterable[Mapping[str, Any]] | None = None, *, realtime: bool = True) -> dict[str, Any]:
    """Figures and per-conversation detail of one run (metrics.json as a dict) against its corpus
    (prompts.json's ``files``) and, when there is one, the sink's transcript.jsonl rows.

    False ends need the audio played in real time (io.realtime=true, as bench=latency does):
    only then are turn times stream times; otherwise they are None.
    """
    truth = {Path(e["file"]).stem: e for e in prompts}
    turns = [t for t in metrics.get("turns", []) if t.get("reply", True)]  # a withdrawn speculation: no turn
    sessions = metrics.get("sessions", {})
    said: dict[tuple[str, int], str] = {}
    for row in transcripts or ():
        if row.get("user"):
            said[(row.get("conversation", ""), int(row.get("turn", 0)))] = row["user"]
    heard_any = bool(said)
    can_time = realtime and bool(sessions)

    detail: list[dict[str, Any]] = []
    for conversation in dict.fromkeys(t["conversation"] for t in metrics.get("turns", [])) | dict.fromkeys(sessions):
        prompt = truth.get(_prompt_file(conversation))
        if prompt is None:
            continue
        mine = sorted((t for t in turns if t["conversation"] == conversation), key=lambda t: t["turn"])
        cut = None
        if can_time and conversation in sessions:
            began = sessions[conversation]
            cut = [t["turn"] for t in mine if t.get("speech_end_s") is not None
                   and t["speech_end_s"] - began < prompt["speech_end_s"] - MARGIN_S]
        heard = " ".join(said[(conversation, t["turn"])] for t in mine if (conversation, t["turn"]) in said)
        errors, words = word_errors(prompt["text"], heard) if heard_any else (None, len(normalise(prompt["text"])))
        detail.append({"conversation": conversation, "prompt": prompt["text"],
                       "hesitant": bool(_DIRECTION.search(prompt["text"])), "turns": [t["turn"] for t in mine],
                       "cut_off_turns": cut, "heard": heard if heard_any else None, "word_errors": errors,
                       "words": words})

    timed = [d for d in detail if d["cut_off_turns"] is not None]
    hesitant = [d for d in detail if d["hesitant"]]
    errors = sum(d["word_errors"] for d in detail) if heard_any else None
    words = sum(d["words"] for d in detail)
    return {
        "prompts": len(detail),
        "false_ends": sum(len(d["cut_off_turns"]) for d in timed) if timed else None,
        "hesitant_prompts": len(hesitant),
        "false_ends_hesitant": sum(len(d["cut_off_turns"]) for d in timed if d["hesitant"]) if timed else None,
        "wer": errors / words if errors is not None and words else None,
        "margin_s": MARGIN_S,
        "conversations": detail,
    }


def score_run(run_dir: Path | str, corpus_dir: Path | str, *, transcript_dir: Path | str | None = None,
              realtime: bool = True) -> dict[str, Any]:
    """:func:`score` from the files of a run dir and of the corpus it played."""
    run_dir = Path(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    prompts = json.loads((Path(corpus_dir) / "prompts.json").read_text())["files"]
    path = Path(transcript_dir or run_dir) / "transcript.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else None
    return score(metrics, prompts, rows, realtime=realtime)


def for_job(config: Any, run_dir: Path | str) -> dict[str, Any] | None:
    """The score of a job whose WAV source played a corpus (``io.source.corpus``, set by
    bench=latency), written to ``accuracy.json`` in its run dir; None for any other job."""
    from omegaconf import OmegaConf

    from s2s_flow import corpus

    bench = OmegaConf.select(config, "io.source.corpus", default=None)
    run_dir = Path(run_dir)
    if bench is None or not (run_dir / "metrics.json").exists():
        return None
    directory = corpus.corpus_dir(corpus.check(bench, "io.source.corpus"))
    if not (directory / "prompts.json").exists():
        return None
    result = score_run(run_dir, directory, transcript_dir=OmegaConf.select(config, "io.sink.output_dir", default=None),
                       realtime=bool(OmegaConf.select(config, "io.realtime", default=False)))
    (run_dir / "accuracy.json").write_text(json.dumps({**result, "corpus": str(directory)}, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    """``python -m s2s_flow.accuracy RUN_DIR``: score a bench run (its config.yaml names the corpus)."""
    from omegaconf import OmegaConf

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "config.yaml").exists():
        print("usage: python -m s2s_flow.accuracy RUN_DIR   (the run dir of s2s-run ... bench=latency)",
              file=sys.stderr)
        sys.exit(2)
    result = for_job(OmegaConf.load(Path(args[0]) / "config.yaml"), args[0])
    if result is None:
        print(f"{args[0]}: no corpus was played (bench=latency) or the run has no metrics.json", file=sys.stderr)
        sys.exit(1)
    for key, meaning in FIGURES:
        print(f"{key:<20} {result[key]!s:>8}   {meaning}")
    for d in result["conversations"]:
        if d["cut_off_turns"]:
            print(f"cut off: {d['conversation']} (turns {d['turns']}): {d['prompt']}")


if __name__ == "__main__":
    main()
