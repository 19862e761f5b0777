"""The client's events: one handler each, from the frame's text to what the session does.

A handler checks its event, hands the session what it asks for (the audio and the turns go on
to the source's thread, in order), and answers with the session's events. What it refuses
raises a ProtocolError, which becomes an ``error`` event naming the client event; the session
goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from nodes.io.realtime import protocol as events
from nodes.io.realtime.protocol import (
    CLIENT_EVENTS,
    ProtocolError,
    decode_pcm16,
    new_id,
    response_instructions,
    response_modalities,
)
from nodes.io.realtime.response import Pending, Response
from nodes.io.realtime.session import Session

__all__ = ["ClientEvents", "MIN_COMMIT_MS", "MAX_BUFFER_S"]

MIN_COMMIT_MS = 100  # input_audio_buffer.commit needs this much audio (as OpenAI's does)
MAX_BUFFER_S = 300  # manual turns: the input audio buffer holds at most this much before a commit


class ClientEvents:
    """The handlers of one session's client events (run on the connection's event loop)."""

    def __init__(self, session: Session, max_frame_bytes: int, first: Callable[[], None] = lambda: None) -> None:
        self.session, self.max_frame_bytes = session, max_frame_bytes
        #: called once, before the first event of the protocol is handled: the session's graph is built
        #: then, so that a client that sends nothing valid never costs one
        self._first: Callable[[], None] | None = first
        self.buffered = 0  # manual turns: samples appended since the last commit or clear
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "input_audio_buffer.append": self.append,
            "input_audio_buffer.commit": self.commit,
            "input_audio_buffer.clear": self.clear,
            "session.update": self.update,
            "conversation.item.create": self.create_item,
            "conversation.item.delete": self.delete_item,
            "conversation.item.retrieve": self.retrieve_item,
            "conversation.item.truncate": self.truncate_item,
            "response.create": self.create_response,
            "response.cancel": self.cancel_response,
            "output_audio_buffer.clear": lambda event: None,  # WebRTC only; over WebSocket the client plays
        }

    def receive(self, text: str | None) -> None:
        """One WebSocket frame: its event handled, or an ``error`` event saying why not."""
        session = self.session
        if text is None:
            session.send(events.error("invalid_frame", "binary frames are not part of the protocol: send JSON events "
                                      "as text frames"))
            return
        if len(text) > self.max_frame_bytes:
            session.send(events.error("frame_too_large", f"a {len(text)}-byte event is over io.max_frame_bytes="
                                      f"{self.max_frame_bytes}: send audio in smaller appends (e.g. 20-100 ms each)"))
            return
        try:
            event = json.loads(text)
        except ValueError as exc:
            session.send(events.error("invalid_json", f"the event is not JSON: {exc}"))
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            session.send(events.error("invalid_event", "an event is a JSON object with a 'type'"))
            return
        client_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        try:
            self.handle(event)
        except ProtocolError as exc:
            session.send(events.error(exc.code, exc.message, client_event_id=client_id, param=exc.param,
                                      type=exc.type))

    def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind not in CLIENT_EVENTS:
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}; this server knows "
                                f"{', '.join(sorted(CLIENT_EVENTS))}", param="type")
        handler = self._handlers.get(kind)
        if handler is None:
            raise ProtocolError("unsupported_event", f"{kind} is not supported by this server yet")
        if self._first is not None:
            first, self._first = self._first, None
            first()
        handler(event)

    # -- the input audio buffer ---------------------------------------------------------------

    def append(self, event: dict[str, Any]) -> None:
        session = self.session
        raw = decode_pcm16(event.get("audio"), session.config.input_format)
        if session.config.manual:
            limit = MAX_BUFFER_S * session.config.input_rate
            if self.buffered + len(raw) // 2 > limit:
                raise ProtocolError("input_audio_buffer_full", f"the input audio buffer holds {MAX_BUFFER_S} s: "
                                    "commit it (input_audio_buffer.commit) or clear it first")
        if not session.put(("audio", raw, session.config.input_rate, time.monotonic())):
            raise ProtocolError("input_overflow", "the server is behind on this session's audio: this append "
                                "was dropped", type="server_error")
        if session.config.manual:
            self.buffered += len(raw) // 2

    def commit(self, event: dict[str, Any]) -> None:
        """With manual turns, what was appended is the user's turn."""
        session = self.session
        if not session.config.manual:
            raise ProtocolError("unsupported_value", "with turn_detection server_vad the VAD commits the user's "
                                "turns itself; set session.audio.input.turn_detection to null to commit them by hand")
        rate = session.config.input_rate
        if self.buffered < MIN_COMMIT_MS * rate // 1000:
            raise ProtocolError("input_audio_buffer_commit_empty", f"buffer too small: expected at least "
                                f"{MIN_COMMIT_MS} ms of audio, got {1000 * self.buffered // rate} ms")
        if not session.put(("commit",)):
            raise ProtocolError("input_overflow", "the server is behind on this session: commit again",
                                type="server_error")
        self.buffered = 0

    def clear(self, event: dict[str, Any]) -> None:
        self.buffered = 0
        self.session.put(("clear",))
        self.session.send(events.audio_cleared())

    # -- the session --------------------------------------------------------------------------

    def update(self, event: dict[str, Any]) -> None:
        """``session.update``: tools first, then the settings (all or nothing), then the nodes."""
        update, session = event.get("session"), self.session
        config = session.config
        if isinstance(update, dict) and ("tools" in update or "tool_choice" in update):
            session.tools.declare(update.get("tools", config.tools), update.get("tool_choice"))
        before = config.turn_detection
        config.update(update, fit=lambda new: session.nodes.fit_turns(before, new), voice=session.nodes.use_voice)
        if config.turn_detection != before:
            self.buffered = 0
            if not session.put(("turns", config.turn_detection and dict(config.turn_detection))):
                raise ProtocolError("input_overflow", "the server is behind on this session: send the "
                                    "session.update again", type="server_error")
        if "instructions" in update:
            session.nodes.set_instructions(config.instructions)
        session.send(events.session_updated(config.to_event(session.id)))

    # -- the conversation ---------------------------------------------------------------------

    def create_item(self, event: dict[str, Any]) -> None:
        """``conversation.item.create``: a user message, or a client tool's output."""
        item = event.get("item")
        if not isinstance(item, dict):
            raise ProtocolError("invalid_value", "conversation.item.create needs an 'item' object", param="item")
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("item")
        if item.get("type") == "function_call_output":
            self.session.tool_output(item.get("call_id"), item.get("output"), item_id)
            return
        if item.get("type", "message") != "message" or item.get("role") != "user":
            raise ProtocolError("unsupported_value", "conversation.item.create: only user messages (input_text) are "
                                "supported by this server yet", param="item.type")
        self.session.user_text(item_id, *user_content(item.get("content"), "item.content",
                                                      self.session.nodes.sees_images))

    def delete_item(self, event: dict[str, Any]) -> None:
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise ProtocolError("invalid_value", "conversation.item.delete needs an 'item_id'", param="item_id")
        self.session.delete(item_id)

    def retrieve_item(self, event: dict[str, Any]) -> None:
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise ProtocolError("invalid_value", "conversation.item.retrieve needs an 'item_id'", param="item_id")
        self.session.retrieve(item_id)

    def truncate_item(self, event: dict[str, Any]) -> None:
        self.session.truncate(event.get("item_id"), event.get("audio_end_ms"))

    # -- responses ----------------------------------------------------------------------------

    def create_response(self, event: dict[str, Any]) -> None:
        """``response.create``: answers the user messages waiting, or a client tool's output; with
        ``input``, those messages instead (``conversation: "none"``: out of band, kept out of the
        conversation)."""
        response, session = event.get("response") or {}, self.session
        if not isinstance(response, dict):
            raise ProtocolError("invalid_value", "response.create's 'response' must be an object", param="response")
        if session.config.kind == "transcription":
            raise ProtocolError("unsupported_value", "a transcription session makes no responses: it sends the "
                                "user's transcripts; session.update with type 'realtime' for replies")
        if session.active():
            raise ProtocolError("conversation_already_has_active_response", "a response is in progress: cancel it "
                                "(response.cancel) or wait for response.done")
        conversation, metadata = response.get("conversation", "auto"), response.get("metadata")
        if conversation not in ("auto", "none"):
            raise ProtocolError("invalid_value", f"response.conversation={conversation!r}: use 'auto' (the "
                                "session's conversation) or 'none' (out of band)", param="response.conversation")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise ProtocolError("invalid_value", "response.metadata is up to 16 string keys with string values",
                                param="response.metadata")
        resp = Response(new_id("resp"), modalities=response_modalities(response, session.config),
                        instructions=response_instructions(response), metadata=metadata,
                        conversation_id=None if conversation == "none" else session.conversation_id,
                        out_of_band=conversation == "none")
        if "input" in response:
            resp.own_context = True
            session.ask(resp, self._inputs(response["input"]))
            return
        answered = session.tools.answered()
        if answered:  # a client tool's answer: the same turn goes on, in a new response
            session.begin(answered[0].turn, resp)
            session.tools.release()
            return
        with session.lock:
            nothing = not session.pending
        if nothing:
            raise ProtocolError("unsupported_value", "response.create answers new user messages: add one "
                                "(conversation.item.create with input_text), or speak (with turn_detection."
                                "create_response=false or null, a spoken turn waits for response.create)")
        session.ask(resp)

    def _inputs(self, given: Any) -> list[Pending]:
        """``response.input``: user messages (input_text), or references to the conversation's typed ones."""
        if not isinstance(given, list) or not given:
            raise ProtocolError("invalid_value", "response.input is a list of user messages ({'type': 'message', "
                                "'role': 'user', 'content': [{'type': 'input_text', ...}]} or {'type': "
                                "'item_reference', 'id': ...})", param="response.input")
        inputs = []
        for i, item in enumerate(given):
            where = f"response.input[{i}]"
            if isinstance(item, dict) and item.get("type") == "item_reference":
                known = self.session.item_data.get(item.get("id")) or {}
                parts = known.get("content") or []
                text = " ".join(p.get("text") or p.get("transcript") or "" for p in parts).strip()
                images = [p["image_url"] for p in parts if p.get("type") == "input_image"]
                if not text and not images:
                    raise ProtocolError("item_not_found", f"{where}: no message {item.get('id')!r} with words in "
                                        "this conversation", param=f"{where}.id")
            elif isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user":
                text, images = user_content(item.get("content"), f"{where}.content", self.session.nodes.sees_images)
            else:
                raise ProtocolError("unsupported_value", f"{where}: only user messages and item references are "
                                    "supported by this server", param=f"{where}.type")
            inputs.append(Pending(new_id("item"), text=text, ready=True, images=images))
        return inputs

    def cancel_response(self, event: dict[str, Any]) -> None:
        session = self.session
        if not session.active():
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
        session.cancel_asked()
        session.put(("cancel",))


