"""io=realtime with the Agents SDK (``@openai/agents``, pinned in tests/node/package-lock.json):
Node's test runner runs tests/node/*.test.mjs against a live server on the real offline stack
(a RealtimeSession over the SDK's WebSocket transport: a text turn, a voice turn interrupted
mid-reply, with no session error), and the same in headless Chromium (Debian's ``chromium``,
driven by ``playwright-core``: tests/node/websocket_browser.mjs). ``scripts/bootstrap.sh``
installs both (``npm ci``).
"""

from __future__ import annotations

import json
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


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium: apt-get install chromium")


def test_the_agents_sdk_in_chromium_over_websocket_talks_and_interrupts_without_a_session_error(
        llama, tmp_path):  # noqa: F811
    """The same SDK in a browser page (headless Chromium, driven by playwright-core): its WebSocket
    sends the key as a subprotocol; a text turn, then a spoken question interrupted mid-reply."""
    node, chromium = _node(), _chromium()
    if not (NODE_TESTS / "node_modules" / "playwright-core").is_dir():
        pytest.skip("playwright-core is not installed: npm ci --prefix tests/node (scripts/bootstrap.sh does it)")
    speech, out = tmp_path / "question.pcm", tmp_path / "result.json"
    speech.write_bytes(spoken("Tell me a long story about a dragon who learns to cook."))
    with serving(llama, tmp_path, "llm.max_tokens=120") as (url, _):
        base = url.replace("ws://", "http://").removesuffix("/v1")
        env = {**os.environ, "S2S_BASE_URL": base, "S2S_SPEECH_PCM": str(speech), "S2S_CHROMIUM": chromium,
               "S2S_OUT": str(out)}
        run = subprocess.run([node, str(NODE_TESTS / "websocket_browser.mjs")], cwd=NODE_TESTS, env=env,
                             capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = json.loads(out.read_text())
    assert page["result"] is not None, f"the page stopped at {page['step']}: {page['events'][-8:]}"
    assert page["failed"] is None and page["errors"] == [], (page["failed"], page["errors"], run.stderr[-2000:])
    result = page["result"]
    assert result["text"]["status"] == "completed" and result["text"]["usage"]["output_tokens"] > 0
    assert "dragon" in result["transcript"].lower()
    assert result["cut"]["status"] == "cancelled"
    roles = [item.get("role") for item in result["history"] if item.get("type") == "message"]
    assert roles.count("user") == 2 and "assistant" in roles, roles
