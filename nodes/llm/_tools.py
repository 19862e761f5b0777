"""Tools the model may call (``llm.tools``), and the loop that runs them; every LLM backend uses both.

A tool is a plain Python function named by import path (``mypkg.weather:get_weather``). Its
JSON schema comes from its type hints and docstring when the config is composed, so a
function the model could not be told how to call is an error before any model loads.

The loop (:func:`answer_with_tools`) is backend-neutral: a backend makes one request per
round and yields text pieces and :class:`ToolCall` objects; here the calls run, each on its
own thread under ``tool_timeout_s``, their results go into the history, and the next round
is asked for, until the model answers in text or ``max_tool_rounds`` is spent (the last
round then offers no tools). A failing or slow tool becomes a result the model can talk
about; a barge-in wakes the wait at once and abandons the round.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import inspect
import json
import os
import re
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from nodes.llm._conversation import Exchange, ToolCall, ToolRound
from s2s_flow.errors import ConfigError

__all__ = ["Tool", "Toolbox", "describe", "answer_with_tools", "TOOL_CHOICES", "forces_call", "named_tool"]

TOOL_CHOICES = ("auto", "none", "required")
RESULT_CHARS = 4000  # a longer result is cut: it is prompt the next round must prefill
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI accepts as a function name
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Raises|Yields|Examples?|Notes?)\s*:?\s*$")


def forces_call(choice: str) -> bool:
    """Whether a tool choice makes the model call a tool: ``required``, or a tool's name."""
    return choice not in ("auto", "none")


def named_tool(choice: str) -> str | None:
    """The tool a choice names (the model must call that one), or None for auto, none, required."""
    return None if choice in TOOL_CHOICES else choice


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable described for the model: name, description and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    func: Callable[..., Any]
    path: str  # where it came from, for messages

    def chat_schema(self) -> dict[str, Any]:
        """Chat Completions (and chat templates): ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def responses_schema(self) -> dict[str, Any]:
        """Responses API: the same, flat."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters}


# -- describing a function ----------------------------------------------------------------


def describe(path: str, group: str = "llm") -> Tool:
    """Import ``module:function`` (or ``module.function``) and describe it; ConfigError naming it if not."""
    func = _import(path, group)
    where = f"{group}.tools: {path}"
    name = getattr(func, "__name__", "")
    if not NAME.match(name):
        raise ConfigError(f"{where} is named {name!r}: a tool name is 1-64 letters, digits, _ or -")
    doc = inspect.getdoc(func) or ""
    description, arg_docs = _parse_docstring(doc)
    if not description:
        raise ConfigError(f"{where} has no docstring: its first lines tell the model what the tool does")
    try:
        signature = inspect.signature(func)
        hints = typing.get_type_hints(func)
    except (TypeError, ValueError, NameError) as exc:
        raise ConfigError(f"{where}: its signature cannot be read ({exc})") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ConfigError(f"{where}: parameter {p.name!r} is {p.kind.description}; a tool takes named "
                              f"arguments only, each with a type hint")
        if p.name not in hints:
            raise ConfigError(f"{where}: parameter {p.name!r} has no type hint, so the model cannot be told "
                              f"what to pass (e.g. {p.name}: str)")
        try:
            schema = _schema(hints[p.name])
        except TypeError as exc:
            raise ConfigError(f"{where}: parameter {p.name!r}: {exc}") from None
        if p.name in arg_docs:
            schema = {**schema, "description": arg_docs[p.name]}
        properties[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name=name, description=description, parameters=parameters, func=func, path=path)


def _import(path: str, group: str) -> Callable[..., Any]:
    module_name, colon, attr = path.partition(":")
    if not colon:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{group}.tools: {path!r} is not an import path: write module:function, "
                          f"e.g. mypkg.weather:get_weather")
    try:
        obj: Any = _import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{group}.tools: {path}: cannot import {module_name} ({exc}); it must be installed "
                          f"or sit in the current directory") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{group}.tools: {path}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{group}.tools: {path} is a {type(obj).__name__}, not a function")
    return obj


