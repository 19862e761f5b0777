"""The node contract.

A node declares its ports as class data, so the graph can be wired and validated from
the class alone, without building a model::

    class WhisperSTT(Node):
        inputs = {"audio": Speech}
        outputs = {"text": Transcript}

        def __init__(self, *, model: str = "tiny.en"): ...   # cheap: checks parameters
        def setup(self) -> None: ...                          # loads the model
        def process(self, port, msg):                         # yields output messages
            yield Transcript(turn=msg.turn, text=...)

Each node runs on its own thread. ``__init__`` must stay cheap and import nothing heavy;
heavy libraries are imported in ``setup()`` through :func:`require`, so a missing one is
reported with its install command only for the backend that was chosen.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from s2s_flow.errors import MissingDependency
from s2s_flow.messages import Message

__all__ = ["Node", "Context", "require"]


class Context:
    """What the engine gives a running node: its name, the run dir, the epoch, interrupts."""

    def __init__(
        self,
        name: str,
        run_dir: Path,
        *,
        epoch: Callable[[], int] = lambda: 0,
        interrupt: Callable[[int, str], None] | None = None,
        stopping: threading.Event | None = None,
        progress: Callable[[str], None] | None = None,
        shared: dict[str, Any] | None = None,
        record: Callable[..., None] | None = None,
    ) -> None:
        self.name = name
        self.run_dir = run_dir
        self.conversation = ""  # name of the conversation being played (e.g. the input file)
        self.inputs_connected: frozenset[str] = frozenset()  # input ports wired in this graph
        self.log = logging.getLogger(f"s2s_flow.{name}")
        self._epoch = epoch
        self._interrupt = interrupt
        self.stopping = stopping or threading.Event()
        self._progress = progress
        #: one dict for every node of a run: state nodes must share (e.g. what the speaker
        #: really played, read by the LLM to keep only what was heard after a barge-in)
        self.shared: dict[str, Any] = {} if shared is None else shared
        self._record = record

    @property
    def epoch(self) -> int:
        """Messages of turns below the epoch are stale (an interrupt bumped it)."""
        return self._epoch()

    def interrupt(self, turn: int, reason: str = "barge-in") -> None:
        """Declare every turn before ``turn`` stale: rings are flushed, nodes told."""
        if self._interrupt is not None:
            self._interrupt(turn, reason)

    def record(self, kind: str, **fields: Any) -> None:
        """Add a rare event to the run's trace (a tool call: what ran, for how long), for the metrics."""
        if self._record is not None:
            self._record(kind, node=self.name, **fields)

    def progress(self, text: str) -> None:
        """Show what a slow ``setup()`` is doing (download, load, warm-up)."""
        if self._progress is not None:
            self._progress(text)
        else:
            self.log.info(text)


class Node:
    """Base class of every stage. Ports and capabilities are class attributes."""

    #: input port -> message type accepted on it
    inputs: ClassVar[dict[str, type[Message]]] = {}
    #: output port -> message type produced on it
    outputs: ClassVar[dict[str, type[Message]]] = {}
    #: inputs that may stay unconnected (all others are required)
    optional_inputs: ClassVar[frozenset[str]] = frozenset()
    #: inputs that observe the nearest upstream producer of their type even when a stage
    #: in between consumed it (sinks and loggers that record transcripts and replies)
    taps: ClassVar[frozenset[str]] = frozenset()
    #: per output port (capacity, policy) overriding the message type's default ring
    port_rings: ClassVar[dict[str, tuple[int, str]]] = {}
    #: parameters that hold secrets: never printed, logged or written to the run dir (the
    #: engine masks exactly these, by name: s2s_flow/redact.py)
    secret_params: ClassVar[frozenset[str]] = frozenset()

    ctx: Context

    def port_rate(self, port: str) -> int | None:
        """Sample rate of an audio port, if fixed by the parameters (checked across edges)."""
        return None

    def reset(self) -> None:
        """A new conversation starts (next file of a batch): forget history and state."""

    def setup(self) -> None:
        """Load models, open clients, warm up. Runs before any data flows."""

    def sessions(self) -> list[str]:
        """Sources only: the conversations to play, one after another (e.g. one per input
        file). Before each, every node is ``reset()`` and ``ctx.conversation`` names it."""
        return [""]

    def produce(self) -> Iterator[Message]:
        """Sources only (nodes without inputs): yield messages until the input ends."""
        raise NotImplementedError(f"{type(self).__name__} has no inputs and must implement produce()")

    def process(self, port: str, msg: Message) -> Iterable[Message] | None:
        """Handle one message that arrived on ``port``; yield (or return) output messages.

        A yielded ``(port, message)`` pair names the output port explicitly; a bare
        message goes to the output port declared with its type.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement process()")

    def finish(self) -> Iterable[Message] | None:
        """End of stream: every input is drained. Yield what is still buffered."""
        return None

    def on_interrupt(self, turn: int) -> None:
        """Barge-in. Called from the interrupting thread: be quick and thread-safe
        (close a stream, set a flag). The engine already drops stale messages."""

    def close(self) -> None:
        """Release resources. Called once, also after errors; may run while process() is blocked."""


def require(module: str, extra: str, *, pip_name: str | None = None) -> Any:
    """Import a backend's heavy library, or fail with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(module, extra, pip_name=pip_name, cause=exc) from exc
