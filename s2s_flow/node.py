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

Sessions and shared resources. One node instance serves one session (a conversation: a
WebSocket connection of ``io=realtime``, the microphone, one file of a batch): everything on
``self`` is per session (VAD state, history, playback position). What is heavy and
stateless (weights, ONNX / CTranslate2 sessions) is loaded by ``load_shared()`` and reached
through ``self.shared()`` in ``setup()``: it is loaded once per process for each
``shared_key()`` and every session that asks gets the same object, from its own thread, so
a backend states in ``shared_safety`` how it may be used::

    shared_safety = "thread-safe"                   # or "locked: ..." / "per session: ..."
    def shared_key(self): return (self.model, self.compute_type)
    def load_shared(self): return WhisperModel(...)   # no per-session state in here
    def setup(self): self._whisper = self.shared()

The cache holds resources weakly: they live while a session's node (or a server that keeps
them warm: :func:`keep_shared`) holds them, and are freed with the last one. A heavy helper
that is not the node's own resource (the turn model a VAD may consult) goes through the same
cache with :func:`shared`: ``shared((__name__, threads), lambda: SmartTurn(threads))``.

Shared inference. A shared model that sessions call into (Whisper, a Piper voice, Smart Turn, a
local LLM) is contended: with many sessions, what a listener waits for must go first. A backend
declares it with ``inference_key()`` (the model's name in the schedulers and /metrics) and
``inference_slots()`` (how many calls it runs at once, default 1), and makes each call inside
``self.inference_slot(kind, turn=...)`` (s2s_flow/inference.py: the kinds and their order)::

    def inference_key(self): return f"whisper:{self.model}"
    def inference_slots(self): return self._workers
    with self.inference_slot("first", turn=msg.turn):     # a speculative turn's work is
        text = self._whisper.transcribe(audio)             # "speculative" until confirmed

The stage base classes do this for their backends (every STT's decode, every TTS's synthesis),
so a backend only names its model; a backend without a key (a remote server) is not scheduled.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from s2s_flow import inference
from s2s_flow.errors import MissingDependency
from s2s_flow.messages import Message

__all__ = ["Node", "Context", "SessionHooks", "Serving", "joined_ports", "require", "shared", "keep_shared",
           "SettingRefused", "TurnSettings", "Voiced", "Instructed", "SessionTools"]


class SessionHooks:
    """What the session a node serves decides about its turns, read through ``ctx.session``.

    A plain run (files, the microphone) lets every turn through. A server's session (io=realtime)
    holds a turn until its client asks for the response, speaks only the responses that have
    audio, and shows the LLM its history as the client edited it. Nodes ask; the session decides::

        if not self.ctx.session.answers(msg.turn): return       # an LLM, for each user turn
        if not self.ctx.session.speaks(msg.turn): return        # a TTS, for each reply
        request = self.ctx.session.history(self.conversation)   # an LLM, for each request
    """

    def answers(self, turn: int) -> bool:
        """Whether the LLM replies to this user turn now (False: the session starts it later)."""
        return True

    def speaks(self, turn: int) -> bool:
        """Whether this turn's reply is synthesized (False: a text-only response)."""
        return True

    def history(self, conversation: Any) -> Any:
        """What the LLM sends of ``conversation`` in its next request: itself, or a view of it."""
        return conversation

    def usage(self, turn: int, usage: dict[str, Any]) -> None:
        """A request's token counts, as the model's server reported them (one per request)."""

    def stage_failed(self, stage: str, turn: int, message: str) -> None:
        """A stage's endpoint failed on ``turn`` in a live run and the session goes on (the node
        has logged it and recorded it in the trace): a server's session tells its client."""


# -- what a session may change in its own nodes ----------------------------------------------
# A server's session (io=realtime) changes settings of its own graph's nodes mid-conversation:
# the client's turn detection, voice, instructions and tools. It finds the nodes by these declared
# interfaces (``isinstance(node, TurnSettings)``), never by their attributes, and changes them only
# through these methods. A node that implements none is simply left as configured.


class SettingRefused(ValueError):
    """A session setting a node cannot take; ``setting`` names it (e.g. ``silence_duration_ms``)
    and the message says what it takes instead."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


@runtime_checkable
class TurnSettings(Protocol):
    """A VAD whose end-of-turn settings a session may change, in the Realtime API's names:
    ``threshold`` (speech probability), ``silence_duration_ms``, ``prefix_padding_ms``."""

    def turn_settings(self) -> dict[str, Any]:
        """The three settings as the node has them now."""
        ...

    def fit_turn_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The settings the node would use for ``settings`` (lowered where it must); SettingRefused
        for one it cannot take."""
        ...

    def apply_turn_settings(self, settings: dict[str, Any]) -> None:
        """Use fitted settings from now on (called from the node's upstream thread)."""
        ...


@runtime_checkable
class Voiced(Protocol):
    """A TTS that names its voice and may switch to another within the session."""

    @property
    def voice_name(self) -> str:
        """The voice it speaks with, by name."""
        ...

    def use_voice(self, name: str) -> bool:
        """Speak with ``name`` from the next sentence on; False (voice unchanged) if it cannot."""
        ...


@runtime_checkable
class Instructed(Protocol):
    """An LLM whose system prompt a session may replace (the client's instructions)."""

    def instructions(self) -> str | None:
        """The system prompt in use (None: none)."""
        ...

    def set_instructions(self, text: str | None) -> None:
        """The system prompt of every request from now on (None or empty: none)."""
        ...


@runtime_checkable
class SessionTools(Protocol):
    """An LLM that calls a session's own tools beside its configured ones (a client's functions)."""

    def set_session_tools(self, tools: Sequence[Mapping[str, Any]], call: Callable[[str, dict[str, Any]], str],
                          choice: str | None) -> None:
        """The session's tools (``name``, ``description``, ``parameters`` each; they replace the last
        ones), run by ``call(name, arguments)``, and the tool choice (None: unchanged); SettingRefused
        ("tool_choice") for a choice naming no tool."""
        ...

    def round_calls(self) -> list[tuple[str, Any]]:
        """(name, arguments) of each call of the tool round being answered now."""
        ...


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
        run_state: dict[str, Any] | None = None,
        record: Callable[..., None] | None = None,
        session: SessionHooks | None = None,
        live: bool = False,
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
        #: one dict for every node of a session's graph: state its nodes must share (e.g. what the
        #: speaker really played, read by the LLM to keep only what was heard after a barge-in).
        #: Not to be confused with :meth:`Node.shared`, a resource shared by the whole process.
        self.run_state: dict[str, Any] = {} if run_state is None else run_state
        self._record = record
        #: the session's decisions about its turns (a server's connection; a plain run's default)
        self.session = session or SessionHooks()
        #: someone hears the run as it happens (its source is ``live``: the microphone, a server's
        #: client): a stage whose endpoint fails then costs its turn, not the session
        self.live = live

    @property
    def work(self) -> inference.Session:
        """The session's side of the shared models' schedulers (its speculative turns), one for
        every node of the session."""
        with _TURN_LOCK:
            return self.run_state.setdefault("inference", inference.Session(self.conversation))

    @property
    def epoch(self) -> int:
        """Messages of turns below the epoch are stale (an interrupt bumped it)."""
        return self._epoch()

    def new_turn(self) -> int:
        """A turn number above every one given out in this run (the VAD's utterances, a
        server's typed-in messages): turns must rise for the epochs to mean anything."""
        with _TURN_LOCK:
            turn = self.run_state["turns"] = self.run_state.get("turns", 0) + 1
        return turn

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
    #: sources only: a person hears the run as it happens (the microphone, a server's client), so
    #: an endpoint failure costs one turn (a spoken fallback, an error event), not the session;
    #: a file run fails as a whole instead (``ctx.live`` tells every node of the graph)
    live: ClassVar[bool] = False

    #: how the sessions' threads may use what ``load_shared()`` returns: "thread-safe",
    #: "locked: <why>" (the backend serialises calls), or "per session: <why>" (nothing shared)
    shared_safety: ClassVar[str] = "per session: nothing heavy to share"

    ctx: Context

    def shared_key(self) -> Hashable | None:
        """The parameters that decide ``load_shared()``'s result; None: nothing is shared."""
        return None

    def load_shared(self) -> Any:
        """Load the heavy, stateless part (weights, an inference session); once per process per
        ``shared_key()``. Must return an object that can be weakly referenced."""
        raise NotImplementedError(f"{type(self).__name__} declares a shared_key() but no load_shared()")

    def shared(self) -> Any:
        """What ``load_shared()`` made for this node's ``shared_key()``: loaded by the first session
        that asks (the others wait for it), the same object for all of them after."""
        return shared((type(self).__module__, type(self).__qualname__, self.shared_key()), self.load_shared)

    def inference_key(self) -> str | None:
        """The shared model this node's calls go to, by name (its scheduler; /metrics shows it);
        None: nothing shared to schedule (a remote server, a light engine)."""
        return None

    def inference_slots(self) -> int:
        """How many calls the shared model runs at once (known after ``setup()``)."""
        return 1

    def inference_slot(self, kind: str = "first", *, turn: int | None = None, deadline: float | None = None,
                       cancelled: Callable[[], bool] | None = None) -> contextlib.AbstractContextManager[str]:
        """A slot of the shared model for one call (blocking; a free slot costs a lock), or a no-op
        for a node with no ``inference_key()``; raises ``inference.Shed`` for speculative or partial
        work under load, ``inference.Cancelled`` once ``cancelled()`` (a barge-in) while it waits."""
        key = self.inference_key()
        if key is None:
            return contextlib.nullcontext(kind)
        return inference.scheduler(key, self.inference_slots()).slot(
            kind, deadline=deadline, session=self.ctx.work, turn=turn, cancelled=cancelled)

    def port_rate(self, port: str) -> int | None:
        """Sample rate of an audio port, if fixed by the parameters (checked across edges)."""
        return None

    def setup(self) -> None:
        """Load models, open clients, warm up. Runs before any data flows."""

    def sessions(self) -> list[str]:
        """Sources only: the conversations to play, one after another (e.g. one per input
        file). Each is a session of its own: a fresh instance of the graph (``Graph.instance()``:
        new nodes, set up again, the shared parts kept loaded), ``ctx.conversation`` naming it."""
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


# -- what only some nodes do ------------------------------------------------------------------
# The engine asks for these by name; a node that does not declare them does not do it.


@runtime_checkable
class Serving(Protocol):
    """A source that serves sessions itself (io=realtime): s2s-run hands it the run instead of
    running the graph, and it builds one graph per session with ``make_graph()`` (a fresh
    ``Graph.instance()``: new nodes, the shared models kept loaded)."""

    #: where it listens (a URL), for a dry run to print
    serves: str

    def serve(self, make_graph: Callable[[], Any], run_dir: Path, *, console: Any = None) -> dict[str, Any]:
        """Serve until stopped; returns the job's figures (as a run's metrics do)."""
        ...


def joined_ports(cls: type[Node]) -> frozenset[str]:
    """The output ports whose messages also join the stream of their type further down the chain
    (class data ``joins``): the first stage that takes that type from a later producer takes these
    too, so a server's typed-in user messages reach the LLM beside the STT's transcripts."""
    return getattr(cls, "joins", frozenset())


_TURN_LOCK = threading.Lock()
_SHARED_LOCK = threading.Lock()
_SHARED: weakref.WeakValueDictionary[Any, Any] = weakref.WeakValueDictionary()
_LOADING: dict[Any, threading.Lock] = {}
_KEEPERS: list[list[Any]] = []


def shared(key: Hashable, load: Callable[[], Any]) -> Any:
    """The process-wide object for ``key``: ``load()`` runs for the first caller (the others
    wait for it), every caller after gets the same object while someone holds it. ``key``
    must name its owner (a module, a class) so that two owners never meet; ``load()`` must
    return an object that can be weakly referenced. ``Node.shared()`` is this, keyed by class."""
    with _SHARED_LOCK:
        lock = _LOADING.setdefault(key, threading.Lock())
    with lock:
        value = _SHARED.get(key)
        if value is None:
            value = load()
            _SHARED[key] = value
    with _SHARED_LOCK:
        for keep in _KEEPERS:
            if not any(held is value for held in keep):
                keep.append(value)
    return value


@contextlib.contextmanager
def keep_shared() -> Iterator[list[Any]]:
    """Keep every shared resource asked for inside the block alive, also between sessions (a
    server keeps its models warm while it serves); yields the list that holds them."""
    held: list[Any] = []
    with _SHARED_LOCK:
        _KEEPERS.append(held)
    try:
        yield held
    finally:
        with _SHARED_LOCK:
            _KEEPERS[:] = [keep for keep in _KEEPERS if keep is not held]  # by identity: two may hold the same
        held.clear()


def require(module: str, extra: str, *, pip_name: str | None = None) -> Any:
    """Import a backend's heavy library, or fail with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(module, extra, pip_name=pip_name, cause=exc) from exc