def _import_module(name: str) -> Any:
    """Import a tool's module; one in the current directory is found too (s2s-run, a console
    script, does not put the current directory on the path as ``python -m`` does)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != name.split(".")[0] or here in sys.path:
            raise
    sys.path.append(here)
    return importlib.import_module(name)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: its description}) from a Google-style or reST docstring."""
    lines = doc.splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section, current = "", ""
    for line in lines:
        head = _SECTION.match(line)
        param = re.match(r"^\s*:param\s+(?:\w+\s+)?(\w+)\s*:\s*(.*)$", line)
        if param:
            section, current = "args", param.group(1)
            args[current] = param.group(2).strip()
        elif head:
            section, current = head.group(1).lower().rstrip("s"), ""
            section = "args" if section in ("arg", "argument", "parameter") else section
        elif re.match(r"^\s*:\w+", line):
            section, current = "other", ""
        elif not section:
            description.append(line.strip())
        elif section == "args" and line.strip():
            item = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if item and (not current or _indent(line) <= _indent_of(lines, current)):
                current = item.group(1)
                args[current] = item.group(2).strip()
            elif current:
                args[current] = f"{args[current]} {line.strip()}".strip()
    text = " ".join(" ".join(description).split())
    return text, args


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _indent_of(lines: list[str], name: str) -> int:
    return next((_indent(ln) for ln in lines if re.match(rf"^\s*{name}\s*(\(|:)", ln)), 0)


