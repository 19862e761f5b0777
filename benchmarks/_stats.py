"""The one percentile the benchmark scripts report, so that every p50/p95 they print means the
same thing. Latency is reported as p50/p95 over many turns and runs, never as a single run: one
turn's voice-to-voice moves by tens of milliseconds from run to run.

    from benchmarks._stats import percentile
    percentile([120.0, 95.0, 180.0], 95)   # 174.0

A p95 of a few dozen turns rests on its few slowest ones, so two runs of the same code can differ
by hundreds of milliseconds: ``percentile_interval`` says how far (a bootstrap over the turns), and
``ratio_interval`` how far the ratio of two such percentiles (4 conversations' p95 against one's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = ["percentile", "percentile_interval", "ratio_interval"]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the closest
    ranks (numpy's default, ``statistics.quantiles(method="inclusive")``); NaN for no values."""
    a = np.fromiter(values, dtype=float)
    return float(np.percentile(a, q)) if a.size else math.nan


def percentile_interval(values: Iterable[float], q: float, level: float = 0.9, draws: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """Where the ``q``-th percentile of ``values`` lies with probability ``level``, from the turns
    themselves: the percentile of ``draws`` resamples (with replacement, a fixed seed), their central
    ``level`` share. Turns of one moment of contention move together, so the true spread is, if
    anything, wider. (NaN, NaN) for no values."""
    a = np.fromiter(values, dtype=float)
    if not a.size:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    stats = np.percentile(a[rng.integers(0, a.size, size=(draws, a.size))], q, axis=1)
    lo, hi = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def ratio_interval(values: Iterable[float], base: Iterable[float], q: float, level: float = 0.9,
                   draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Where the ratio of the ``q``-th percentiles of ``values`` and of ``base`` lies with probability
    ``level``: both resampled on their own (as :func:`percentile_interval`), the ratio of each draw's
    pair. (NaN, NaN) if either has no values."""
    a, b = np.fromiter(values, dtype=float), np.fromiter(base, dtype=float)
    if not a.size or not b.size:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    top = np.percentile(a[rng.integers(0, a.size, size=(draws, a.size))], q, axis=1)
    bottom = np.percentile(b[rng.integers(0, b.size, size=(draws, b.size))], q, axis=1)
    lo, hi = np.percentile(top / bottom, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)
