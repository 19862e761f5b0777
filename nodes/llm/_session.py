"""What a server's session may change in its own LLM node: the instructions and tools of its own.

Every LLM backend (``RemoteLLM``, ``LocalLLM``) inherits :class:`SessionLLM`; a session reaches it
only through the node contract's ``Instructed`` and ``SessionTools`` interfaces, so the history
and toolbox stay the node's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nodes.llm._conversation import Conversation
from nodes.llm._tools import TOOL_CHOICES, Tool, Toolbox
from s2s_flow.node import Instructed, SessionTools, SettingRefused

__all__ = ["SessionLLM"]


class SessionLLM(Instructed, SessionTools):
    """The session's side of an LLM node that has a ``conversation`` and a ``toolbox``."""

    conversation: Conversation
    toolbox: Toolbox
    _configured_tools: dict[str, Tool] | None = None  # llm.tools, as the node was built

    def instructions(self) -> str | None:
        return self.conversation.system_prompt

    def set_instructions(self, text: str | None) -> None:
        self.conversation.system_prompt = text or None

    def set_session_tools(self, tools: Sequence[Mapping[str, Any]], call: Callable[[str, dict[str, Any]], str],
                          choice: str | None) -> None:
        """The session's tools join ``llm.tools`` (a session tool of the same name wins); each runs
        ``call`` on the tool's thread like any configured tool."""
        if self._configured_tools is None:
            self._configured_tools = dict(self.toolbox.tools)
        session = {spec["name"]: Tool(spec["name"], str(spec.get("description") or ""),
                                      spec.get("parameters") or {"type": "object", "properties": {}},
                                      func=_calling(call, spec["name"]), path="the session's client")
                   for spec in tools}
        merged = {**self._configured_tools, **session}
        if choice is not None and choice not in TOOL_CHOICES and choice not in merged:
            raise SettingRefused("tool_choice", f"tool_choice={choice!r} is neither auto, none, required nor a "
                                 "declared tool")
        self.toolbox.tools = merged
        if choice is not None:
            self.toolbox.choice = choice

    def round_calls(self) -> list[tuple[str, Any]]:
        exchanges = self.conversation.exchanges
        if not exchanges or not exchanges[-1].rounds:
            return []
        return [(c.name, c.parsed_arguments()) for c in exchanges[-1].rounds[-1].calls]


def _calling(call: Callable[[str, dict[str, Any]], str], name: str) -> Callable[..., str]:
    def run(**arguments: Any) -> str:
        return call(name, arguments)

    return run
