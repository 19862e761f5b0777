"""Any OpenAI-compatible transcription endpoint: ``POST {base_url}/audio/transcriptions``.

OpenAI itself, faster-whisper-server, speaches, vLLM, LocalAI ... The utterance is sent
as a 16-bit mono WAV file; connect errors, 429 and 5xx are retried with jittered backoff.
"""

from __future__ import annotations

import ipaddress
import os
import random
import time
from urllib.parse import urlparse

import numpy as np

from s2s_flow.audio import wav_bytes
from s2s_flow.errors import ConfigError, S2SError
from s2s_flow.node import require

from ._base import UtteranceSTT
from .whisper import check_language

__all__ = ["OpenAISTT", "TranscriptionFailed"]

_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 8.0


class TranscriptionFailed(S2SError):
    """The transcription server answered with an error that retrying does not fix."""


def is_loopback(url: str) -> bool:
    """Whether ``url`` points at this machine (local servers need no key and no proxy)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OpenAISTT(UtteranceSTT):
    """One multipart request per utterance (file, model, language, response_format=json)."""

    secret_params = frozenset({"api_key"})

    def __init__(
        self,
        *,
        base_url: str = "https://api.openai.com/v1",
        model: str = "whisper-1",
        api_key: str | None = None,
        language: str = "en",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_retries: int = 2,
    ) -> None:
        if urlparse(base_url).scheme not in ("http", "https") or not urlparse(base_url).hostname:
            raise ConfigError(f"stt.base_url={base_url!r} is not an http(s) URL: use the API root, e.g. "
                              "https://api.openai.com/v1 or http://127.0.0.1:8000/v1.")
        if not model:
            raise ConfigError("stt.model is empty: name the server's transcription model (whisper-1, "
                              "gpt-4o-mini-transcribe, Systran/faster-whisper-small ...).")
        check_language(language, "stt.language")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ConfigError("stt.connect_timeout and stt.read_timeout must be > 0 (seconds).")
        if max_retries < 0:
            raise ConfigError(f"stt.max_retries={max_retries} must be >= 0.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.language = language
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_retries = max_retries
        self._client = None

    def setup(self) -> None:
        httpx = require("httpx", "remote")
        self._httpx = httpx
        self._key = self.api_key or os.environ.get("OPENAI_API_KEY", "")
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(self.read_timeout, connect=self.connect_timeout),
            trust_env=not is_loopback(self.base_url),  # never send a local request through a proxy
        )

    def transcribe(self, audio: np.ndarray) -> tuple[str, str | None]:
        url = f"{self.base_url}/audio/transcriptions"
        data = {"model": self.model, "response_format": "json"}
        if self.language != "auto":
            data["language"] = self.language
        files = {"file": ("speech.wav", wav_bytes(audio, self.input_rate), "audio/wav")}
        response = self._post(url, data, files)
        try:
            body = response.json()
            text = body["text"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TranscriptionFailed(f"stt=openai: {url} answered 200 without a JSON 'text' field: "
                                      f"{self._snippet(response.text)}") from exc
        language = body.get("language") or (None if self.language == "auto" else self.language)
        return str(text).strip(), language

    def _post(self, url: str, data: dict, files: dict):
        """POST with bounded retries; a non-retryable error becomes a one-paragraph answer."""
        httpx = self._httpx
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self._client.post(url, data=data, files=files)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                if last:
                    raise TranscriptionFailed(
                        f"stt=openai cannot reach {url} ({type(exc).__name__}: {exc}) after "
                        f"{attempt + 1} attempt(s): is the server running? Check stt.base_url."
                    ) from exc
                self._sleep(attempt, None)
                continue
            if response.status_code < 400:
                return response
            if response.status_code in _RETRY_STATUS and not last:
                self._sleep(attempt, response.headers.get("retry-after"))
                continue
            raise self._error(url, response, attempt + 1)
        raise AssertionError("unreachable")

    def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = min(_MAX_BACKOFF_S, _BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.5)
        if retry_after and retry_after.replace(".", "", 1).isdigit():  # seconds; an HTTP date is ignored
            delay = min(_MAX_BACKOFF_S, max(delay, float(retry_after)))
        self.ctx.log.info("stt=openai: retrying in %.2f s", delay)
        time.sleep(delay)

    def _error(self, url: str, response, attempts: int) -> S2SError:
        status, body = response.status_code, self._snippet(response.text)
        if status in (401, 403):
            return ConfigError(
                f"stt=openai: {url} refused the request ({status}: {body}). Set a valid key with "
                "stt.api_key=... or the OPENAI_API_KEY environment variable."
            )
        if status == 404:
            return ConfigError(
                f"stt=openai: {url} answered 404 ({body}). Check stt.base_url (the API root, usually "
                f"ending in /v1) and that the server serves stt.model={self.model!r}."
            )
        return TranscriptionFailed(f"stt=openai: {url} answered {status} after {attempts} attempt(s): {body}")

    def _snippet(self, text: str) -> str:
        text = " ".join(text.split())[:300]
        return text.replace(self._key, "***") if self._key else text

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
