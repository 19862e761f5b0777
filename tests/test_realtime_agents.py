"""io=realtime with the Agents SDK (``@openai/agents``, pinned in tests/node/package-lock.json):
Node's test runner runs tests/node/*.test.mjs against a live server on the real offline stack
(a RealtimeSession over the SDK's WebSocket transport: a text turn, a voice turn interrupted
mid-reply, with no session error). ``scripts/bootstrap.sh`` installs the SDK (``npm ci``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_realtime import llama, serving, spoken  # noqa: F401  (the module's llama-server fixture)

NODE_TESTS = Path(__file__).with_name("node")


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("no Node.js: apt-get install nodejs npm")
    if not (NODE_TESTS / "node_modules" / "@openai" / "agents").is_dir():
        pytest.skip("the Agents SDK is not installed: npm ci --prefix tests/node (scripts/bootstrap.sh does it)")
    return node


def test_the_agents_sdk_talks_and_interrupts_without_a_session_error(llama, tmp_path):  # noqa: F811
    node = _node()
    speech = tmp_path / "question.pcm"
    speech.write_bytes(spoken("Tell me a long story about a dragon who learns to cook."))
    with serving(llama, tmp_path, "llm.max_tokens=120") as (url, _):
        env = {**os.environ, "S2S_REALTIME_URL": f"{url}/realtime", "S2S_SPEECH_PCM": str(speech)}
        files = sorted(str(p) for p in NODE_TESTS.glob("*.test.mjs"))
        out = subprocess.run([node, "--test", "--test-reporter=spec", *files], cwd=NODE_TESTS, env=env,
                             capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout or "ℹ fail 0" in out.stdout, out.stdout[-3000:]
    assert "skipped 0" in out.stdout.replace("skip 0", "skipped 0"), out.stdout[-3000:]
