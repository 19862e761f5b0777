"""io=realtime's browser page in a real headless Chromium, a WAV file as its microphone.

Chromium (Debian package ``chromium``) opens the page the server serves at ``/`` over its
WebSocket link (``?transport=websocket``: PCM16 events; the app's WebRTC link and the rest of it:
tests/test_realtime_app.py); its fake capture device plays a spoken question; the test reads the
page's state over the DevTools protocol until the page shows the user's transcript and has played
reply audio.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.support.managed import stop
from tests.support.speech import synthesize

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
websockets = pytest.importorskip("websockets", reason="pip install 's2s-flow[serve]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")

from tests.test_realtime import _server, llama  # noqa: E402,F401  (the module's llama-server fixture)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium: apt-get install chromium")


def _page_state(debug_port: int, page_url: str, deadline: float) -> dict:
    """The page's ``window.s2s`` once it has a user transcript and has played reply audio."""
    from websockets.sync.client import connect

    target = None
    while target is None:
        assert time.monotonic() < deadline, "Chromium never listed the page"
        with urllib.request.urlopen(f"http://127.0.0.1:{debug_port}/json") as resp:
            pages = json.load(resp)
        target = next((p for p in pages if p.get("type") == "page" and p["url"].startswith(page_url)), None)
        if target is None:
            time.sleep(0.1)
    state: dict = {}
    with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
        n = 0
        while not (state.get("userTranscripts") and state.get("playedSamples", 0) > 0
                   and state.get("agentTranscripts")):
            assert time.monotonic() < deadline, f"the page did not converse in time: {state}"
            n += 1
            ws.send(json.dumps({"id": n, "method": "Runtime.evaluate",
                                "params": {"expression": "JSON.stringify(window.s2s || null)", "returnByValue": True}}))
            while True:
                answer = json.loads(ws.recv(timeout=30))
                if answer.get("id") == n:
                    break
            value = answer.get("result", {}).get("result", {}).get("value")
            state = json.loads(value) if value and value != "null" else {}
            time.sleep(0.2)
    return state


def test_the_browser_page_hears_the_microphone_and_plays_the_reply(llama, tmp_path):  # noqa: F811
    chromium = _chromium()
    question = synthesize("How many kilometers are there in a marathon?", rate=48000)
    pcm = np.concatenate([np.zeros(24000, np.float32), question, np.zeros(96000, np.float32)])
    wav = tmp_path / "question.wav"
    sf.write(wav, pcm, 48000, subtype="PCM_16")

    server = _server(llama, tmp_path / "run")
    url = server.start()  # stopped below, with Chromium
    page_url = url.replace("ws://", "http://").removesuffix("/v1") + "/"
    profile, log = tmp_path / "profile", tmp_path / "chromium.log"
    proc = subprocess.Popen(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
         "--remote-debugging-port=0", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         f"--use-file-for-fake-audio-capture={wav}%noloop", "--autoplay-policy=no-user-gesture-required",
         page_url + "?autostart=1&transport=websocket"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))  # a file: a pipe nobody reads would fill and block it
    try:
        deadline = time.monotonic() + 180
        port_file = Path(profile, "DevToolsActivePort")
        while not port_file.is_file() or not port_file.read_text().strip():
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        state = _page_state(int(port_file.read_text().split()[0]), page_url, deadline)
    finally:
        stop(proc)
        server.stop()
    assert "marathon" in state["userTranscripts"][0].lower()
    assert state["playedSamples"] > 0 and state["agentTranscripts"][0].strip()
    assert not state["errors"], state["errors"]
