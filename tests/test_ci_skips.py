"""The CI guard (tests/support/ci_skips.py): in CI a skip fails the run unless it names a backend
that CI cannot install. Each case runs a small test file in its own pytest session."""

from __future__ import annotations

import pytest

GUARD = ("-p", "tests.support.ci_skips", "-p", "no:hypothesispytest")  # hypothesis: 2 s a session, unused


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, *, ci: bool = True):
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_sample=source)
    return pytester.runpytest(*GUARD)


def test_a_module_level_importorskip_fails_the_run_in_ci(pytester, monkeypatch):
    result = run(pytester, monkeypatch, """
        import pytest
        pytest.importorskip("s2s_flow_no_such_module", reason="pip install s2s-flow-no-such-module")

        def test_never_collected():
            pass
    """)
    assert result.ret != 0
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*skipped in CI, where everything should be installed*s2s-flow-no-such-module*"])


def test_a_skip_inside_a_test_fails_it_in_ci(pytester, monkeypatch):
    result = run(pytester, monkeypatch, """
        import pytest

        def test_needs_a_server():
            pytest.skip("no llama-server: run `s2s-build-llama-server`")
    """)
    result.assert_outcomes(failed=1)


def test_skips_naming_an_allowed_backend_stay_skips_in_ci(pytester, monkeypatch):
    result = run(pytester, monkeypatch, """
        import pytest

        @pytest.mark.parametrize("reason", [
            "needs the kokoro extra", "needs the qwen3-tts extra", "pip install 's2s-flow[kokoro]'",
            "could not import 'nemo.collections.asr': No module named 'nemo'", "NeMo is installed",
        ])
        def test_allowed(reason):
            pytest.skip(reason)
    """)
    result.assert_outcomes(skipped=5)


def test_a_module_skipped_for_an_allowed_backend_stays_skipped_in_ci(pytester, monkeypatch):
    result = run(pytester, monkeypatch, """
        import pytest
        pytest.importorskip("s2s_flow_no_such_module", reason="needs the kokoro extra")
    """)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.assert_outcomes(skipped=1)


@pytest.mark.parametrize("reason", ["No module named 'nemotron_asr'", "pip install kokoro-onnx",
                                    "the model hub is reachable from this machine", "needs qwen2-audio"])
def test_an_allowed_name_inside_another_word_is_not_allowed(pytester, monkeypatch, reason):
    result = run(pytester, monkeypatch, f"""
        import pytest

        def test_sample():
            pytest.skip({reason!r})
    """)
    result.assert_outcomes(failed=1)


def test_outside_ci_skips_are_skips(pytester, monkeypatch):
    result = run(pytester, monkeypatch, """
        import pytest

        def test_needs_a_server():
            pytest.skip("no llama-server")
    """, ci=False)
    result.assert_outcomes(skipped=1)
    pytester.makepyfile(test_sample="""
        import pytest
        pytest.importorskip("s2s_flow_no_such_module")
    """)
    assert pytester.runpytest(*GUARD).ret == pytest.ExitCode.NO_TESTS_COLLECTED