def user_content(content: Any, where: str, images_ok: bool) -> tuple[str, list[str]]:
    """A user message's words (its ``input_text`` parts) and its images' URLs (``input_image``: a
    ``data:image/...`` URL or an http(s) one), for an LLM that takes images (``images_ok``: llm.vision).
    Any other part, or an image the LLM cannot take, is refused with the whole message, never dropped."""
    if not isinstance(content, list) or not content:
        raise ProtocolError("invalid_value", "a user message needs content [{'type': 'input_text', 'text': "
                            "...}]", param=where)
    texts, images = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            images.append(_image_url(part, f"{where}[{i}]", images_ok))
            continue
        if kind != "input_text" or not isinstance(part.get("text"), str):
            raise ProtocolError("invalid_value", f"{where}[{i}]: a user message's parts are {{'type': "
                                "'input_text', 'text': ...}} here" + (" or {'type': 'input_image', 'image_url': "
                                "...}" if images_ok else ""), param=f"{where}[{i}]")
        texts.append(part["text"])
    return " ".join(texts).strip(), images


def _image_url(part: dict[str, Any], where: str, images_ok: bool) -> str:
    if not images_ok:
        raise ProtocolError("invalid_value", f"{where} is an image, and this server's LLM takes text only "
                            "(llm.vision=false), so the message was not added (nothing of it dropped silently): "
                            "serve a model that takes images with llm=chat llm.vision=true (llama-server with "
                            "its --mmproj, or a vision model behind any Chat Completions server), or send what "
                            "the image shows as input_text", param=where)
    url = part.get("image_url")
    if not isinstance(url, str) or not url.startswith(("data:image/", "https://", "http://")):
        raise ProtocolError("invalid_value", f"{where}.image_url must be a data:image/...;base64 URL or an "
                            "http(s) URL of the image", param=f"{where}.image_url")
    return url
