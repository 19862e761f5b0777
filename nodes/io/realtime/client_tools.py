"""Client-declared tools (``session.tools``): the session's LLM calls them like its own, each call
goes to the client as a ``function_call`` item, and the tool's thread waits for the client's
``function_call_output`` and ``response.create``.

The LLM is reached through the node contract's ``SessionTools``; the response that carries the
calls is the session's (``announce``), like every other response.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodes.io.realtime.protocol import ProtocolError, new_id
from nodes.llm._tools import NAME
from s2s_flow.node import SessionTools, SettingRefused

__all__ = ["ClientCall", "ClientTools"]


@dataclass
class ClientCall:
    """A call of a client-declared tool, waiting for the client's ``function_call_output``."""

    call_id: str
    name: str
    arguments: str
    turn: int
    item_id: str = field(default_factory=lambda: new_id("item"))
    output: str | None = None
    output_item: str | None = None  # the client's function_call_output item
    answered: threading.Event = field(default_factory=threading.Event)


class ClientTools:
    """One session's client tools and their calls (thread-safe under the session's lock)."""

    def __init__(self, lock: Any, answering: Callable[[], int | None],
                 announce: Callable[[int, list[ClientCall]], None]) -> None:
        self.lock, self._answering, self._announce = lock, answering, announce
        self.llm: SessionTools | None = None
        self.calls: dict[str, ClientCall] = {}  # by call_id
        self._names: set[str] = set()  # the client's tools now

    def declare(self, tools: Any, choice: Any) -> None:
        """``session.tools`` / ``tool_choice``: the client's functions join the LLM's own ``llm.tools``."""
        if self.llm is None:
            raise ProtocolError("unsupported_value", "the chosen llm backend takes no tools", param="session.tools")
        specs = []
        for i, spec in enumerate(tools if tools is not None else []):
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or spec.get("type", "function") != "function" or not isinstance(name, str) \
                    or not NAME.match(name) or not isinstance(spec.get("parameters", {}), dict):
                raise ProtocolError("invalid_value", "a tool is {'type': 'function', 'name': <letters, digits, _ or "
                                    "->, 'description': ..., 'parameters': <JSON schema>}", param=f"session.tools[{i}]")
            specs.append(spec)
        if isinstance(choice, dict):
            choice = choice.get("name")
        try:
            self.llm.set_session_tools(specs, self.call, choice)
        except SettingRefused as exc:
            raise ProtocolError("invalid_value", str(exc), param=f"session.{exc.setting}") from None
        self._names = {spec["name"] for spec in specs}

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Runs on one of the LLM's tool threads (one per call of the round): the first to arrive
        sends every client call of the round in one response; each waits for its output."""
        text = json.dumps(arguments)
        with self.lock:  # looked up and registered at once: the round's calls arrive together
            turn = self._answering()
            mine = self._waiting(turn, name, text)
            fresh = []
            if mine is None and turn is not None:
                for n, a in self._round_calls(name, text):
                    if self._waiting(turn, n, a) is None:
                        call = ClientCall(new_id("call"), n, a, turn)
                        self.calls[call.call_id] = call
                        fresh.append(call)
                mine = self._waiting(turn, name, text)
        if mine is None or turn is None:
            return "error: no turn is being answered"
        if fresh:
            self._announce(turn, fresh)
        mine.answered.wait()
        return mine.output or ""

    def _waiting(self, turn: int | None, name: str, arguments: str) -> ClientCall | None:
        return next((c for c in self.calls.values() if (c.turn, c.name, c.arguments) == (turn, name, arguments)
                     and not c.answered.is_set()), None)

    def _round_calls(self, name: str, text: str) -> list[tuple[str, str]]:
        """The distinct client calls of the LLM's current round (the model may write one twice)."""
        found = [(name, text)]
        for called, arguments in self.llm.round_calls() if self.llm is not None else ():
            if called in self._names and isinstance(arguments, dict):
                key = (called, json.dumps(arguments))
                if key not in found:
                    found.append(key)
        return found

    def answer(self, call_id: Any, output: Any, item_id: str) -> ClientCall:
        """A ``function_call_output``: the call's result, kept until ``response.create`` releases it."""
        call = self.calls.get(call_id) if isinstance(call_id, str) else None
        if call is None or call.answered.is_set():
            raise ProtocolError("item_not_found", f"no function call {call_id!r} is waiting for output",
                                param="item.call_id")
        call.output = output if isinstance(output, str) else json.dumps(output)
        call.output_item = item_id
        return call

    def owns(self, item_id: str) -> bool:
        """Whether ``item_id`` is a call's item or its output's."""
        with self.lock:
            return any(item_id in (c.item_id, c.output_item) for c in self.calls.values())

    def answered(self) -> list[ClientCall]:
        """Calls with their output in, still waiting for ``response.create``."""
        with self.lock:
            return [c for c in self.calls.values() if c.output is not None and not c.answered.is_set()]

    def release(self, output: str | None = None) -> None:
        """The client answered (``response.create``), or left (``output`` for the unanswered): every
        waiting call returns."""
        with self.lock:
            calls = [c for c in self.calls.values() if not c.answered.is_set()]
        for call in calls:
            if output is not None and call.output is None:
                call.output = output
            if call.output is not None:
                call.answered.set()
