"""Word error rate with a light normalisation (case, punctuation, small numbers)."""

from __future__ import annotations

import re

__all__ = ["normalize", "word_errors", "wer"]

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
            "nineteen", "twenty"]


def normalize(text: str) -> list[str]:
    """Lower-case words without punctuation; 0-20 spelled out so '10' and 'ten' agree."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    return [_NUMBERS[int(w)] if w.isdigit() and int(w) < len(_NUMBERS) else w.strip("'") for w in words]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference word count): Levenshtein over words."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1], len(ref)


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER: total word errors over total reference words."""
    errors = words = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        e, n = word_errors(ref, hyp)
        errors, words = errors + e, words + n
    return errors / max(words, 1)
