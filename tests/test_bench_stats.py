"""The benchmarks' statistics (benchmarks/_stats.py): a p95 and how far it may move between runs."""

from __future__ import annotations

import math

import numpy as np

from benchmarks._stats import percentile, percentile_interval


def test_a_p95s_interval_holds_it_narrows_with_more_turns_and_is_the_same_every_time():
    rng = np.random.default_rng(7)
    few = list(900 + rng.gamma(2.0, 120.0, 64))  # a run's turns: a long right tail, as voice-to-voice has
    many = list(900 + rng.gamma(2.0, 120.0, 640))
    lo, hi = percentile_interval(few, 95)
    assert lo <= percentile(few, 95) <= hi
    assert percentile_interval(few, 95) == (lo, hi)  # a fixed seed: the same report from the same turns
    lo_many, hi_many = percentile_interval(many, 95)
    assert hi_many - lo_many < (hi - lo) / 2
    assert all(math.isnan(v) for v in percentile_interval([], 95))
