"""Reply audio to a sound device in short blocks, from a thread of its own, cut on barge-in.

The playback thread writes one block at a time with a blocking write, so it always knows
how much of each reply went out: a barge-in (``cut``) drops the queued audio, and the
voice stops after the block in flight (one block plus the device's output latency), with
a 5 ms fade so the cut does not click. Between replies it writes silence, which keeps the
stream running and the next reply's first block on time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Player", "Reply"]

FADE_S = 0.005


@dataclass
class Reply:
    """One turn's reply as the speaker played it; samples are at the device rate."""

    turn: int
    sentences: list[list[Any]] = field(default_factory=list)  # [text, samples queued, samples played]
    played: int = 0
    ended: bool = False  # the reply's end marker arrived
    done: bool = False  # ... and everything before it was played
    cut: bool = False  # a barge-in stopped it

    def heard(self) -> str:
        """The text as far as it was played: whole sentences, then the played share of the words
        of the sentence the cut fell in."""
        words: list[str] = []
        for text, queued, played in self.sentences:
            if played >= queued:
                words.append(text)
                continue
            if played > 0:
                split = text.split()
                words.extend(split[: int(len(split) * played / queued)])
            break
        return " ".join(w for w in words if w)


class Player:
    """Owns the output stream; ``add``/``end``/``cut`` may be called from any thread."""

    def __init__(
        self,
        stream: Any,
        *,
        rate: int,
        block: int,
        on_sentence: Callable[[int, str], None] = lambda turn, text: None,
        on_done: Callable[[Reply], None] = lambda reply: None,
        on_audible: Callable[[float], None] = lambda until: None,
    ) -> None:
        self.stream, self.rate, self.block = stream, rate, block
        self.latency_s = float(getattr(stream, "latency", 0.0) or 0.0)
        self._on_sentence, self._on_done, self._on_audible = on_sentence, on_done, on_audible
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[Reply, int | None, np.ndarray | None]] = deque()  # (reply, sentence, pcm)
        self._offset = 0  # samples of the queue head already played
        self._replies: dict[int, Reply] = {}  # until done and reported, or cut
        self._finished: set[int] = set()  # turns reported done: late messages of theirs open nothing
        self._cut_before = 0  # turns below this were cut: late audio of theirs is dropped
        self._fade: np.ndarray | None = None
        self._running = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.underflows = 0

    # -- control, from the sink's thread (or an interrupting one) -------------------------

    def start(self, prime_timeout_s: float = 5.0) -> None:
        """Start the stream, prime it with silence, then hand it to the playback thread."""
        self._running = True
        self.stream.start()
        self._prime(prime_timeout_s)
        self._thread = threading.Thread(target=self._run, name="speaker", daemon=True)
        self._thread.start()

    def _prime(self, timeout_s: float) -> None:
        """Write silence until the device takes blocks at its own pace (its buffer is full and
        draining in real time). Some stacks hold a new stream's first writes back for a second or
        two (PulseAudio through ALSA does); that must happen here, not to the first reply."""
        silence = np.zeros((self.block, 1), np.float32)
        block_s = self.block / self.rate
        paced, deadline = 0, time.monotonic() + timeout_s
        while paced < 5 and time.monotonic() < deadline:
            t0 = time.monotonic()
            self.stream.write(silence)
            took = time.monotonic() - t0
            paced = paced + 1 if 0.3 * block_s < took < 2 * block_s else 0

    def reply(self, turn: int) -> Reply | None:
        """The reply of ``turn`` (made on first use), or None if that turn was cut or is over."""
        with self._lock:
            return self._reply(turn)

    def knows(self, turn: int) -> bool:
        """Whether ``turn`` has a reply here (under way, playing, or just finished)."""
        with self._lock:
            return turn in self._replies or turn in self._finished

    def _reply(self, turn: int) -> Reply | None:
        if 0 < turn < self._cut_before or turn in self._finished:
            return None
        reply = self._replies.get(turn)
        if reply is None:
            reply = self._replies[turn] = Reply(turn)
        return reply

    def add(self, turn: int, pcm: np.ndarray, text: str) -> None:
        """Queue audio of ``turn``'s reply; ``text`` is the sentence it speaks."""
        if not len(pcm):
            return
        with self._lock:
            reply = self._reply(turn)
            if reply is None:
                return
            if not text and reply.sentences:  # audio without a sentence of its own ends the one before
                text = reply.sentences[-1][0]
            if not reply.sentences or reply.sentences[-1][0] != text:
                reply.sentences.append([text, 0, 0])
            reply.sentences[-1][1] += len(pcm)
            self._queue.append((reply, len(reply.sentences) - 1, pcm))

    def end(self, turn: int) -> None:
        """The reply of ``turn`` is complete: it is done once its queued audio has played."""
        with self._lock:
            reply = self._reply(turn)
            if reply is not None and not reply.ended:
                reply.ended = True
                self._queue.append((reply, None, None))

    def busy_before(self, turn: int) -> bool:
        """Whether a reply of an earlier turn is still being prepared or played."""
        with self._lock:
            return any(0 < t < turn and not r.done for t, r in self._replies.items())

    def cut(self, before: int) -> list[Reply]:
        """Barge-in: stop every reply of a turn below ``before`` now; returns them as played."""
        with self._lock:
            self._cut_before = max(self._cut_before, before)
            cut = [r for t, r in sorted(self._replies.items()) if 0 < t < before and not r.done]
            if not cut:
                return []
            for reply in cut:
                reply.cut = True
                del self._replies[reply.turn]
            if self._queue and self._queue[0][0].cut and self._queue[0][2] is not None:
                pcm = self._queue[0][2][self._offset : self._offset + int(FADE_S * self.rate)]
                self._fade = pcm * np.linspace(1.0, 0.0, len(pcm), dtype=np.float32)
            if self._queue and self._queue[0][0].cut:
                self._offset = 0
            self._queue = deque(item for item in self._queue if not item[0].cut)
            self._idle.notify_all()
            return cut

    def take_unfinished(self) -> list[Reply]:
        """End of stream: the replies whose end never came, as far as they were played."""
        with self._lock:
            left = [self._replies.pop(t) for t in sorted(self._replies) if not self._replies[t].done]
            self._queue.clear()
            self._offset = 0
            return left

    def wait_idle(self, stopping: threading.Event) -> None:
        """Block until everything queued has played (and left the device), or until ``stopping``."""
        with self._lock:
            while self._queue and self._running and not stopping.is_set():
                self._idle.wait(0.1)
        if self._running and not stopping.is_set():
            stopping.wait(self.latency_s + self.block / self.rate)

    def stop(self) -> None:
        """Stop the thread and close the stream (the block in flight is abandoned)."""
        self._running = False
        with self._lock:
            self._idle.notify_all()
        if self._thread is not None:
            self._thread.join(1.0)
        try:
            self.stream.abort()
        finally:
            self.stream.close()

    # -- the playback thread -----------------------------------------------------------------

    def _next_block(self) -> tuple[np.ndarray, list[tuple[int, str]], list[Reply]]:
        """Fill one block from the queue (with the lock held); what starts and what ends in it."""
        out = np.zeros(self.block, np.float32)
        n, started, done = 0, [], []
        if self._fade is not None:
            n = len(self._fade)
            out[:n] = self._fade
            self._fade = None
        while n < self.block and self._queue:
            reply, index, pcm = self._queue[0]
            if pcm is None or index is None:  # end marker
                self._queue.popleft()
                reply.done = True
                done.append(reply)
                continue
            sentence = reply.sentences[index]
            if sentence[2] == 0 and self._offset == 0:
                started.append((reply.turn, sentence[0]))
            take = min(self.block - n, len(pcm) - self._offset)
            out[n : n + take] = pcm[self._offset : self._offset + take]
            n += take
            self._offset += take
            sentence[2] += take
            reply.played += take
            if self._offset >= len(pcm):
                self._queue.popleft()
                self._offset = 0
        if not self._queue:
            self._idle.notify_all()
        return out[:, None], started, done

    def _run(self) -> None:
        try:
            while self._running:
                with self._lock:
                    block, started, done = self._next_block()
                if block.any():
                    self._on_audible(time.monotonic() + self.latency_s + self.block / self.rate)
                for turn, text in started:
                    self._on_sentence(turn, text)
                if self.stream.write(block):
                    self.underflows += 1
                for reply in done:
                    self._on_done(reply)
                    with self._lock:  # reported: from now on a cut leaves it alone
                        self._replies.pop(reply.turn, None)
                        self._finished.add(reply.turn)
        except BaseException as exc:  # device lost: the sink reports it on its next message
            self.error = exc
            self._running = False
            with self._lock:
                self._idle.notify_all()
