"""A Realtime session's own nodes, and what its client may change in them.

The nodes are found in the session's graph by the node contract's interfaces, never by their
attributes: the VAD by ``TurnSettings`` (turn_detection's threshold, silence and padding), the
TTS by ``Voiced`` (the voice), the LLM by ``Instructed`` (the instructions) and ``SessionTools``
(the client's tools: client_tools.py). A node that implements none keeps its configuration.
"""

from __future__ import annotations

from typing import Any

from nodes.io.realtime.client_tools import ClientTools
from nodes.io.realtime.protocol import ProtocolError, SessionConfig
from s2s_flow.messages import Speech, SpeechStarted
from s2s_flow.node import Instructed, SessionTools, SettingRefused, TurnSettings, Voiced

__all__ = ["NodeSettings", "OPENAI_VOICES"]

_TURN_SETTINGS = ("threshold", "silence_duration_ms", "prefix_padding_ms")  # what a TurnSettings VAD takes
#: the voices of OpenAI's Realtime API: a stock client sends one; they stand for the server's own voice
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")


class NodeSettings:
    """The session's VAD, TTS and LLM (each None where the graph has none that takes settings)."""

    def __init__(self, config: SessionConfig, tools: ClientTools) -> None:
        self.config, self.tools = config, tools
        self.vad: TurnSettings | None = None
        self.vad_kind = "none"  # the graph's VAD, by class (named when it takes no settings)
        self.tts: Voiced | None = None
        self.llm: Instructed | None = None
        self.hears_audio = False  # the LLM takes the user's audio itself (stt=none)
        self.sees_images = False  # the LLM takes images (llm=chat llm.vision=true)

    def bind(self, graph: Any) -> None:
        """Find them in the session's graph; the session's settings start as theirs. Bound again to
        another graph of the same config (the server's template, then the session's own), the
        settings are the same and the nodes the new graph's."""
        self.vad, self.vad_kind, self.tts, self.llm = None, "none", None, None
        llm_name = None
        for name, spec in graph.nodes.items():
            node = spec.node
            if SpeechStarted in spec.cls.outputs.values() and self.vad_kind == "none":
                self.vad_kind = type(node).__name__
                self.vad = node if isinstance(node, TurnSettings) else None
            elif isinstance(node, Instructed) and self.llm is None:
                self.llm, llm_name = node, name
                self.tools.llm = node if isinstance(node, SessionTools) else None
            elif isinstance(node, Voiced) and self.tts is None:
                self.tts = node
        self.hears_audio = any(e.dst == llm_name and issubclass(e.type, Speech) for e in graph.edges)
        self.sees_images = bool(getattr(self.llm, "vision", False))
        config = self.config
        if self.llm is not None:
            config.instructions = self.llm.instructions()
        if self.tts is not None:
            config.voice = self.tts.voice_name
        if self.vad is not None and config.turn_detection is not None:
            config.turn_detection.update(self.vad.turn_settings())  # what the server's VAD really does
            config.server_vad = dict(config.turn_detection)

    def use_voice(self, name: str) -> str:
        """``session.update``'s voice: the session's TTS switches to it if it can; OpenAI's own voice
        names (which stock clients send) stand for the server's voice. Returns the name to report."""
        tts = self.tts
        if tts is None:  # nothing is spoken (a text-only graph)
            return name
        if tts.use_voice(name):
            return tts.voice_name
        if name.lower() in OPENAI_VOICES:
            return name  # echoed as the client named it: it stands for the voice the TTS speaks with
        raise ProtocolError("invalid_value", f"voice {name!r} is not one this server's TTS ({type(tts).__name__}) "
                            f"can speak with: it speaks with {tts.voice_name!r}, for which OpenAI's voice names "
                            f"({', '.join(OPENAI_VOICES)}) also stand; another voice is chosen with tts.voice "
                            "when the server starts", param="session.audio.output.voice")

    def fit_turns(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
        """The turn_detection the session's VAD will use for ``new``: refused (ProtocolError) where it
        cannot take it, lowered where it must (``session.updated`` shows what is in effect)."""
        if new is None:
            return None
        changed = [k for k in _TURN_SETTINGS if old is None or new.get(k) != old.get(k)]
        if not changed:
            return new
        where = "session.audio.input.turn_detection"
        if self.vad is None:
            raise ProtocolError("unsupported_value", f"turn_detection.{changed[0]}: the server's vad ({self.vad_kind}) "
                                "takes no turn settings from the client; leave them out, or serve with vad=silero",
                                param=f"{where}.{changed[0]}")
        try:
            return self.vad.fit_turn_settings(new)
        except SettingRefused as exc:
            raise ProtocolError("invalid_value", str(exc), param=f"{where}.{exc.setting}") from None

    def apply_turns(self, settings: dict[str, Any]) -> None:
        """Point the session's own VAD at fitted settings (from the source's thread)."""
        if self.vad is not None:
            self.vad.apply_turn_settings(settings)

    def set_instructions(self, text: str | None) -> None:
        if self.llm is not None:
            self.llm.set_instructions(text)
