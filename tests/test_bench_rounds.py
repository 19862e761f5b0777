"""bench_realtime.py --conversations takes each N's rounds spread over the run
(benchmarks/_conversations.py: planned_rounds), so a host that runs slower in one hour than in
another slows every N alike: one N after the other, their ratio would be as much the host's drift as
the load's."""

from __future__ import annotations

from statistics import mean

from benchmarks._conversations import planned_rounds


def test_each_n_gets_its_turns_and_its_rounds_are_centred_on_the_run() -> None:
    plan = planned_rounds([1, 4, 8], turns=8, min_turns=32)
    assert plan == [(1, 0), (1, 1), (4, 0), (8, 0), (1, 2), (1, 3)]
    for turns, min_turns, ns in ((8, 32, [1, 4, 8]), (4, 32, [1, 2, 4]), (3, 20, [1, 3, 7])):
        plan = planned_rounds(ns, turns=turns, min_turns=min_turns)
        for n in ns:
            at = [i for i, (m, _) in enumerate(plan) if m == n]
            assert [k for m, k in plan if m == n] == list(range(len(at)))  # each N's rounds in their order
            assert len(at) * n * turns >= min_turns  # enough turns when every turn is answered
            assert (len(at) - 1) * n * turns < min_turns  # and no round more
            assert abs(mean(at) - (len(plan) - 1) / 2) <= 1, (n, plan)  # around the run's middle


def test_without_a_minimum_each_n_runs_once_in_order() -> None:
    assert planned_rounds([1, 4, 8], turns=8, min_turns=0) == [(1, 0), (4, 0), (8, 0)]