_SIMPLE: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint; TypeError naming the hint when there is none."""
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if hint is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _schema(args[0])
    if origin is Literal:
        return _enum(list(args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum([m.value for m in hint])
    if origin in (Union, types.UnionType):
        options = [_schema(a) for a in args]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if hint in (list, tuple, Sequence) or origin in (list, tuple, Sequence):
        if origin is tuple and args and args[-1] is not Ellipsis:
            raise TypeError(f"{hint} is a fixed-length tuple; use list[...] so it can be described")
        return {"type": "array", "items": _schema(args[0])} if args else {"type": "array"}
    if hint in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{hint} has keys that are not strings; JSON objects have string keys")
        return {"type": "object", "additionalProperties": _schema(args[1])} if args else {"type": "object"}
    raise TypeError(f"its type {getattr(hint, '__name__', hint)!r} has no JSON schema: use str, int, float, "
                    f"bool, a Literal, an Enum, or lists and dicts of those")


def _enum(values: list[Any]) -> dict[str, Any]:
    kinds = {_SIMPLE.get(type(v)) for v in values}
    return {"type": kinds.pop(), "enum": values} if len(kinds) == 1 and None not in kinds else {"enum": values}


# -- the configured tools -------------------------------------------------------------------


class Toolbox:
    """``llm.tools`` described, the choice and limits around them, and the running of calls."""

    def __init__(
        self,
        paths: Sequence[str] | None,
        *,
        choice: str = "auto",
        timeout_s: float = 10.0,
        max_rounds: int = 3,
        filler: str | None = None,
        filler_after_s: float = 1.0,
        group: str = "llm",
    ) -> None:
        self.tools: dict[str, Tool] = {}
        for path in paths or ():
            tool = describe(str(path), group)
            if tool.name in self.tools:
                raise ConfigError(f"{group}.tools names two tools called {tool.name!r} "
                                  f"({self.tools[tool.name].path}, {path}); the model could not tell them apart")
            self.tools[tool.name] = tool
        if named_tool(choice) is not None and choice not in self.tools:
            names = ", ".join(self.tools) or "none declared"
            raise ConfigError(f"{group}.tool_choice={choice!r} is neither auto, none, required nor the name of "
                              f"a tool in {group}.tools ({names})")
        if forces_call(choice) and not self.tools:
            raise ConfigError(f"{group}.tool_choice={choice!r} needs tools: list them in {group}.tools")
        for option, ok, expected in (("tool_timeout_s", timeout_s > 0, "seconds > 0"),
                                     ("max_tool_rounds", 1 <= max_rounds <= 20, "1 to 20"),
                                     ("tool_filler_after_s", filler_after_s >= 0, "seconds >= 0")):
            if not ok:
                raise ConfigError(f"{group}.{option} is out of range: expected {expected}")
        self.choice, self.timeout_s, self.max_rounds = choice, float(timeout_s), max_rounds
        self.filler = (filler or "").strip() or None
        self.filler_after_s = float(filler_after_s)
        self._wake = threading.Condition()
        self._calls = 0

    def __bool__(self) -> bool:
        """Whether requests carry tools at all."""
        return bool(self.tools) and self.choice != "none"

    def choice_for(self, round_index: int) -> str:
        """The tool choice of a turn's ``round_index``-th request: as configured for the first,
        ``auto`` after a tool result (a forced call every round would never end), ``none`` for
        the last allowed round, so the turn ends in words."""
        if round_index >= self.max_rounds:
            return "none"
        return self.choice if round_index == 0 else "auto"

    def new_id(self, turn: int) -> str:
        """An id for a call whose backend gives none (local chat templates)."""
        self._calls += 1
        return f"call_{turn}_{self._calls}"

    def from_server(
        self, calls: Iterable[Mapping[str, Any]], *, turn: int, sender: str,
        error: Callable[[str], Exception] = ValueError,
    ) -> Iterator[ToolCall]:
        """The calls a model server sent (``id``, ``name``, ``arguments`` as JSON text or an
        object) as :class:`ToolCall`; a missing id is made up. A call without a name is the
        sender's fault, raised as ``error``: there is nothing to run or to answer."""
        for call in calls:
            if not call.get("name"):
                raise error(f"{sender} sent a tool call without a function name: {str(dict(call))[:200]}")
            arguments = call.get("arguments") or ""
            yield ToolCall(id=call.get("id") or self.new_id(turn), name=call["name"],
                           arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))

    def wake(self) -> None:
        """Barge-in (from any thread): a wait for tools returns now; the caller checks why."""
        with self._wake:
            self._wake.notify_all()

    def run(
        self, calls: list[ToolCall], *, turn: int, cancelled: Callable[[], bool],
        record: Callable[..., None], log: Any,
    ) -> Iterator[str]:
        """Run a round's calls at once, each on its own thread; fill in every ``result``.

        Yields the filler sentence when the calls are still running after
        ``tool_filler_after_s`` (and one is configured). A call that raises, times out or is
        abandoned by a barge-in gets a result that says so.
        """
        start = time.monotonic()
        jobs = [self._start(call, turn) for call in calls]

        def done() -> bool:
            return cancelled() or all(job.finished.is_set() for job in jobs)

        deadline = start + self.timeout_s
        if self.filler is not None and self.filler_after_s < self.timeout_s:
            with self._wake:
                self._wake.wait_for(done, timeout=self.filler_after_s)
            if not done():
                yield self.filler + " "
        with self._wake:
            self._wake.wait_for(done, timeout=max(0.0, deadline - time.monotonic()))
        for call, job in zip(calls, jobs, strict=True):
            # Read once: a thread past its timeout may still finish and write its job meanwhile.
            status, result = (job.status, job.result) if job.finished.is_set() else \
                ("cancelled" if cancelled() else "timeout", "")
            if status == "timeout":
                result = (f"error: {call.name} did not finish within {self.timeout_s:g} s; tell the user it is "
                          "taking too long")
            elif status == "cancelled":
                result = "cancelled: the user interrupted before the tool finished"
            call.result = result
            seconds = (job.ended or time.monotonic()) - job.started
            record("tool_call", turn=turn, tool=call.name, call_id=call.id,
                   args_bytes=len(call.arguments.encode()), result_bytes=len(call.result.encode()),
                   t=job.started + seconds, seconds=round(seconds, 6), status=status)
            if status != "ok":
                log.warning("turn %d: tool %s: %s", turn, call.name, call.result)
            else:
                log.info("turn %d: tool %s(%s) took %.3f s", turn, call.name, call.arguments, seconds)

    def _start(self, call: ToolCall, turn: int) -> _Job:
        job = _Job()
        tool = self.tools.get(call.name)
        if not call.name:
            job.finish("error", 'error: the tool call could not be read; write it as JSON {"name": ..., '
                                f'"arguments": {{...}}}}: {call.arguments[:200]}')
            return job
        if tool is None:
            job.finish("error", f"error: there is no tool called {call.name!r}; the tools are "
                                f"{', '.join(self.tools) or 'none'}")
            return job
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            job.finish("error", f"error: the arguments are not valid JSON ({exc}): {call.arguments[:200]}")
            return job
        if not isinstance(arguments, dict):
            job.finish("error", f"error: the arguments must be a JSON object, not {call.arguments[:200]}")
            return job

        def work() -> None:
            try:
                value = tool.func(**arguments)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                job.finish("ok", _as_text(value))
            except Exception as exc:  # becomes the tool's result: the model talks about it
                job.finish("error", f"error: {type(exc).__name__}: {exc}")
            with self._wake:
                self._wake.notify_all()

        threading.Thread(target=work, name=f"tool-{call.name}-{turn}", daemon=True).start()
        return job


