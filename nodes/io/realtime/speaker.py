"""The reply's audio of a WebRTC call (webrtc.py) as its outgoing track: Opus at 48 kHz, one 20 ms
frame every 20 ms (aiortc's RTP sender asks for the next one; silence when there is nothing to say),
with what the server says of its playback: ``output_audio_buffer.started`` when a response's audio
begins to play, ``stopped`` once its last audio has played, and, on ``clear``, what was cut.
"""

from __future__ import annotations

import asyncio
import fractions
import threading
import time
from collections import deque
from typing import Any

import numpy as np

__all__ = ["Speaker", "OPUS_RATE", "FRAME"]

OPUS_RATE = 48000
FRAME = OPUS_RATE // 50  # one RTP packet: 20 ms


class Speaker:
    """The reply's audio as the call's outgoing track: a 20 ms frame every 20 ms, silence when idle.

    ``push`` (the graph's threads) queues 48 kHz PCM16 per response; the track's ``recv`` (the
    event loop, paced by aiortc's RTP sender asking for the next frame) plays it and reports
    through ``tell`` when a response's audio starts and, once its last audio is played, stops."""

    def __init__(self, tell: Any) -> None:
        self.tell = tell
        self.lock = threading.Lock()
        self.queue: deque[list[Any]] = deque()  # [response_id, item_id, int16 samples]
        self.played: dict[str, int] = {}  # item_id -> samples played
        self.finished: set[str] = set()  # responses whose audio is all queued
        self.muted: set[str] = set()  # responses cleared: their later audio is dropped
        self.playing: tuple[str, str] | None = None  # the (response, item) playing now
        self.track = self._track()

    def _track(self) -> Any:
        from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

        speaker = self

        class SpeakerTrack(MediaStreamTrack):
            kind = "audio"

            def __init__(self) -> None:
                super().__init__()
                self.start: float | None = None
                self.pts = 0

            async def recv(self) -> Any:
                if self.readyState != "live":
                    raise MediaStreamError
                if self.start is None:
                    self.start = time.monotonic()
                else:
                    self.pts += FRAME
                    wait = self.start + self.pts / OPUS_RATE - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                return speaker.frame(self.pts)

        return SpeakerTrack()

    def push(self, response_id: str, item_id: str, pcm: np.ndarray) -> None:
        with self.lock:
            if response_id in self.muted or not len(pcm):
                return
            self.played.setdefault(item_id, 0)
            self.queue.append([response_id, item_id, pcm])

    def finish(self, response_id: str) -> None:
        """All of the response's audio is queued: its ``stopped`` follows its last frame played."""
        with self.lock:
            if response_id in self.muted:
                return
            self.finished.add(response_id)
            stopped = self._stopped()
        if stopped:
            self.tell(stopped)

    def _stopped(self) -> dict[str, Any] | None:
        """(under the lock) The response playing has played all its audio: it stops."""
        if self.playing is None:
            return None
        response_id = self.playing[0]
        if response_id not in self.finished or any(q[0] == response_id for q in self.queue):
            return None
        self.finished.discard(response_id)
        self.playing = None
        return events_stopped(response_id)

    def clear(self, mute: set[str]) -> list[tuple[str, str]]:
        """Drop what is unplayed (and, for the responses in ``mute``, what comes later); returns the
        (response, item) pairs whose audio was playing or cut."""
        with self.lock:
            cut = {(q[0], q[1]) for q in self.queue}
            if self.playing is not None:
                cut.add(self.playing)
            self.queue.clear()
            self.muted |= mute
            self.finished -= mute
            self.playing = None
            return sorted(cut)

    def played_ms(self, item_id: str) -> int:
        with self.lock:
            return self.played.get(item_id, 0) * 1000 // OPUS_RATE

    def frame(self, pts: int) -> Any:
        import av

        out = np.zeros(FRAME, np.int16)
        told: list[dict[str, Any]] = []
        with self.lock:
            filled = 0
            while filled < FRAME and self.queue:
                entry = self.queue[0]
                response_id, item_id, pcm = entry
                if self.playing is None or self.playing[0] != response_id:
                    if self.playing is not None:  # the next response's audio came before the last one's end
                        told.append(events_stopped(self.playing[0]))
                        self.finished.discard(self.playing[0])
                    told.append({"type": "output_audio_buffer.started", "response_id": response_id})
                self.playing = (response_id, item_id)
                take = min(FRAME - filled, len(pcm))
                out[filled:filled + take] = pcm[:take]
                self.played[item_id] = self.played.get(item_id, 0) + take
                filled += take
                if take == len(pcm):
                    self.queue.popleft()
                else:
                    entry[2] = pcm[take:]
            stopped = self._stopped()
            if stopped:
                told.append(stopped)
        for event in told:
            self.tell(event)
        frame = av.AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OPUS_RATE, pts, fractions.Fraction(1, OPUS_RATE)
        return frame


def events_stopped(response_id: str) -> dict[str, Any]:
    return {"type": "output_audio_buffer.stopped", "response_id": response_id}
