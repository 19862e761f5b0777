"""A Realtime response's state: the assistant item it makes, what of it was sent, and the user
messages it answers. Its lifecycle (what is sent, and when) is the session's (session.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nodes.io.realtime import protocol as events
from nodes.io.realtime.protocol import new_id
from s2s_flow.messages import Speech

__all__ = ["Response", "Pending"]


@dataclass
class Response:
    """One ``response``: the assistant item it makes and what of it was sent."""

    id: str
    turn: int = 0
    modalities: list[str] = field(default_factory=lambda: ["audio"])
    item_id: str = field(default_factory=lambda: new_id("item"))
    started: bool = False  # its output item and content part are open (added, not done yet)
    text: str = ""
    text_done: bool = False  # the words are all in (the LLM's end of reply)
    audio_done: bool = False  # the audio is all in (the TTS's end of reply)
    audio_ms: float = 0.0
    sentences: list[tuple[float, str]] = field(default_factory=list)  # (start ms in the audio, sentence)
    done: bool = False
    cancel_reason: str = "turn_detected"
    speech_end_t: float | None = None
    first_audio: bool = False
    instructions: str | None = None  # response.create's: the system prompt of this response only
    inputs: list[Pending] = field(default_factory=list)  # the user messages it answers (response.create)
    dispatched: bool = False  # handed to the source, which begins it
    conversation_id: str | None = None  # the session's conversation; None: out of band (conversation "none")
    metadata: dict[str, Any] | None = None  # response.create's, echoed
    usage: dict[str, Any] | None = None  # the LLM's token counts, as its server reported them
    out_of_band: bool = False  # conversation "none": its items stay out of the conversation
    own_context: bool = False  # response.create's input: the LLM sees those messages only

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    def heard(self, until_ms: float | None = None) -> str:
        """The sentences whose audio began before ``until_ms`` (all sent ones by default)."""
        end = self.audio_ms if until_ms is None else until_ms
        return " ".join(s for start, s in self.sentences if start < end).strip()

    def as_item(self, status: str) -> dict[str, Any]:
        return events.assistant_item(self.item_id, self.audio, self.text, status)

    def as_response(self, status: str, details: dict[str, Any] | None = None,
                    output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return events.response(self.id, status, self.modalities, output or [], details,
                               conversation_id=self.conversation_id, metadata=self.metadata, usage=self.usage)


@dataclass
class Pending:
    """A user message waiting for ``response.create``: typed text, or a spoken turn that is not
    answered by itself (``create_response: false``, manual turns), whose transcript may still
    be on its way from the STT."""

    item_id: str
    turn: int = 0  # the spoken turn it is (0: typed)
    text: str | None = None
    speech: Speech | None = None  # the audio itself, when the LLM hears audio (stt=none)
    ready: bool = False
    images: list[str] = field(default_factory=list)  # its input_image parts' URLs (llm.vision)
