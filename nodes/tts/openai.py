"""Any OpenAI-compatible speech endpoint: ``POST {base_url}/audio/speech``, read as it streams.

OpenAI itself, or local servers that copy its API (Kokoro-FastAPI, Speaches, LocalAI,
the faster-qwen3-tts example server). Each sentence is one request through the shared
:class:`~nodes._http.RemoteClient`; audio is yielded as the bytes arrive, so the first
chunk plays before the server has finished.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from nodes._http import Aborted, HttpPolicy, RemoteClient, RemoteError
from nodes.tts._base import SentenceTTS
from s2s_flow.audio import to_float32, to_mono
from s2s_flow.errors import ConfigError

__all__ = ["OpenAITTS", "RemoteTTSError"]

_FORMATS = ("pcm", "wav")
RemoteTTSError = RemoteError  # the name this backend's callers catch


class _WavStream:
    """Incremental WAV reader: header first (rate, format), then PCM as it arrives.

    Streaming servers cannot know the data size up front and write 0 or 0xFFFFFFFF
    there, so the declared sizes of the RIFF and data chunks are ignored.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.rate: int | None = None
        self._fmt: tuple[int, int, int] | None = None  # (format tag, channels, bits)
        self._in_data = False

    def feed(self, data: bytes) -> np.ndarray | None:
        self._buf += data
        if not self._in_data and not self._parse_header():
            return None
        assert self._fmt is not None
        tag, channels, bits = self._fmt
        frame = channels * bits // 8
        usable = len(self._buf) - len(self._buf) % frame
        raw, self._buf = self._buf[:usable], self._buf[usable:]
        if not raw:
            return None
        dtype = {(1, 16): "<i2", (1, 32): "<i4", (3, 32): "<f4"}[(tag, bits)]
        pcm = np.frombuffer(raw, dtype=dtype).reshape(-1, channels)
        return to_mono(to_float32(pcm))  # scale the integers first: to_mono averages into float32

    def _parse_header(self) -> bool:
        buf = self._buf
        if len(buf) < 12:
            return False
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise RemoteError("the speech server answered response_format=wav with something that is "
                                 f"not a WAV file (starts {buf[:12]!r}); try tts.response_format=pcm.")
        pos = 12
        while len(buf) >= pos + 8:
            cid, size = buf[pos : pos + 4], struct.unpack("<I", buf[pos + 4 : pos + 8])[0]
            if cid == b"data":
                if self._fmt is None:
                    raise RemoteError("the server's WAV stream has audio data before its format chunk.")
                self._buf, self._in_data = buf[pos + 8 :], True
                return True
            if len(buf) < pos + 8 + size:
                return False
            if cid == b"fmt ":
                tag, channels, rate = struct.unpack("<HHI", buf[pos + 8 : pos + 16])
                bits = struct.unpack("<H", buf[pos + 22 : pos + 24])[0]
                if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the real tag opens the subformat GUID
                    tag = struct.unpack("<H", buf[pos + 32 : pos + 34])[0]
                if (tag, bits) not in {(1, 16), (1, 32), (3, 32)}:
                    raise RemoteError(f"the server's WAV is format {tag} with {bits}-bit samples; "
                                         "expected 16-bit PCM or 32-bit float (or tts.response_format=pcm).")
                self._fmt, self.rate = (tag, channels, bits), rate
            pos += 8 + size + (size & 1)
        return False


class OpenAITTS(SentenceTTS):
    """Speech from an OpenAI-compatible ``/audio/speech`` endpoint, streamed per sentence."""

    secret_params = frozenset({"api_key"})

    def __init__(
        self,
        *,
        base_url: str = "https://api.openai.com/v1",
        model: str = "gpt-4o-mini-tts",
        voice: str = "alloy",
        api_key: str | None = None,
        response_format: str = "pcm",
        server_rate: int = 24000,
        instructions: str | None = None,
        speed: float | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_retries: int = 3,
        **options: Any,  # SentenceTTS's: sample_rate, first_clause_words, ... (conf/tts/*.yaml)
    ) -> None:
        super().__init__(**options)
        if response_format not in _FORMATS:
            raise ConfigError(f"tts.response_format={response_format!r}: choose pcm (raw 16-bit, lowest "
                              "latency) or wav (the server's own rate is read from the header).")
        if not 8000 <= server_rate <= 192_000:
            raise ConfigError(f"tts.server_rate={server_rate}: the rate in Hz the server speaks at "
                              "(OpenAI: 24000); a wav header's rate overrides it.")
        if speed is not None and not 0.25 <= speed <= 4.0:
            raise ConfigError(f"tts.speed={speed}: OpenAI accepts 0.25 to 4.0 (null = server default).")
        self.client = RemoteClient(
            group="tts", base_url=base_url, api_key=api_key,
            policy=HttpPolicy(connect_timeout, read_timeout, max_retries),
        )
        self.model, self.voice = model, voice
        self.response_format, self.server_rate = response_format, server_rate
        self.instructions, self.speed = instructions, speed
        self._rate = server_rate

    @property
    def native_rate(self) -> int:
        return self._rate

    def setup(self) -> None:
        self.client.log = self.ctx.log
        self.client.open(warm_up=False)  # speech servers need not list their models

    def close(self) -> None:
        self.client.close()

    def cancel_synthesis(self) -> None:
        self.client.abort()  # a read blocked on the server returns at once

    def use_voice(self, name: str) -> bool:
        """Any name: the speech server knows its voices (a name it lacks fails that request)."""
        if not name.strip():
            return False
        self.voice = name
        return True

    def synthesize(self, sentence: str) -> Iterator[np.ndarray]:
        turn = self.speaking_turn
        self.client.begin()
        if self.interrupted(turn):  # a barge-in before begin(): its abort was cleared, so stop here
            return
        payload: dict[str, Any] = {"model": self.model, "input": sentence, "voice": self.voice,
                                   "response_format": self.response_format}
        if self.instructions:
            payload["instructions"] = self.instructions
        if self.speed is not None:
            payload["speed"] = self.speed
        wav = _WavStream() if self.response_format == "wav" else None
        odd = b""
        try:
            with self.client.post_bytes("/audio/speech", payload, api="speech endpoint", hint_404=(
                "check tts.base_url (OpenAI-style servers serve /v1/audio/speech, so it usually ends "
                f"in /v1) and that the server has tts.model={self.model!r}"
            )) as chunks:
                for data in chunks:
                    if wav is not None:
                        pcm = wav.feed(data)
                        if wav.rate:
                            self._rate = wav.rate
                    else:
                        data, odd = odd + data, b""
                        if len(data) % 2:
                            data, odd = data[:-1], data[-1:]
                        pcm = np.frombuffer(data, dtype="<i2") if data else None
                    if pcm is not None and len(pcm):
                        yield pcm
        except Aborted:
            return  # barge-in or shutdown closed the request on purpose
        except RemoteError as exc:
            if self.interrupted(turn):
                return
            if exc.status in (400, 422):
                raise RemoteError(
                    f"{exc}; check tts.model={self.model!r}, tts.voice={self.voice!r} and "
                    f"tts.response_format={self.response_format!r}", status=exc.status, detail=exc.detail,
                ) from None
            raise
