"""Small real nodes for engine tests: a counting source, pass-through, a collecting sink,
and nodes that fail or block on purpose (faults no real backend produces on demand)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nodes.io.wav import WavSink
from s2s_flow.messages import AudioChunk, AudioOut, Message, TextDelta, Transcript
from s2s_flow.node import Node
from s2s_flow.rings import RingClosed


class CountSource(Node):
    outputs = {"text": Transcript}

    def __init__(self, *, n: int = 10, turns: int = 1, sessions: list[str] | None = None):
        self.n, self.turns, self._sessions = n, turns, sessions or [""]

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def produce(self) -> Iterator[Transcript]:
        for i in range(self.n):
            yield Transcript(turn=1 + i * self.turns // self.n, text=f"{self.ctx.conversation}:{i}")


class TurnSource(Node):
    """One message per turn, its turn number from the run (``ctx.new_turn()``, as a VAD does);
    ``interrupt_at``: the first session then declares every turn below it stale."""

    outputs = {"text": Transcript}

    def __init__(self, *, turns: int = 1, sessions: list[str] | None = None, interrupt_at: int = 0):
        self.turns, self._sessions, self.interrupt_at = turns, sessions or [""], interrupt_at
        self.closed = False

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def produce(self) -> Iterator[Transcript]:
        for i in range(self.turns):
            yield Transcript(turn=self.ctx.new_turn(), text=f"{self.ctx.conversation}:{i}")
        if self.interrupt_at and self.ctx.conversation == self._sessions[0]:
            self.ctx.interrupt(self.interrupt_at)

    def close(self) -> None:
        self.closed = True


class AudioSource(Node):
    outputs = {"audio": AudioChunk}

    def __init__(self, *, n: int = 100, rate: int = 16000):
        self.n, self.rate = n, rate

    def port_rate(self, port: str) -> int | None:
        return self.rate

    def produce(self) -> Iterator[AudioChunk]:
        pcm = np.zeros(self.rate // 50, np.float32)
        for i in range(self.n):
            yield AudioChunk(pcm=pcm, rate=self.rate, start=i * 0.02)


class Upper(Node):
    """Transcript -> TextDelta, one per input, plus an end marker per turn at finish."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    def __init__(self, *, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.setups = 0
        self.closed = False

    def setup(self) -> None:
        self.setups += 1

    def close(self) -> None:
        self.closed = True

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        if self.delay_s:
            time.sleep(self.delay_s)
        assert isinstance(msg, Transcript)
        yield TextDelta(turn=msg.turn, text=msg.text.upper())


class Collect(Node):
    inputs = {"text": TextDelta}
    got: list[Message]

    def __init__(self, *, fail_on: str | None = None):
        self.fail_on = fail_on
        self.got = []
        self.finished = 0
        self.closed = False

    def process(self, port: str, msg: Message) -> None:
        if self.fail_on is not None and getattr(msg, "text", None) == self.fail_on:
            raise RuntimeError(f"boom on {self.fail_on}")
        self.got.append(msg)

    def finish(self) -> None:
        self.finished += 1

    def close(self) -> None:
        self.closed = True


class Blocker(Node):
    """Blocks inside process() until close() is called, like a stuck network read. ``inside`` is
    set once it blocks; ``released`` says, per call, whether close() let it go (False: it gave
    up after ``wait_s``)."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    def __init__(self, *, wait_s: float = 30.0) -> None:
        self.wait_s = wait_s
        self.inside, self.release = threading.Event(), threading.Event()
        self.released: list[bool] = []
        self.closed = False

    def process(self, port: str, msg: Message) -> None:
        self.inside.set()
        self.released.append(self.release.wait(self.wait_s))

    def close(self) -> None:
        self.closed = True
        self.release.set()


SETUP_BARRIERS: dict[str, threading.Barrier] = {}  # name -> a barrier SlowSetup nodes meet at


class SlowSetup(Node):
    """A setup that, with ``meet``, waits for the other SlowSetup nodes naming the same
    barrier: they pass only if their setups run at the same time."""

    inputs = {"text": TextDelta}

    def __init__(self, *, fail: bool = False, meet: str = ""):
        self.fail, self.meet = fail, meet

    def setup(self) -> None:
        if self.meet:
            SETUP_BARRIERS[self.meet].wait(timeout=5)  # BrokenBarrierError if run one after another
        if self.fail:
            raise RuntimeError("model file is corrupt")

    def process(self, port: str, msg: Message) -> None:
        pass


class Streamer(Node):
    """Yields many deltas per input, slowly: an LLM stand-in for interrupt tests."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    def __init__(self, *, pieces: int = 50, delay_s: float = 0.01):
        self.pieces, self.delay_s = pieces, delay_s
        self.closed_turns: list[int] = []
        self.interrupted: list[int] = []

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        try:
            for i in range(self.pieces):
                time.sleep(self.delay_s)
                yield TextDelta(turn=msg.turn, text=f"{i} ")
            yield TextDelta(turn=msg.turn, text="", end=True)
        except GeneratorExit:
            self.closed_turns.append(msg.turn)
            raise

    def on_interrupt(self, turn: int) -> None:
        self.interrupted.append(turn)


