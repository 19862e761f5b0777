"""The OpenAI Realtime protocol (GA event names) as data: the session's settings as
``session.update`` changes them, one builder for every server event, ids and errors.

No I/O and no state here: the session (session.py) decides what to send and sends it, the
transport (server.py) moves the encoded text.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodes.io.realtime import g711

__all__ = ["ProtocolError", "SessionConfig", "new_id", "encode", "error", "decode_pcm16", "message_item",
           "response_modalities", "response_instructions", "CLIENT_EVENTS"]  # and the event builders below

CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.truncate", "conversation.item.delete", "conversation.item.retrieve",
    "response.create", "response.cancel", "output_audio_buffer.clear",
})
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)

_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """``event_…``, ``item_…``, ``resp_…``: unique in the process, unguessable across sessions."""
    return f"{prefix}_{secrets.token_hex(6)}{next(_counter):06x}"


class ProtocolError(Exception):
    """A client event the server refuses: answered with an ``error`` event, the session goes on."""

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.type = code, message, param, type


def decode_pcm16(audio: Any, fmt: str = "audio/pcm") -> bytes:
    """``input_audio_buffer.append``'s ``audio``: base64 in the session's input format (PCM16, or
    G.711 at 8 kHz) as 16-bit little-endian PCM, or ProtocolError."""
    try:
        return g711.to_pcm16(audio, fmt)
    except ValueError as exc:
        raise ProtocolError("invalid_audio", str(exc), param="audio") from None


def _format(fmt: Any, where: str) -> tuple[str, int]:
    """An audio format object: (type, rate). G.711 (audio/pcmu, audio/pcma) is 8 kHz."""
    if not isinstance(fmt, dict):
        raise ProtocolError("invalid_value", f"{where} must be an object such as {{'type': 'audio/pcm', "
                            "'rate': 24000} or {'type': 'audio/pcmu'}", param=where)
    kind = fmt.get("type", "audio/pcm")
    if kind not in g711.FORMATS:
        raise ProtocolError("unsupported_format", f"{where}.type={kind!r}: this server speaks audio/pcm (16-bit "
                            "mono), audio/pcmu and audio/pcma (G.711 at 8 kHz)", param=f"{where}.type")
    if kind != "audio/pcm":
        if fmt.get("rate", g711.G711_RATE) != g711.G711_RATE:
            raise ProtocolError("invalid_value", f"{where}.rate={fmt.get('rate')!r}: {kind} is 8000 Hz; leave the "
                                "rate out", param=f"{where}.rate")
        return kind, g711.G711_RATE
    rate = fmt.get("rate", 24000)
    if rate not in PCM_RATES:
        raise ProtocolError("invalid_value", f"{where}.rate={rate!r}: use one of {', '.join(map(str, PCM_RATES))}",
                            param=f"{where}.rate")
    return kind, int(rate)


def _format_event(kind: str, rate: int) -> dict[str, Any]:
    return {"type": kind, "rate": rate} if kind == "audio/pcm" else {"type": kind}


@dataclass
class SessionConfig:
    """What ``session.update`` can change, as ``session.created`` / ``session.updated`` report it."""

    model: str = "s2s-flow"
    instructions: str | None = None
    voice: str = "default"  # the session's TTS voice by name (its tts group's voice until changed)
    input_rate: int = 24000
    output_rate: int = 24000
    input_format: str = "audio/pcm"  # or audio/pcmu, audio/pcma (G.711: the rate is 8000)
    output_format: str = "audio/pcm"
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    turn_detection: dict[str, Any] | None = field(default_factory=lambda: {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
        "create_response": True, "interrupt_response": True, "idle_timeout_ms": None})
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    #: "realtime", or "transcription": the user's turns are committed and transcribed, never answered
    kind: str = "realtime"
    #: the last server_vad settings, restored when turn_detection goes from null back to server_vad
    server_vad: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.server_vad = dict(self.turn_detection or {})

    @property
    def manual(self) -> bool:
        """turn_detection is null: the client ends each turn (input_audio_buffer.commit)."""
        return self.turn_detection is None

    @property
    def auto_response(self) -> bool:
        """A turn the VAD ends is answered by itself (else it waits for response.create)."""
        return self.kind == "realtime" and self.turn_detection is not None and \
            self.turn_detection.get("create_response", True)

    def update(self, session: Any, fit: Callable[[dict[str, Any] | None], dict[str, Any] | None] | None = None,
               voice: Callable[[str], str] | None = None) -> None:
        """Apply a ``session.update``'s ``session`` object (all or nothing); ``fit`` turns the new
        turn_detection into the settings the server will use, ``voice`` switches the session's TTS to
        the voice asked for and names the one it speaks with; each refuses with a ProtocolError."""
        if not isinstance(session, dict):
            raise ProtocolError("invalid_value", "session.update needs a 'session' object", param="session")
        kind = session.get("type", self.kind)
        if kind not in ("realtime", "transcription"):
            raise ProtocolError("invalid_value", f"session.type={kind!r}: use 'realtime' (a conversation with "
                                "responses) or 'transcription' (the user's transcripts only)", param="session.type")
        new = copy.deepcopy(self)
        new.kind = kind
        if "instructions" in session:
            if session["instructions"] is not None and not isinstance(session["instructions"], str):
                raise ProtocolError("invalid_value", "session.instructions must be a string",
                                    param="session.instructions")
            new.instructions = session["instructions"]
        if "output_modalities" in session:
            new.output_modalities = _modalities(session["output_modalities"], "session.output_modalities")
        audio = session.get("audio") or {}
        if not isinstance(audio, dict):
            raise ProtocolError("invalid_value", "session.audio must be an object", param="session.audio")
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if "format" in inp:
            new.input_format, new.input_rate = _format(inp["format"], "session.audio.input.format")
        if "format" in out:
            new.output_format, new.output_rate = _format(out["format"], "session.audio.output.format")
        if "turn_detection" in inp:
            new.turn_detection = _turn_detection(inp["turn_detection"], self.turn_detection or self.server_vad)
            if fit is not None:
                new.turn_detection = fit(new.turn_detection)
            new.server_vad = dict(new.turn_detection or self.server_vad)
        if "tools" in session:
            if not isinstance(session["tools"], list):
                raise ProtocolError("invalid_value", "session.tools must be a list", param="session.tools")
            new.tools = session["tools"]
        if "tool_choice" in session:
            new.tool_choice = session["tool_choice"]
        if "voice" in out:  # last: the one change made before the update is known to be whole
            if not isinstance(out["voice"], str) or not out["voice"].strip():
                raise ProtocolError("invalid_value", "session.audio.output.voice must be a voice's name",
                                    param="session.audio.output.voice")
            new.voice = voice(out["voice"]) if voice is not None else out["voice"]
        self.__dict__.update(new.__dict__)

    def to_event(self, session_id: str) -> dict[str, Any]:
        formats = _format_event(self.input_format, self.input_rate), _format_event(self.output_format, self.output_rate)
        if self.kind == "transcription":
            return {"type": "transcription", "object": "realtime.transcription_session", "id": session_id,
                    "audio": {"input": {"format": formats[0], "transcription": {"model": "stt"},
                                        "noise_reduction": None, "turn_detection": self.turn_detection}},
                    "include": None}
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "output_modalities": self.output_modalities, "instructions": self.instructions,
            "audio": {
                "input": {"format": formats[0], "transcription": {"model": "stt"},
                          "noise_reduction": None, "turn_detection": self.turn_detection},
                "output": {"format": formats[1], "voice": self.voice, "speed": 1.0},
            },
            "tools": self.tools, "tool_choice": self.tool_choice, "max_output_tokens": "inf",
            "tracing": None, "truncation": "auto", "prompt": None, "include": None,
        }


def _modalities(value: Any, where: str) -> list[str]:
    if value not in (["audio"], ["text"]):
        raise ProtocolError("invalid_value", f"{where}={value!r}: use ['audio'] (speech and its transcript) "
                            "or ['text']", param=where)
    return list(value)


_TURN_KEYS = frozenset({"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                        "interrupt_response", "idle_timeout_ms"})


def _turn_detection(value: Any, current: dict[str, Any]) -> dict[str, Any] | None:
    """``turn_detection``: None (manual turns: the client commits), or server_vad settings merged
    over the current ones and checked against what the VAD accepts."""
    where = "session.audio.input.turn_detection"
    if value is None:
        return None
    kind = value.get("type", current.get("type", "server_vad")) if isinstance(value, dict) else None
    if kind not in ("server_vad", "semantic_vad"):
        raise ProtocolError("unsupported_value", "turn_detection: use {'type': 'server_vad', ...}, {'type': "
                            "'semantic_vad'} or null (manual turns: input_audio_buffer.commit ends them)", param=where)
    keys = _TURN_KEYS | {"eagerness"} if kind == "semantic_vad" else _TURN_KEYS
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ProtocolError("unknown_parameter", f"turn_detection has no {', '.join(unknown)}; it takes "
                            f"{', '.join(sorted(keys))}", param=f"{where}.{unknown[0]}")
    # semantic_vad (the Agents SDK's default) is served by the server's own end-of-turn detection,
    # whatever vad.turn chose (vad.turn=smart_turn: a model of the words' end); its eagerness is kept
    merged = {k: v for k, v in {**current, **value, "type": kind}.items() if k != "eagerness" or kind == "semantic_vad"}
    if kind == "semantic_vad":
        merged.setdefault("eagerness", "auto")
        if merged["eagerness"] not in ("low", "medium", "high", "auto"):
            raise ProtocolError("invalid_value", f"turn_detection.eagerness={merged['eagerness']!r}: use low, "
                                "medium, high or auto", param=f"{where}.eagerness")
    threshold = merged.get("threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.15 < threshold < 1.0:
        raise ProtocolError("invalid_value", f"turn_detection.threshold={threshold!r}: a speech probability the "
                            "VAD takes between 0.2 and 0.95 (default 0.5)", param=f"{where}.threshold")
    for key, most in (("silence_duration_ms", 10_000), ("prefix_padding_ms", 2_000)):
        ms = merged.get(key)
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= most:
            raise ProtocolError("invalid_value", f"turn_detection.{key}={ms!r}: whole milliseconds from 0 to {most}",
                                param=f"{where}.{key}")
    for key in ("create_response", "interrupt_response"):
        if not isinstance(merged.get(key), bool):
            raise ProtocolError("invalid_value", f"turn_detection.{key} must be true or false", param=f"{where}.{key}")
    return merged


def response_instructions(response: Any) -> str | None:
    """``response.create``'s ``instructions``: the system prompt of that response only."""
    text = response.get("instructions") if isinstance(response, dict) else None
    if text is not None and not isinstance(text, str):
        raise ProtocolError("invalid_value", "response.instructions must be a string", param="response.instructions")
    return text


