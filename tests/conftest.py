"""Shared fixtures: real servers and models built locally (see tests/support/).

Tests skip with the install command when a component is missing on a developer's
machine. In CI (CI=true) everything is installed by scripts/bootstrap.sh, so a skip
there means a broken install and fails the run -- except for the hub-only backends whose
libraries cannot be installed on this kind of machine (tests/support/ci_skips.py).
"""

from __future__ import annotations

from hypothesis import settings

pytest_plugins = ["tests.support.fixtures", "tests.support.ci_skips", "pytester"]

# Hypothesis: no per-example deadline (on 2 shared cores a slow example is scheduling noise,
# not a failure of the property), and in CI the same examples on every run (derandomized,
# no example database), so a CI result never depends on the run or on what a machine kept.
settings.register_profile("s2s", deadline=None)
settings.register_profile("ci", parent=settings.get_profile("s2s"), derandomize=True, database=None)


def pytest_configure(config) -> None:
    from tests.support.ci_skips import in_ci  # a plugin by now (pytest_plugins), so imported once

    settings.load_profile("ci" if in_ci() else "s2s")