class Handshake(Node):
    """Once the test says go (its consumer sleeps), yields a piece, then waits until the test
    says the consumer has it (``seen``) before the next: what a stream already yielded must
    not wait for the stream's next step."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    def __init__(self) -> None:
        self.go, self.seen = threading.Event(), threading.Event()
        self.in_time: list[bool] = []

    def process(self, port: str, msg: Message) -> Iterator[TextDelta]:
        self.go.wait(10)
        yield TextDelta(turn=msg.turn, text="first")
        self.in_time.append(self.seen.wait(10))
        yield TextDelta(turn=msg.turn, text="second")


class HandshakeSource(Node):
    """The same for a source: one transcript, a wait until it was seen downstream, another."""

    outputs = {"text": Transcript}

    def __init__(self) -> None:
        self.go, self.seen = threading.Event(), threading.Event()
        self.in_time: list[bool] = []

    def produce(self) -> Iterator[Transcript]:
        self.go.wait(10)
        yield Transcript(turn=1, text="first")
        self.in_time.append(self.seen.wait(10))
        yield Transcript(turn=1, text="second")


class Split(Node):
    """Returns (not yields) a list per input: the text to one port, its length to another,
    or to a port it does not have (``bad_port``), as a node with a bug would."""

    inputs = {"text": Transcript}
    outputs = {"upper": TextDelta, "length": Transcript}

    def __init__(self, *, bad_port: str = ""):
        self.bad_port = bad_port

    def process(self, port: str, msg: Message) -> list:
        assert isinstance(msg, Transcript)
        length = Transcript(turn=msg.turn, text=str(len(msg.text)))
        return [TextDelta(turn=msg.turn, text=msg.text.upper()), (self.bad_port or "length", length)]


class CollectTranscripts(Collect):
    inputs = {"text": Transcript}


class SocketStall(Node):
    """A ``setup()`` stuck on a server that takes the connection and never answers, as a
    stalled download or model load is: it blocks in ``recv()`` until the process ends. With
    ``in_pool`` the wait runs in a worker of a thread pool, as hub downloads do (Python joins
    such workers at exit). With ``stall_close``, ``close()`` hangs too, on a second connection."""

    inputs = {"text": Transcript}

    def __init__(self, *, port: int, host: str = "127.0.0.1", in_pool: bool = False, stall_close: bool = False):
        self.host, self.port, self.in_pool, self.stall_close = host, port, in_pool, stall_close
        self._socks: list[socket.socket] = []

    def setup(self) -> None:
        if self.in_pool:
            ThreadPoolExecutor(1, thread_name_prefix="download").submit(self._wait_for_an_answer).result()
        else:
            self._wait_for_an_answer()

    def process(self, port: str, msg: Message) -> None:
        pass

    def close(self) -> None:
        if self.stall_close:
            self._wait_for_an_answer()

    def _wait_for_an_answer(self) -> None:
        sock = socket.create_connection((self.host, self.port))
        self._socks.append(sock)
        sock.recv(1)


class MarkSetup(Node):
    """Leaves a line in ``path`` when its ``setup()`` runs (a model load a dry run must not
    do), then fails there with ``fail``."""

    inputs = {"text": Transcript}

    def __init__(self, *, path: str, fail: bool = False):
        self.path, self.fail = path, fail

    def setup(self) -> None:
        with open(self.path, "a") as fh:
            fh.write("setup ran\n")
        if self.fail:
            raise RuntimeError("model file is corrupt")

    def process(self, port: str, msg: Message) -> None:
        pass


class ClosesRing(Node):
    """Its ``process()`` raises RingClosed, as a node that misuses a ring of its own would:
    the run must fail and name it, not lose the thread quietly."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    def process(self, port: str, msg: Message) -> None:
        raise RingClosed("a ring of its own")


class ClosesRingSource(Node):
    """The same in a source, after one transcript."""

    outputs = {"text": Transcript}

    def produce(self) -> Iterator[Transcript]:
        yield Transcript(turn=1, text="one")
        raise RingClosed("a ring of its own")


class ChunkTimes(Node):
    """Keeps, per audio chunk it is given, its stream offset and the time it was made (``t``)."""

    inputs = {"audio": AudioChunk}

    def __init__(self) -> None:
        self.made: dict[float, float] = {}  # chunk start (s in the stream) -> its t (monotonic)

    def process(self, port: str, msg: Message) -> None:
        assert isinstance(msg, AudioChunk)
        self.made[round(msg.start, 6)] = msg.t


class StampedWavSink(WavSink):
    """io=wav's sink that also stamps, in the run's trace, when it took each reply's first audio
    (event ``sink_first_audio``): a clock of its own beside the engine's marks."""

    def __init__(self, *, output_dir: str | None = None, rate: int | None = None):
        super().__init__(output_dir=output_dir, rate=rate)
        self._stamped: set[int] = set()

    def process(self, port: str, msg: Message) -> None:
        if isinstance(msg, AudioOut) and len(msg.pcm) and msg.turn not in self._stamped:
            self._stamped.add(msg.turn)
            self.ctx.record("sink_first_audio", turn=msg.turn)
        super().process(port, msg)
