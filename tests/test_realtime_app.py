"""io=realtime's browser app (the page at ``/``: web/page.html, app.js) in headless Chromium, as a
user drives it: Chromium's fake microphone plays a spoken question; over WebRTC (the default)
and over the WebSocket (``?transport=websocket``) the page shows both transcripts as chat
bubbles, a voice-to-voice figure under the reply, the microphone's level, and a voice and
instructions change applied (``session.updated``); a full server, a wrong key and a refused
microphone are said in words. tests/node/app_browser.mjs drives it (playwright-core) and takes
screenshots; the real offline stack answers (Silero, Whisper tiny.en, SmolLM2, Piper).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import numpy as np
import pytest
import soundfile as sf

from tests.support.speech import synthesize

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("aiortc", reason="pip install 's2s-flow[webrtc]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")

from tests.test_realtime import llama, serving, until  # noqa: E402,F401  (the module's llama-server)
from tests.test_realtime_webrtc import NODE_TESTS, RATE, _base, _browser_tools  # noqa: E402

KEY = "ek_app_key"


def _spoke_and_heard(step: dict, transport: str) -> None:
    """A spoken turn as the page shows it: both transcripts in the chat, the voice-to-voice under the reply."""
    s2s, shown = step["s2s"], step["shown"]
    assert s2s["transport"] == transport and not s2s["errors"], (s2s["errors"], s2s["shownErrors"])
    assert s2s["userTranscripts"] and "marathon" in s2s["userTranscripts"][0].lower(), s2s["userTranscripts"]
    assert s2s["agentTranscripts"] and s2s["agentTranscripts"][0].strip()
    assert s2s["agentDeltas"] > 1, "the agent's words came live, as deltas"
    user = [b for b in shown["chat"] if b["who"] == "user"]
    agent = [b for b in shown["chat"] if b["who"] == "agent"]
    assert user and "marathon" in user[0]["words"].lower(), shown["chat"]
    assert agent and agent[0]["words"].strip() == s2s["agentTranscripts"][0].strip(), shown["chat"]
    assert len(s2s["v2v"]) == 1 and s2s["v2v"][0] > 0, s2s["v2v"]
    assert agent[0]["meta"] == f"voice-to-voice {s2s['v2v'][0]} ms", agent[0]
    assert s2s["levelMax"] > 0.05 and s2s["levelBlocks"] > 20, "the level meter moved with the speech"


def test_the_browser_app_talks_over_webrtc_and_websocket_and_says_what_went_wrong(llama, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    node, chromium = _browser_tools()
    monkeypatch.setenv("S2S_REALTIME_API_KEY", KEY)
    wav = tmp_path / "mic.wav"
    question = synthesize("How many kilometers are there in a marathon?", rate=RATE)
    sf.write(wav, np.concatenate([np.zeros(3 * RATE, np.float32), question, np.zeros(4 * RATE, np.float32)]), RATE,
             subtype="PCM_16")
    out, shots = tmp_path / "result.json", os.environ.get("S2S_APP_SHOTS") or str(tmp_path / "shots")
    with serving(llama, tmp_path / "run", "io.max_sessions=1", "io.partials.interval_ms=500", "llm.max_tokens=40",
                 "vad.speculate_ms=0") as (url, server):
        base = _base(url)
        for name, kind in (("", "text/html"), ("web/app.js", "javascript"), ("web/app.css", "text/css"),
                           ("web/worklets.js", "javascript")):
            with urllib.request.urlopen(f"{base}/{name}") as resp:  # the app's plain files, served by the server
                assert kind in resp.headers["Content-Type"], (name, resp.headers["Content-Type"])
        env = {**os.environ, "S2S_BASE_URL": base, "S2S_API_KEY": KEY, "S2S_WAV": str(wav),
               "S2S_CHROMIUM": chromium, "S2S_OUT": str(out), "S2S_SHOTS": shots}
        run = subprocess.run([node, "app_browser.mjs"], cwd=NODE_TESTS, env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        until(lambda: not server.sessions, 30, "the pages' hang-ups to close their sessions")
    got = json.loads(out.read_text())
    assert not got.get("timeouts"), got.get("timeouts")
    steps = got["steps"]

    webrtc = steps["webrtc"]
    _spoke_and_heard(webrtc, "WebRTC")
    assert webrtc["s2s"]["userDeltas"] > 0, "the user's words came live (io.partials), as deltas"
    applied = webrtc["s2s"]["sessions"][-1]
    assert applied["voice"] == "coral" and applied["instructions"].startswith("You are a terse assistant"), applied
    assert "coral" in webrtc["shown"]["applied"]
    assert webrtc["after"]["state"] == "Closed: you hung up"
    _spoke_and_heard(steps["websocket"], "WebSocket")

    for transport in ("websocket", "webrtc"):
        full = steps[f"full_{transport}"]["shown"]
        assert full["error"] and "session_limit_reached" in full["error"], full
        assert full["state"].startswith("Not connected: the server"), full  # not left as if connected
        wrong = steps[f"wrongkey_{transport}"]["shown"]
        assert wrong["error"] and "API key" in wrong["error"], wrong
    assert "invalid_api_key" in steps["wrongkey_webrtc"]["shown"]["error"]  # the call's 401, in the server's words
    denied = steps["denied"]["shown"]
    assert denied["error"] and "Microphone access was denied" in denied["error"], denied
    assert all(os.path.getsize(p) > 0 for p in got["shots"])
