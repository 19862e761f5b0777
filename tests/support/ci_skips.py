"""In CI (CI set), a skip is a failure unless its reason names a backend CI cannot install.

scripts/bootstrap.sh installs everything else, so a skip there means a broken install. A skip
can come from a test (pytest.skip, a fixture, a skipif mark) or from collecting a module
(pytest.importorskip at module scope): the first ends in a test report, the second only in a
collection report, so both are checked. Loaded by tests/conftest.py; usable alone as
``pytest -p tests.support.ci_skips``.
"""

from __future__ import annotations

import os
import re

import pytest

__all__ = ["ALLOWED", "allowed", "in_ci", "skip_reason"]

# Backends whose libraries bootstrap does not install (hub-only, no CPU wheel, or ~100 extra
# packages). Matched as whole names in the
# reason ("nemo" allows "No module named 'nemo'", not "nemotron"), case-insensitively.
ALLOWED = ("kokoro", "qwen3-tts", "nemo", "mlx_audio", "mlx-audio")

_NAME = re.compile(r"[a-z0-9_]+(?:[.-][a-z0-9_]+)*")  # a word, a package or a dotted module name


def _names(text: str) -> list[str]:
    return _NAME.findall(text.lower())


def allowed(reason: str) -> bool:
    """Whether ``reason`` names an allowed backend (or phrase) as whole words."""
    words = _names(reason)
    for entry in ALLOWED:
        want = _names(entry)
        if any(words[i : i + len(want)] == want for i in range(len(words) - len(want) + 1)):
            return True
    return False


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[-1] if isinstance(longrepr, tuple) else longrepr)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _fail_unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not allowed(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where everything should be installed: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())
