"""Word error rate for the tests: the engine's own scoring (s2s_flow/accuracy.py: case,
punctuation and small numbers normalised away) over a list of utterances."""

from __future__ import annotations

from s2s_flow.accuracy import normalise as normalize
from s2s_flow.accuracy import word_errors

__all__ = ["normalize", "word_errors", "wer"]


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER: total word errors over total reference words."""
    errors = words = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        e, n = word_errors(ref, hyp)
        errors, words = errors + e, words + n
    return errors / max(words, 1)
