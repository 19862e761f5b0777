"""Any OpenAI-compatible transcription endpoint: ``POST {base_url}/audio/transcriptions``.

OpenAI itself, faster-whisper-server, speaches, vLLM, LocalAI ... The utterance is sent
as a 16-bit mono WAV file through the shared :class:`~nodes._http.RemoteClient` (key
rule, retries on connect errors, 429 and 5xx, errors that name the option to fix).
"""

from __future__ import annotations

import numpy as np

from nodes._http import HttpPolicy, RemoteClient, RemoteError
from s2s_flow.audio import wav_bytes
from s2s_flow.errors import ConfigError

from ._base import UtteranceSTT
from .whisper import check_language

__all__ = ["OpenAISTT", "TranscriptionFailed"]

TranscriptionFailed = RemoteError  # the name this backend's callers catch


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
        if not model:
            raise ConfigError("stt.model is empty: name the server's transcription model (whisper-1, "
                              "gpt-4o-mini-transcribe, Systran/faster-whisper-small ...).")
        check_language(language, "stt.language")
        self.model = model
        self.language = language
        self.client = RemoteClient(
            group="stt", base_url=base_url, api_key=api_key,
            policy=HttpPolicy(connect_timeout, read_timeout, max_retries),
        )

    def setup(self) -> None:
        self.client.log = self.ctx.log
        self.client.open(warm_up=False)  # transcription servers need not list their models

    def transcribe(self, audio: np.ndarray, prompt: str | None = None) -> tuple[str, str | None]:
        data = {"model": self.model, "response_format": "json"}
        if self.language != "auto":
            data["language"] = self.language
        if prompt:
            data["prompt"] = prompt  # the API's own field for the text before this audio
        files = {"file": ("speech.wav", wav_bytes(audio, self.input_rate), "audio/wav")}
        answer = self.client.post_json(
            "/audio/transcriptions", data, files=files, api="transcription endpoint",
            hint_404="check stt.base_url (the API root, usually ending in /v1) and that the server "
                     f"serves stt.model={self.model!r}",
        )
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            raise RemoteError(f"{self.client.base_url}/audio/transcriptions answered without a 'text' "
                              f"field: {str(answer)[:200]}")
        language = answer.get("language") or (None if self.language == "auto" else self.language)
        return answer["text"].strip(), language

    def transcribe_after(self, audio: np.ndarray, prefix: str) -> tuple[str, str | None]:
        return self.transcribe(audio, prompt=prefix)

    def close(self) -> None:
        self.client.close()