class _Job:
    """One call in flight; a thread that outlives its timeout writes here, and nobody reads it."""

    __slots__ = ("started", "ended", "status", "result", "finished")

    def __init__(self) -> None:
        self.started, self.ended = time.monotonic(), None
        self.status, self.result = "running", ""
        self.finished = threading.Event()

    def finish(self, status: str, result: str) -> None:
        self.ended, self.status, self.result = time.monotonic(), status, result
        self.finished.set()


async def _awaited(value: Any) -> Any:
    return await value


def _as_text(value: Any) -> str:
    """A tool's return value as the text the model reads; long ones are cut."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= RESULT_CHARS else text[:RESULT_CHARS] + " [cut]"


# -- the loop -----------------------------------------------------------------------------------


def answer_with_tools(
    request: Callable[[str], Iterator[str | ToolCall]],
    *,
    toolbox: Toolbox,
    exchange: Exchange,
    cancelled: Callable[[], bool],
    record: Callable[..., None],
    log: Any,
) -> Iterator[str]:
    """The reply to one turn as text pieces, running tool rounds until the model answers in text.

    ``request(tool_choice)`` makes one request on the conversation as it stands (the rounds
    so far included) and yields its text pieces, then the calls it asks for. Text said
    before a call is spoken at once and kept in that round; the rest of the reply follows.
    """
    said: list[str] = []  # text yielded since the last round (a filler included)
    for index in range(toolbox.max_rounds + 1):
        choice = toolbox.choice_for(index)
        calls: list[ToolCall] = []
        for piece in request(choice):
            if isinstance(piece, ToolCall):
                calls.append(piece)
            else:
                said.append(piece)
                yield piece
        if not calls or cancelled():
            return
        if choice == "none":
            log.warning("turn %d: the model asked for %s although no more tool rounds are left "
                        "(llm.max_tool_rounds=%d); the calls are not run", exchange.turn,
                        ", ".join(c.name for c in calls), toolbox.max_rounds)
            return
        exchange.rounds.append(ToolRound(text="".join(said), calls=calls))
        said = []
        for piece in toolbox.run(calls, turn=exchange.turn, cancelled=cancelled, record=record, log=log):
            said.append(piece)
            yield piece
        if cancelled():
            return
