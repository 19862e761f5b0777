"""The benchmarks' statistics (benchmarks/_stats.py): a p95 and how far it may move between runs."""

from __future__ import annotations

import math

import numpy as np

from benchmarks._stats import percentile, percentile_interval, ratio_interval


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


def test_a_ratio_of_two_p95s_has_an_interval_that_holds_it_and_narrows_with_more_turns():
    rng = np.random.default_rng(11)
    def turns(n: int, scale: float) -> list[float]:  # voice-to-voice: a floor and a long right tail
        return list(scale * (700 + rng.gamma(2.0, 100.0, n)))
    few = ratio_interval(turns(32, 1.25), turns(32, 1.0), 95)
    many = ratio_interval(turns(640, 1.25), turns(640, 1.0), 95)
    assert few[0] < 1.25 < few[1] and many[0] < 1.25 < many[1], (few, many)
    assert many[1] - many[0] < (few[1] - few[0]) / 2
    assert ratio_interval([1200.0] * 8, [1000.0] * 8, 95) == (1.2, 1.2)  # no spread, no doubt
    assert all(math.isnan(v) for v in ratio_interval([], [1000.0], 95))
