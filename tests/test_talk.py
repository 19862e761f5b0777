"""``s2s-talk``, the terminal client, on real audio against the real server: a private PulseAudio
server's null sinks stand in for the room. The client's microphone hears the "user" sink (a WAV
of real speech is played into it with ``paplay``); its speaker is the "agent" sink, recorded
from agent.monitor and read back by Whisper. The server is ours (io=realtime on the offline
stack, SmolLM2 on llama-server), the client the separate process a user would run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.support.pulse import Recorder, pulse_server
from tests.support.realtime import READ_BACK, serving
from tests.support.recording_proxy import recording_proxy
from tests.support.speech import synthesize
from tests.support.tts_checks import transcribe, words_recovered

pytest.importorskip("starlette", reason="pip install 's2s-flow[serve]'")
pytest.importorskip("websockets", reason="pip install 's2s-flow[talk]'")
for _module in ("faster_whisper", "piper", "onnxruntime"):
    pytest.importorskip(_module, reason="the offline stack: pip install 's2s-flow[offline]'")


ROOT = Path(__file__).resolve().parents[1]
KEY = "talk-test-key-5f1c2e"
INSTRUCTIONS = "You are the helpful assistant of the Acme bakery."
ASK = "Tell me a long story about a dragon who learns to cook."
TALK_OVER = "Stop, what is the capital of France?"


@pytest.fixture(scope="module")
def pulse() -> Iterator[object]:
    if shutil.which("paplay") is None:
        pytest.skip("the test plays WAV files with paplay: apt-get install pulseaudio-utils")
    with pulse_server(("agent", "user")) as server:
        server.default_source("user.monitor")  # the client's microphone hears the user sink
        yield server


def keyed(base_url: str, tmp_path: Path, *extra: str):
    """Our server, with a key (the client sends it from $S2S_API_KEY)."""
    return serving(base_url, tmp_path, f"io.api_key={KEY}", *extra)


class Client:
    """``s2s-talk`` in a process of its own, its output read line by line as it comes."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "S2S_API_KEY": KEY, "COLUMNS": "200"}
        # started with SIGINT ignored, as a script's background job is (CI's own runs can be): Ctrl-C
        # (the SIGINT stop() sends) must end it all the same
        self.process = subprocess.Popen([sys.executable, "-m", "nodes.io.talk", *args], env=env, cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.lines: list[str] = []
        self._err: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        # stderr read as it comes too: audio libraries write there (ALSA's underrun lines, many under
        # load), and a full pipe would block the client inside its audio thread, so it never exits
        self._err_reader = threading.Thread(target=lambda: self._err.extend(self.process.stderr), daemon=True)
        self._err_reader.start()

    @property
    def err(self) -> str:
        return "".join(self._err)

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, check, what: str, timeout: float = 120.0) -> str:
        with self._cond:
            found = self._cond.wait_for(lambda: next((ln for ln in self.lines if check(ln)), None)
                                        or self.process.poll() is not None, timeout)
            line = next((ln for ln in self.lines if check(ln)), None)
        assert line is not None, f"s2s-talk never printed {what}: {self.lines}, {self.err}" \
            if found else f"no {what} within {timeout:.0f} s: {self.lines}"
        return line

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:  # Ctrl-C ends it with 0 (0.2 s here; closing the WebSocket may wait out its close timeout)
            code = self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)  # its threads' stacks on stderr (faulthandler)
            time.sleep(2)
            self.process.kill()
            self._err_reader.join(5)
            where = self.err[-6000:]
            raise AssertionError(f"s2s-talk did not end on Ctrl-C within 60 s; where it was:\n{where}") from None
        self._err_reader.join(5)
        return code


def play(tmp_path: Path, text: str, name: str) -> None:
    """A WAV of ``text`` (real speech, then a second of silence) played into the user sink."""
    pcm = np.concatenate([synthesize(text, rate=16000), np.zeros(16000, np.float32)])
    path = tmp_path / f"{name}.wav"
    sf.write(path, pcm, 16000)
    subprocess.Popen(["paplay", "--device=user", str(path)], env=os.environ.copy())


def agent_lines(lines: list[str]) -> str:
    """The agent's words as the client printed them (a turn's first line is labelled)."""
    words = [ln[len("agent"):].strip() if ln.startswith("agent") else ln.strip()
             for ln in lines if ln.startswith(("agent", "      ")) and not ln.strip().startswith("(")]
    return " ".join(" ".join(words).split())


