"""Runs a validated graph: one thread per node, bounded rings between them.

Life of a run:
1. every node's ``setup()`` runs in parallel, with a live progress line; then the garbage
   collector is settled for the run (unless ``own_gc=False``: it acts on the whole process,
   so a server running many sessions at once settles it itself, once);
2. for each conversation the source offers (``sessions()``: one per input file), rings are
   wired and one thread per node moves data; end of stream closes the source's rings and
   drains the graph in order, so the session ends by itself with every reply written. The
   next conversation is a session of its own, like a server's next connection: its nodes are
   closed, a fresh instance of the graph (``Graph.instance()``) is set up, the models it
   shares stay loaded (``keep_shared``), and its turns go on rising in the run's one trace;
3. ``close()`` on every node, once.

A node that raises stops the graph: rings are closed, blocked threads are woken, nodes
still busy are closed to unblock them, and the error names the node; whatever ends a
node's thread counts, so nothing dies unreported. SIGINT and SIGTERM stop the same way,
also while setups still load: a ``setup()`` stalled in a download cannot be killed, so its
thread is a daemon that is left behind, never waited for. A second signal while stopping
gives up on the nodes' ``close()`` and leaves at once.

Barge-in is :meth:`Scheduler.interrupt`: the epoch moves to the new turn, stale messages
are flushed from every ring and dropped at every hop, and each node's ``on_interrupt`` is
called so it can close a stream at once.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from types import GeneratorType
from typing import Any

from s2s_flow import cpu, rings
from s2s_flow.errors import NodeFailed, Stopped
from s2s_flow.graph import Graph, NodeSpec
from s2s_flow.messages import Message
from s2s_flow.node import Context, SessionHooks, keep_shared
from s2s_flow.rings import Ring, RingClosed, wake_all
from s2s_flow.startup import set_up_all
from s2s_flow.trace import NodeTurn, Trace

__all__ = ["Scheduler"]

_STOP = object()  # control item: leave the loop now
_now = time.monotonic
BATCH_BUDGET_S = 0.001  # returned outputs wait at most this long for their batch to finish
_Batch = tuple[Ring, list[Message], list[float]]  # what an inbox hands over per ring: items, put times


class _Running:
    """One node at run time: its inbox, its output rings by port, its trace table."""

    def __init__(self, spec: NodeSpec, trace: Trace):
        assert spec.node is not None, "validate() builds the nodes"
        self.name, self.spec, self.node = spec.name, spec, spec.node
        self.table: dict[int, NodeTurn] = trace.node(spec.name)
        self.inbox = rings.Inbox()
        self.outputs: dict[str, list[Ring]] = {}
        self.thread: threading.Thread | None = None
        self.port_of = {typ: port for port, typ in spec.cls.outputs.items()}

    def port_for(self, typ: type) -> str:
        """The output port a message of this type leaves by (checked once per type)."""
        port = self.port_of.get(typ)
        if port is None:
            port = next((p for t, p in self.port_of.items() if issubclass(typ, t)), None)
            if port is None:
                raise TypeError(f"{self.spec.cls.__name__} yielded a {typ.__name__}, which none of "
                                f"its outputs ({', '.join(self.spec.cls.outputs) or 'none'}) carries")
            self.port_of[typ] = port
        return port

    def route(self, item: Any) -> tuple[str, Message]:
        """A bare message goes out by its type; a ``(port, message)`` pair by the port it names."""
        if type(item) is not tuple:
            return self.port_of.get(type(item)) or self.port_for(type(item)), item
        port, msg = item
        if port not in self.spec.cls.outputs:
            raise TypeError(f"{self.spec.cls.__name__} yielded to port {port!r}; its outputs are "
                            f"{', '.join(self.spec.cls.outputs) or 'none'}")
        return port, msg

    def by_port(self, batch: list[Any]) -> dict[str, list[Message]]:
        """Group a batch of outputs per port, keeping their order (one port, one type: no copy)."""
        types = set(map(type, batch))
        if tuple not in types:
            ports = {self.port_for(t) for t in types}
            if len(ports) == 1:
                return {ports.pop(): batch}
        grouped: dict[str, list[Message]] = {}
        for item in batch:
            port, msg = self.route(item)
            grouped.setdefault(port, []).append(msg)
        return grouped


class Scheduler:
    def __init__(self, graph: Graph, run_dir: Path, *, console: Any = None, trace: Trace | None = None,
                 own_gc: bool = True, session: SessionHooks | None = None):
        self.graph, self.run_dir, self.console = graph, Path(run_dir), console
        self.own_gc = own_gc  # the run may collect and freeze the process's garbage (it is the only one)
        self.session = session  # what a server's session decides about its turns (ctx.session)
        self.trace = trace or Trace()
        self.ring_stats: dict[str, dict[str, Any]] = {}
        self._epoch = 0
        self._epoch_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = False  # mirrors _stopping; a plain read on the hot path
        self._error: tuple[str, BaseException] | None = None
        self._stop_reason: str | None = None
        self._closed: set[str] = set()
        self._abandoned = False  # a second signal: leave without waiting for close()
        self._in_setup: list[str] = []  # nodes whose setup() had not returned when the run stopped
        self._progress: dict[str, str] = {}
        self._run_state: dict[str, Any] = {}  # the session's ctx.run_state (one dict for all its nodes)
        self._runs = self._bind(graph)

    def _bind(self, graph: Graph) -> dict[str, _Running]:
        """Give each node of ``graph`` its Context; turn numbers go on from the last session's."""
        turns = self._run_state.get("turns")
        self._run_state = {} if turns is None else {"turns": turns}
        runs = {name: _Running(spec, self.trace) for name, spec in graph.nodes.items()}
        live = any(run.spec.cls.live for run in runs.values() if not run.spec.cls.inputs)
        for run in runs.values():
            run.node.ctx = Context(run.name, self.run_dir, epoch=lambda: self._epoch,
                                   interrupt=self.interrupt, stopping=self._stopping,
                                   progress=lambda text, n=run.name: self._set_progress(n, text),
                                   run_state=self._run_state, record=self.trace.event, session=self.session,
                                   live=live)
            run.node.ctx.inputs_connected = frozenset(e.dst_port for e in graph.inputs_of(run.name))
        return runs

    # -- control -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def interrupt(self, turn: int, reason: str = "barge-in") -> None:
        """Make every turn before ``turn`` stale, everywhere, now."""
        with self._epoch_lock:
            if turn <= self._epoch:
                return
            self._epoch = turn
        dropped = 0
        for run in self._runs.values():
            for ring in run.inbox.rings:
                dropped += ring.flush(lambda m: 0 < m.turn < turn)
        for run in self._runs.values():
            try:
                run.node.on_interrupt(turn)
            except Exception as exc:  # a node that cannot stop is a failed node
                self._fail(run.name, exc)
            run.inbox.post_control(("interrupt", turn))
        self.trace.event("interrupt", turn=turn, reason=reason, dropped=dropped)

    def stop(self, reason: str) -> None:
        """Stop every node promptly (signal, or another node failed)."""
        if self._stopping.is_set():
            return
        self._stop_reason = reason
        self._stopped = True
        self._stopping.set()
        for run in self._runs.values():
            for ring in run.inbox.rings:
                ring.close(discard=True)
            run.inbox.post_control(_STOP)

    def _fail(self, name: str, exc: BaseException) -> None:
        if self._error is None:
            self._error = (name, exc)
            self.trace.event("error", node=name, error=f"{type(exc).__name__}: {exc}")
        self.stop(f"node {name} failed")

    # -- running -------------------------------------------------------------------------

    def run(self) -> Trace:
        """Set up, run every conversation, close. Raises NodeFailed or Stopped."""
        restore = self._install_signal_handlers()
        try:
            with keep_shared():  # loaded once for every session of the run
                self._setup_all()
                source = self._driver()
                sessions = source.node.sessions() if source else [""]
                for i, name in enumerate(sessions):
                    if self._stopping.is_set():
                        break
                    if i:
                        self._next_instance()
                    self._run_session(i, name)
            self._raise_if_failed()
            return self.trace
        finally:
            try:
                if self.own_gc:
                    gc.unfreeze()
                self._close_all()
            finally:
                restore()

    def _next_instance(self) -> None:
        """The next conversation gets a graph of its own: nothing of the last one's state
        (history, VAD state, an interrupt's epoch) can cross into it."""
        self._close_all()
        self._closed.clear()
        self._epoch = 0
        self.graph = self.graph.instance()
        self._runs = self._bind(self.graph)
        self._setup_all()

    def _driver(self) -> _Running | None:
        sources = [r for r in self._runs.values() if not r.spec.cls.inputs]
        return sources[0] if sources else None

    def _set_progress(self, name: str, text: str) -> None:
        self._progress[name] = text

    def _setup_all(self) -> None:
        """Every ``setup()`` at once (s2s_flow/startup.py); a failure stops the run and names the node."""
        def returned(name: str, exc: BaseException | None, seconds: float) -> None:
            if exc is not None and not self._stopping.is_set():
                self._fail(name, exc)
            error = {"error": f"{type(exc).__name__}: {exc}"} if exc is not None else {}
            self.trace.event("setup", node=name, seconds=round(seconds, 3), **error)

        self._in_setup = set_up_all({name: run.node for name, run in self._runs.items()}, stopping=self._stopping,
                                    progress=self._progress, returned=returned, console=self.console)
        self._raise_if_failed()
        if self.own_gc:
            # Loading models leaves much garbage and many long-lived objects: collect it now,
            # not during the first turn, and keep what setup built out of later collections,
            # so a collection mid-conversation stays short (the last session's frozen objects
            # are let go first).
            gc.unfreeze()
            gc.collect()
            gc.freeze()

    def _run_session(self, index: int, name: str) -> None:
        turns_before = set(self.trace.turns())
        for run in self._runs.values():
            run.node.ctx.conversation = name
        wired = []
        for edge in self.graph.edges:
            ring = rings.Ring(edge.capacity, edge.policy, inbox=self._runs[edge.dst].inbox, name=edge.key)
            ring.dst_port = edge.dst_port  # type: ignore[attr-defined]
            self._runs[edge.src].outputs.setdefault(edge.src_port, []).append(ring)
            wired.append((edge, ring))
        self.trace.event("session", index=index, conversation=name)
        for run in self._runs.values():
            loop = self._source_loop if not run.spec.cls.inputs else self._node_loop
            run.thread = threading.Thread(target=self._guarded, args=(loop, run), name=f"node:{run.name}",
                                          daemon=True)
            run.thread.start()
        self._wait_threads()
        for edge, ring in wired:
            s = ring.stats()
            acc = self.ring_stats.setdefault(edge.key, {"capacity": s.capacity, "policy": s.policy, "puts": 0,
                                                        "drops": 0, "high_water": 0, "blocked_s": 0.0})
            acc["puts"] += s.puts
            acc["drops"] += s.drops
            acc["high_water"] = max(acc["high_water"], s.high_water)
            acc["blocked_s"] = round(acc["blocked_s"] + s.blocked_s, 6)
        for turn in set(self.trace.turns()) - turns_before:
            self.trace.conversations[turn] = name

    def _wait_threads(self) -> None:
        threads = [r.thread for r in self._runs.values() if r.thread is not None]
        while any(t.is_alive() for t in threads):
            if self._stopped:
                self._join_stopping()
                return
            for t in threads:
                t.join(0.1)  # short joins keep the main thread responsive to signals
                if self._stopping.is_set():
                    break

    def _join_stopping(self) -> None:
        """After stop(): give threads a moment, then close nodes still busy to unblock them."""
        deadline = time.monotonic() + 0.3
        for run in self._runs.values():
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
        for run in self._runs.values():
            if run.thread is not None and run.thread.is_alive():
                self._close(run)
        deadline = time.monotonic() + 0.6
        for run in self._runs.values():
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))

    def _guarded(self, loop: Callable[[_Running], None], run: _Running) -> None:
        """A node's thread: whatever ends it with an exception (even in a loop's cleanup) fails the
        run and names the node, rather than reaching threading.excepthook; its CPU time goes to
        the node's (s2s_flow/cpu.py)."""
        try:
            loop(run)
        except BaseException as exc:
            self._fail(run.name, exc)
        finally:
            cpu.thread_ended(run.name)

    def _source_loop(self, run: _Running) -> None:
        wakes: list[Any] = []
        try:
            self._emit(run, run.node.produce(), wakes)
            if not self._stopping.is_set():
                self._emit(run, run.node.finish(), wakes)
        except RingClosed as exc:
            if not self._stopped:  # only stop() closes a ring under a running source
                self._fail(run.name, exc)
        except BaseException as exc:
            self._fail(run.name, exc)
        finally:
            wake_all(wakes)
            self._close_outputs(run)

    def _node_loop(self, run: _Running) -> None:
        """Feed the node every message of each batch its inbox hands over.

        Outputs a node *returns* are forwarded per batch, one lock per ring (within
        ``BATCH_BUDGET_S``); outputs it *yields* stream out one by one as they come, so a
        streaming stage (LLM tokens, TTS sentences) is never held back. The trace records
        whole batches: this loop is the engine's hot path.
        """
        node, table, process, wait = run.node, run.table, run.node.process, run.inbox.wait
        received = self.trace.received
        pending: list[Any] = []
        wakes: list[Any] = []  # consumers of the last batch, woken just before this thread sleeps
        try:
            while True:
                control, data, done = wait(None, wakes)
                if _STOP in control or self._stopped:
                    return
                if done:
                    self._emit(run, node.finish(), wakes)
                    return
                now = started = _now()  # one clock read per batch: the batch arrived at once
                if self._epoch:
                    data = self._fresh(data)
                for ring, items, put_times in data:
                    received(table, items, put_times, now)
                    port = ring.dst_port
                    for msg in items:
                        if 0 < msg.turn < self._epoch:
                            continue  # stale: an interrupt moved past its turn while this batch ran
                        if pending and _now() - started > BATCH_BUDGET_S:
                            self._forward(run, pending, wakes)
                            rings.wake_now(wakes)
                            started = _now()
                        out = process(port, msg)
                        if out is not None:
                            if type(out) is GeneratorType:
                                self._forward(run, pending, wakes)
                                rings.wake_now(wakes)  # before the stream's first step, which may wait
                                self._emit(run, out, wakes)
                            elif isinstance(out, Message):
                                pending.append(out)
                            else:
                                pending.extend(out)
                        if self._stopped:
                            return
                self._forward(run, pending, wakes)
        except RingClosed as exc:
            if not self._stopped:  # only stop() closes a ring under a running node
                self._fail(run.name, exc)
        except BaseException as exc:
            self._fail(run.name, exc)
        finally:
            wake_all(wakes)
            self._close_outputs(run)

    def _fresh(self, data: list[_Batch]) -> list[_Batch]:
        """Drop the messages of turns an interrupt made stale."""
        epoch, fresh = self._epoch, []
        for ring, items, put_times in data:
            kept = [(m, t) for m, t in zip(items, put_times, strict=True) if not 0 < m.turn < epoch]
            if kept:
                fresh.append((ring, [m for m, _ in kept], [t for _, t in kept]))
        return fresh

    def _forward(self, run: _Running, pending: list[Any], wakes: list[Any]) -> None:
        """Send collected outputs, one lock per output ring, then clear the list.

        The consumers' wake-ups are added to ``wakes``, to be done later: at the end of a
        batch, by this thread's next ``Inbox.wait`` as it blocks; mid-batch, by the caller
        at once (``wake_now``).
        """
        if not pending:
            return
        if len(pending) == 1:  # the common live case
            msg = pending.pop()
            port = run.port_of.get(type(msg))  # None for a (port, message) pair or a new type
            if port is None:
                port, msg = run.route(msg)
            if not 0 < msg.turn < self._epoch:
                self.trace.emitted(run.table, (msg,), _now())
                for ring in run.outputs.get(port, ()):
                    ring.put(msg, wakes)
            return
        grouped = run.by_port(pending[:])
        pending.clear()
        epoch, now = self._epoch, _now()
        for port, msgs in grouped.items():
            if epoch:
                msgs = [m for m in msgs if not 0 < m.turn < epoch]
                if not msgs:
                    continue
            self.trace.emitted(run.table, msgs, now)
            for ring in run.outputs.get(port, ()):
                ring.put_many(msgs, wakes)

    def _emit(self, run: _Running, out: Iterable[Any] | Message | None, wakes: list[Any]) -> None:
        """Send outputs one by one as they are made (sources, streaming generators, finish()).

        Each output wakes its consumers at once (``wake_now``): the stream's next step may be
        a long wait (a network read, a paced source).
        """
        if out is None:
            return
        if isinstance(out, Message):
            out = (out,)
        table, emitted, outputs, port_of = run.table, self.trace.emitted, run.outputs, run.port_of
        wake_now = rings.wake_now
        for msg in out:
            port = port_of.get(type(msg))  # None for a (port, message) pair or a new type
            if port is None:
                port, msg = run.route(msg)
            if 0 < msg.turn < self._epoch or self._stopped:
                if isinstance(out, Generator):
                    out.close()  # e.g. closes a streaming HTTP request of an interrupted turn
                return
            emitted(table, (msg,), _now())
            for ring in outputs.get(port, ()):
                ring.put(msg, wakes)
            if wakes:
                wake_now(wakes)

    def _close_outputs(self, run: _Running) -> None:
        for port_rings in run.outputs.values():
            for ring in port_rings:
                ring.close()

    # -- teardown ------------------------------------------------------------------------

    def _close(self, run: _Running) -> None:
        if run.name in self._closed or self._abandoned:
            return
        self._closed.add(run.name)
        try:
            run.node.close()
        except Exception as exc:
            if self._abandoned:  # the second signal's Stopped, raised inside a close() that hung
                raise
            self.trace.event("close_error", node=run.name, error=f"{type(exc).__name__}: {exc}")

    def _close_all(self) -> None:
        for run in reversed(list(self._runs.values())):
            self._close(run)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            name, exc = self._error
            raise NodeFailed(name, exc) from exc
        if self._stop_reason is not None:
            stalled = self._stalled_setups()
            raise Stopped(f"stopped by {self._stop_reason}{' while ' + stalled if stalled else ''}; what was "
                          "already written is kept")

    def _stalled_setups(self) -> str:
        if not self._in_setup:
            return ""
        names = ", ".join(f"'{n}'" for n in self._in_setup)
        return (f"the setup() of {names} had not returned (a model load, a download or a server that does "
                "not answer)")

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if not self._stopping.is_set():
                self.stop(name)
                return
            # Asked again while stopping: give up on nodes still closing and leave now.
            self._abandoned = True
            why = [f"node '{self._error[0]}' had failed: {self._error[1]}"] if self._error else []
            why += [self._stalled_setups()] if self._in_setup else []
            raise Stopped(f"stopped by {name} a second time: left without waiting for the nodes to close"
                          + "".join(f"; {w}" for w in why))

        for sig in previous:
            signal.signal(sig, handler)
        return lambda: [signal.signal(sig, h) for sig, h in previous.items()]
