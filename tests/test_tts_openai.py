"""OpenAI-compatible speech node against a real local HTTP server that speaks with espeak-ng."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("espeakng_loader", reason="the test server speaks with espeak-ng")

from nodes.tts.espeak import espeak_synthesize  # noqa: E402
from nodes.tts.openai import OpenAITTS, RemoteTTSError  # noqa: E402
from s2s_flow.errors import ConfigError  # noqa: E402
from s2s_flow.messages import TextDelta  # noqa: E402
from s2s_flow.node import Context  # noqa: E402
from tests.support.servers import free_port  # noqa: E402
from tests.support.tts_checks import FIRST, SECOND, feed_reply  # noqa: E402
from tests.support.tts_server import SpeechServer  # noqa: E402

KEY = "sk-test-123"


def make(tmp_path, base_url: str, **params: object) -> OpenAITTS:
    params.setdefault("api_key", KEY)
    node = OpenAITTS(base_url=base_url, model="tts-test", voice="nova", **params)
    node.ctx = Context("tts", tmp_path)
    node.setup()
    return node


def espeak_seconds(text: str) -> float:
    pcm, rate = espeak_synthesize(text)
    return len(pcm) / rate


def test_wav_reply_is_played_while_the_server_is_still_sending(tmp_path) -> None:
    with SpeechServer(api_key=KEY, hold=True) as server:
        node = make(tmp_path, server.base_url, response_format="wav")
        audio = node.process("text", TextDelta(turn=4, text=FIRST, sentence_end=True, end=True))
        first = next(audio)
        assert len(first.pcm) > 0 and first.text == FIRST and first.turn == 4
        assert not server.finished.is_set()  # the server holds back the second half
        server.release.set()
        rest = list(audio)
    pcm = np.concatenate([first.pcm] + [a.pcm for a in rest])
    assert first.rate == 24000  # null sample_rate = server_rate; the 22.05 kHz WAV is resampled
    assert len(pcm) / 24000 == pytest.approx(espeak_seconds(FIRST), rel=0.03)
    assert [(a.end, len(a.pcm)) for a in rest if a.end] == [(True, 0)]
    assert server.requests == [{
        "path": "/v1/audio/speech",
        "json": {"model": "tts-test", "input": FIRST, "voice": "nova", "response_format": "wav"},
        "authorization": f"Bearer {KEY}",
    }]


@pytest.mark.parametrize("rate", [16000, 24000])
def test_raw_pcm_reply_is_streamed_per_sentence_at_the_asked_rate(tmp_path, rate: int) -> None:
    with SpeechServer(api_key=KEY) as server:
        reply = feed_reply(make(tmp_path, server.base_url, response_format="pcm", sample_rate=rate))
        assert [r["json"]["input"] for r in server.requests] == [FIRST, SECOND]
    assert reply.delta_indices(FIRST) == {2} and reply.delta_indices(SECOND) == {4}
    assert reply.rates == {rate}
    assert len(reply.audio(FIRST)) / rate == pytest.approx(espeak_seconds(FIRST), rel=0.03)
    assert np.sqrt(np.mean(reply.audio(SECOND) ** 2)) > 0.03
    assert max(len(a.pcm) for _, a in reply.outputs) <= 0.5 * rate
    assert len(reply.ends) == 1


def test_a_503_is_retried_and_then_the_audio_arrives(tmp_path) -> None:
    with SpeechServer(api_key=KEY, fail_first=[503, 503]) as server:
        node = make(tmp_path, server.base_url, max_retries=3)
        out = list(node.process("text", TextDelta(text=FIRST, sentence_end=True)))
        assert len(server.requests) == 3
    assert sum(len(a.pcm) for a in out) / 24000 == pytest.approx(espeak_seconds(FIRST), rel=0.03)


def test_retries_are_bounded(tmp_path) -> None:
    with SpeechServer(api_key=KEY, fail_first=[503] * 5) as server:
        node = make(tmp_path, server.base_url, max_retries=2)
        with pytest.raises(RemoteTTSError, match="503.*3 attempts"):
            list(node.process("text", TextDelta(text=FIRST, sentence_end=True)))
        assert len(server.requests) == 3


def test_a_wrong_key_is_a_clear_401_error_that_does_not_leak_the_key(tmp_path) -> None:
    with SpeechServer(api_key=KEY) as server:
        node = make(tmp_path, server.base_url, api_key="sk-wrong-secret")
        with pytest.raises(RemoteTTSError) as err:
            list(node.process("text", TextDelta(text=FIRST, sentence_end=True)))
        assert len(server.requests) == 1  # a refused key is not retried
    message = str(err.value)
    assert "401" in message and "OPENAI_API_KEY" in message and "tts.api_key" in message
    assert "Incorrect API key provided" in message  # the server's own words, without its JSON
    assert "sk-wrong-secret" not in message
    assert OpenAITTS.secret_params == frozenset({"api_key"})


def test_a_wrong_base_url_is_a_404_error_naming_the_option(tmp_path) -> None:
    with SpeechServer(api_key=KEY) as server:
        node = make(tmp_path, server.base_url.removesuffix("/v1"))
        with pytest.raises(RemoteTTSError, match="404.*tts.base_url"):
            list(node.process("text", TextDelta(text=FIRST, sentence_end=True)))


def test_an_unreachable_server_fails_fast_after_bounded_retries(tmp_path) -> None:
    node = make(tmp_path, f"http://127.0.0.1:{free_port()}/v1", max_retries=1)
    start = time.monotonic()
    with pytest.raises(RemoteTTSError, match="no server at .*is the server running"):
        list(node.process("text", TextDelta(text=FIRST, sentence_end=True)))
    assert time.monotonic() - start < 5


def test_a_remote_server_without_a_key_is_refused_before_any_request(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        OpenAITTS(base_url="https://api.example.com/v1")
    OpenAITTS(base_url="http://127.0.0.1:8880/v1")  # loopback servers need no key
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    OpenAITTS(base_url="https://api.example.com/v1")


def test_barge_in_closes_the_stream_and_stops_the_sentence(tmp_path) -> None:
    with SpeechServer(api_key=KEY, hold=True) as server:
        node = make(tmp_path, server.base_url)
        audio = node.process("text", TextDelta(turn=1, text=FIRST, sentence_end=True))
        heard = len(next(audio).pcm)
        assert heard > 0
        barge_in = threading.Timer(0.3, node.on_interrupt, args=(2,))
        barge_in.start()  # fires while the node waits for the held second half
        heard += sum(len(a.pcm) for a in audio)  # ends once interrupted; the server still holds half
        assert not server.finished.is_set()
        server.release.set()
        assert server.disconnected.wait(5)  # the node hung up: the held half had nobody to go to
        whole = sum(len(a.pcm) for a in make(tmp_path, server.base_url).process(
            "text", TextDelta(turn=3, text=FIRST, sentence_end=True)))
        assert 0 < heard < 0.6 * whole  # about the first half (the server split its bytes there)
        out = list(node.process("text", TextDelta(turn=2, text=SECOND, sentence_end=True, end=True)))
        assert {a.text for a in out if len(a.pcm)} == {SECOND}  # the next turn speaks normally


def test_a_barge_in_just_before_the_request_sends_nothing(tmp_path) -> None:
    """An interrupt between the turn's start and the client's begin() (which forgets the last
    abort) must not be lost: the sentence is dropped, not synthesized whole."""
    with SpeechServer(api_key=KEY) as server:
        node = make(tmp_path, server.base_url)
        begin = node.client.begin

        def interrupted_then_begin() -> None:
            node.on_interrupt(2)
            begin()

        node.client.begin = interrupted_then_begin
        out = list(node.process("text", TextDelta(turn=1, text=FIRST, sentence_end=True, end=True)))
        assert not any(len(a.pcm) for a in out) and server.requests == []
        node.client.begin = begin
        out = list(node.process("text", TextDelta(turn=2, text=SECOND, sentence_end=True, end=True)))
        assert {a.text for a in out if len(a.pcm)} == {SECOND} and len(server.requests) == 1


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_32", "FLOAT"])
def test_a_stereo_wav_reply_is_mixed_to_mono_at_its_true_level(subtype) -> None:
    import io

    import soundfile as sf

    from nodes.tts.openai import _WavStream

    t = np.arange(2400) / 24000
    left, right = 0.5 * np.sin(2 * np.pi * 220 * t), 0.25 * np.sin(2 * np.pi * 220 * t)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, right], axis=1), 24000, subtype=subtype, format="WAV")
    data, stream, parts = buf.getvalue(), _WavStream(), []
    for i in range(0, len(data), 997):  # as a server streams it, in odd pieces
        pcm = stream.feed(data[i:i + 997])
        if pcm is not None:
            parts.append(pcm)
    mono = np.concatenate(parts)
    assert stream.rate == 24000 and mono.dtype == np.float32 and len(mono) == len(t)
    assert np.allclose(mono, (left + right) / 2, atol=1e-3)  # about 0.375 peak, not integer counts