def test_s2s_talk_hears_the_mic_shows_both_transcripts_and_plays_the_reply(pulse, smollm2_server, tmp_path):
    with recording_proxy(smollm2_server) as proxy, keyed(proxy.url, tmp_path, "llm.max_tokens=40") as (url, server):
        client = Client("--url", f"{url}/realtime", "--voice", "alloy", "--instructions", INSTRUCTIONS)
        try:
            client.wait_for(lambda ln: ln.startswith("session: voice"), "the session's settings")
            with Recorder("agent.monitor") as speaker:
                play(tmp_path, "How many kilometers are there in a marathon?", "ask")
                heard = client.wait_for(lambda ln: ln.startswith("you "), "the user's transcript")
                session = next(iter(server.sessions.values()))
                deadline = time.monotonic() + 120
                while not (session.responses and all(r.done for r in session.responses.values())):
                    assert time.monotonic() < deadline, "no reply within 120 s"
                    time.sleep(0.1)
                reply = next(iter(session.responses.values()))
                deadline = time.monotonic() + reply.audio_ms / 1000 + 60
                while speaker.voiced_span() < reply.audio_ms / 1000 - 0.2 and time.monotonic() < deadline:
                    time.sleep(0.1)  # the reply plays out of the speaker (late under load)
                time.sleep(0.5)
                recorded = speaker.audio()
        finally:
            code = client.stop()
    assert code == 0, client.err
    assert "marathon" in heard.lower(), heard
    # the client prints the reply line by line: the same words, its line breaks ("\n\n" between
    # sentences on some CPUs' kernels) as the lines it printed
    assert reply.text.strip() and agent_lines(client.lines) == " ".join(reply.text.split()), (client.lines, reply.text)
    assert INSTRUCTIONS in proxy.bodies("/chat/completions")[-1]["messages"][0]["content"], "--instructions"
    assert not any("error" in ln for ln in client.lines), client.lines
    read_back = transcribe(recorded, 16000)
    assert words_recovered(reply.text, read_back) >= READ_BACK, (reply.text, read_back)
    assert KEY not in "\n".join(client.lines) + client.err, "the key is never printed"


def test_s2s_talk_barge_in_stops_playback_and_truncates_the_reply(pulse, smollm2_server, tmp_path):
    """The user talks over a long reply: the client stops playing it, says so, and tells the server
    how much was played (``conversation.item.truncate``): the next request's history keeps that."""
    with recording_proxy(smollm2_server) as proxy, \
            keyed(proxy.url, tmp_path, "llm.max_tokens=200", "vad.speculate_ms=0") as (url, server):
        client = Client("--url", f"{url}/realtime")
        try:
            client.wait_for(lambda ln: ln.startswith("session: voice"), "the session's settings")
            session = next(iter(server.sessions.values()))
            truncates: list[tuple[str, int]] = []
            real_truncate = session.truncate

            def truncate(item_id, end_ms):  # the real one, seen on its way
                truncates.append((item_id, end_ms))
                return real_truncate(item_id, end_ms)

            session.truncate = truncate
            with Recorder("agent.monitor") as speaker:
                play(tmp_path, ASK, "ask")
                deadline = time.monotonic() + 120
                while speaker.voiced_span() < 1.0:  # a second of the reply has played
                    assert time.monotonic() < deadline, "no reply audio on the speaker"
                    time.sleep(0.05)
                play(tmp_path, TALK_OVER, "talk_over")
                client.wait_for(lambda ln: "(interrupted" in ln, "the interruption")
                deadline = time.monotonic() + 120
                while len(session.responses) < 2 or not all(r.done for r in session.responses.values()):
                    assert time.monotonic() < deadline, "no second reply within 120 s"
                    time.sleep(0.1)
        finally:
            code = client.stop()
    assert code == 0, client.err
    first = min(session.responses.values(), key=lambda r: r.turn)
    assert len(truncates) == 1 and truncates[0][0] == first.item_id, truncates
    played_ms = truncates[0][1]
    assert 0 < played_ms <= first.audio_ms, (played_ms, first.audio_ms)
    requests = proxy.bodies("/chat/completions")
    assert "france" in requests[-1]["messages"][-1]["content"].lower()
    kept = [m["content"] for m in requests[-1]["messages"] if m["role"] == "assistant"]
    assert kept == [first.heard(played_ms)], "the history keeps what the user heard"


def test_s2s_talk_is_a_console_script():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["s2s-talk"] == "nodes.io.talk:main"


def test_s2s_talk_refused_or_unreachable_says_why_without_the_key(pulse, smollm2_server, tmp_path):
    with keyed(smollm2_server, tmp_path) as (url, _):
        wrong = "wrong-key-3a9f7c"
        refused = subprocess.run([sys.executable, "-m", "nodes.io.talk", "--url", f"{url}/realtime", "--api-key",
                                  wrong], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "refused the key (HTTP 401)" in refused.stderr, refused.stderr
    assert wrong not in refused.stdout + refused.stderr
    gone = subprocess.run([sys.executable, "-m", "nodes.io.talk", "--url", url.replace("/v1", "/v1/realtime")],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "S2S_API_KEY": KEY}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # the server has stopped
    assert gone.returncode == 1 and "cannot connect to" in gone.stderr and "s2s-run" in gone.stderr, gone.stderr