def response_modalities(response: Any, config: SessionConfig) -> list[str]:
    """``response.create``'s output modalities (per response), else the session's."""
    if isinstance(response, dict) and "output_modalities" in response:
        return _modalities(response["output_modalities"], "response.output_modalities")
    return list(config.output_modalities)


# -- server events: one builder each --------------------------------------------------------


def encode(event: dict[str, Any]) -> str:
    """A server event as it goes on the wire: JSON, with an ``event_id`` of its own."""
    return json.dumps({"event_id": new_id("event"), **event})


def error(code: str, message: str, *, client_event_id: str | None = None, param: str | None = None,
          type: str = "invalid_request_error") -> dict[str, Any]:
    """``error``: what was refused and why; ``client_event_id`` names the client event it answers."""
    return {"type": "error", "error": {"type": type, "code": code, "message": message, "param": param,
                                       "event_id": client_event_id}}


def session_created(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.created", "session": session}


def session_updated(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.updated", "session": session}


# the input audio buffer and the user's speech

def speech_started(item_id: str, audio_start_ms: int) -> dict[str, Any]:
    return {"type": "input_audio_buffer.speech_started", "audio_start_ms": audio_start_ms, "item_id": item_id}


def speech_stopped(item_id: str, audio_end_ms: int) -> dict[str, Any]:
    return {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": audio_end_ms, "item_id": item_id}


def audio_committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return {"type": "input_audio_buffer.committed", "previous_item_id": previous_item_id, "item_id": item_id}


def audio_cleared() -> dict[str, Any]:
    return {"type": "input_audio_buffer.cleared"}


def transcription_delta(item_id: str, delta: str) -> dict[str, Any]:
    return {"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id, "content_index": 0,
            "delta": delta}


def transcription_completed(item_id: str, transcript: str, seconds: float) -> dict[str, Any]:
    """``usage``: the GA schema's duration form (seconds of audio transcribed)."""
    return {"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
            "content_index": 0, "transcript": transcript, "usage": {"type": "duration", "seconds": round(seconds, 3)}}


def transcription_failed(item_id: str, message: str) -> dict[str, Any]:
    return {"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id, "content_index": 0,
            "error": {"type": "server_error", "code": "stt_failed", "message": message, "param": None}}


# the conversation's items

def message_item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status, "role": role,
            "content": content}


def user_audio_item(item_id: str, transcript: str | None = None) -> dict[str, Any]:
    return message_item(item_id, "user", [{"type": "input_audio", "transcript": transcript}])


def user_text_item(item_id: str, text: str, images: Sequence[str] = ()) -> dict[str, Any]:
    return message_item(item_id, "user", [{"type": "input_text", "text": text},
                                          *({"type": "input_image", "image_url": url} for url in images)])


def assistant_item(item_id: str, audio: bool, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
    return message_item(item_id, "assistant", [part], status)


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status, "name": name,
            "call_id": call_id, "arguments": arguments}


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "call_id": call_id,
            "output": output, "status": "completed"}


def item_added(item: dict[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return {"type": "conversation.item.added", "previous_item_id": previous_item_id, "item": item}


def item_done(item: dict[str, Any], previous_item_id: str | None = None) -> dict[str, Any]:
    return {"type": "conversation.item.done", "previous_item_id": previous_item_id, "item": item}


def item_retrieved(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "conversation.item.retrieved", "item": item}


def item_deleted(item_id: str) -> dict[str, Any]:
    return {"type": "conversation.item.deleted", "item_id": item_id}


def item_truncated(item_id: str, audio_end_ms: int) -> dict[str, Any]:
    return {"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
            "audio_end_ms": audio_end_ms}


# responses

def response(response_id: str, status: str, modalities: list[str], output: list[dict[str, Any]],
             details: dict[str, Any] | None = None, *, conversation_id: str | None = None,
             metadata: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``realtime.response`` object of ``response.created`` and ``response.done``."""
    return {"object": "realtime.response", "id": response_id, "status": status, "status_details": details,
            "output": output, "conversation_id": conversation_id, "output_modalities": modalities,
            "usage": usage, "metadata": metadata}


def response_usage(usage: Any) -> dict[str, Any] | None:
    """``response.done``'s usage from a Chat Completions ``usage`` (prompt and completion tokens)."""
    if not isinstance(usage, dict):
        return None
    given, made = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"total_tokens": given + made, "input_tokens": given, "output_tokens": made,
            "input_token_details": {"text_tokens": given, "audio_tokens": 0, "image_tokens": 0,
                                    "cached_tokens": cached},
            "output_token_details": {"text_tokens": made, "audio_tokens": 0}}


def response_created(resource: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.created", "response": resource}


def response_done(resource: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.done", "response": resource}


def output_item_added(response_id: str, output_index: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.added", "response_id": response_id, "output_index": output_index,
            "item": item}


def output_item_done(response_id: str, output_index: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_item.done", "response_id": response_id, "output_index": output_index,
            "item": item}


def part_ids(response_id: str, item_id: str) -> dict[str, Any]:
    """Where a content part is: the first (only) part of a response's message item."""
    return {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}


def content_part(audio: bool, text: str) -> dict[str, Any]:
    return {"type": "audio", "transcript": text} if audio else {"type": "text", "text": text}


def content_part_added(ids: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.content_part.added", **ids, "part": part}


def content_part_done(ids: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.content_part.done", **ids, "part": part}


def output_text_delta(ids: dict[str, Any], delta: str) -> dict[str, Any]:
    return {"type": "response.output_text.delta", **ids, "delta": delta}


def output_text_done(ids: dict[str, Any], text: str) -> dict[str, Any]:
    return {"type": "response.output_text.done", **ids, "text": text}


def output_audio_transcript_delta(ids: dict[str, Any], delta: str) -> dict[str, Any]:
    return {"type": "response.output_audio_transcript.delta", **ids, "delta": delta}


def output_audio_transcript_done(ids: dict[str, Any], transcript: str) -> dict[str, Any]:
    return {"type": "response.output_audio_transcript.done", **ids, "transcript": transcript}


def output_audio_delta(ids: dict[str, Any], pcm16: bytes, config: SessionConfig) -> dict[str, Any]:
    """16-bit PCM at the session's output rate, as base64 in its output format (PCM16, or G.711)."""
    audio = g711.from_pcm16(pcm16, config.output_format)
    return {"type": "response.output_audio.delta", **ids, "delta": base64.b64encode(audio).decode("ascii")}


def output_audio_done(ids: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_audio.done", **ids}


def function_call_arguments_delta(response_id: str, output_index: int, item_id: str, call_id: str,
                                  delta: str) -> dict[str, Any]:
    return {"type": "response.function_call_arguments.delta", "response_id": response_id,
            "output_index": output_index, "item_id": item_id, "call_id": call_id, "delta": delta}


def function_call_arguments_done(response_id: str, output_index: int, item_id: str, call_id: str, name: str,
                                 arguments: str) -> dict[str, Any]:
    return {"type": "response.function_call_arguments.done", "response_id": response_id,
            "output_index": output_index, "item_id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments}
