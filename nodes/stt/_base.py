"""What every STT backend shares: one utterance in, one transcript out.

With speculation (``vad.speculate_ms``) the VAD sends the utterance so far at each pause
(``Speech.speculative``), and the same utterance again when the turn is confirmed or, if the
user went on, the longer one. The stage remembers what it decoded last: a confirmation (the
same audio) is answered at once from it, and a longer utterance from the same start has only
its new tail decoded, after the pause that ended the remembered part (``prefix_reuse``). So
the decoding happens at the pauses, while the user may still be speaking, and the turn's end
leaves at most the last stretch of speech to decode.

Every decode runs in a slot of the backend's shared model (``inference_key()``, the node contract):
a confirmed turn's as ``first`` work, a speculative one's as ``speculative`` work, which is shed
under load (the confirmation is decoded then).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from nodes._http import RemoteError
from nodes._live import turn_failed
from s2s_flow.audio import resample
from s2s_flow.inference import Shed
from s2s_flow.messages import Speech, Transcript
from s2s_flow.node import Node

__all__ = ["UtteranceSTT"]

#: the remembered start of an utterance is reused only when it is at least this long: below
#: it, decoding the whole utterance again costs little more (Whisper pads every input to 30 s)
#: and a short tail read on its own loses words (bench_stt_incremental.py: "a virus and a
#: bacterium" after a 400 ms pause came out as "have virus in the bacterium")
MIN_PREFIX_S = 3.0
#: nor when the tail after it is shorter than this: too little audio to read on its own
MIN_TAIL_S = 0.3


@dataclass(frozen=True, slots=True)
class _Decoded:
    start: float  # the utterance's stream offset (s): the same utterance keeps it
    samples: int  # how much of it (at input_rate) the text covers
    text: str
    language: str | None


class UtteranceSTT(Node):
    """A backend implements ``transcribe(audio at input_rate) -> (text, language or None)``;
    ``transcribe_after(audio, prefix)`` may use the text already said as context."""

    inputs = {"audio": Speech}
    outputs = {"text": Transcript}

    #: rate the backend's model reads; utterances are resampled to it
    input_rate = 16000
    #: decode only the new tail of an utterance whose start was decoded at an earlier pause
    prefix_reuse = True

    _last: _Decoded | None = None

    def transcribe(self, audio: np.ndarray) -> tuple[str, str | None]:
        raise NotImplementedError

    def transcribe_after(self, audio: np.ndarray, prefix: str) -> tuple[str, str | None]:
        """The words of ``audio``, which follows ``prefix`` in the same utterance."""
        return self.transcribe(audio)

    def transcribe_speech(self, msg: Speech, audio: np.ndarray) -> tuple[str, str | None]:
        """The words of a whole utterance not decoded before (a backend that decoded it as it grew
        reads only what is left)."""
        return self.transcribe(audio)

    def reset(self) -> None:
        """Forget the last speculative decode (a benchmark reusing one node)."""
        self._last = None

    def process(self, port: str, msg: Speech) -> Iterator[Transcript]:
        audio = resample(msg.pcm, msg.rate, self.input_rate)
        if len(audio) == 0:
            return
        try:
            text, language = self._decode(msg, audio)
        except Shed as shed:  # a speculative decode under load: the confirmation is decoded instead
            self.ctx.log.debug("turn %d: %s", msg.turn, shed)
            return
        except RemoteError as exc:  # live: the turn has no transcript, the session goes on
            if msg.speculative and self.ctx.live:  # its confirmation asks again, and tells if it fails
                self.ctx.log.warning("turn %d: the early transcript failed: %s", msg.turn, exc)
                return
            if not turn_failed(self.ctx, "stt", msg.turn, exc):
                raise
            return
        if not text:  # nothing for the LLM to answer; the turn ends here
            self.ctx.log.info("turn %d: no words recognised in %.2f s of speech",
                              msg.turn, msg.end - msg.start)
            return
        yield Transcript(turn=msg.turn, text=text, language=language, speculative=msg.speculative)

    def _decode(self, msg: Speech, audio: np.ndarray) -> tuple[str, str | None]:
        last = self._last
        same = last is not None and abs(last.start - msg.start) < 1e-6 and len(audio) >= last.samples
        if same and last is not None and len(audio) == last.samples:
            text, language = last.text, last.language  # the confirmation of a speculative turn
        elif (same and last is not None and self.prefix_reuse and last.text
              and last.samples >= MIN_PREFIX_S * self.input_rate
              and len(audio) - last.samples >= MIN_TAIL_S * self.input_rate):
            with self.inference_slot("speculative" if msg.speculative else "first", turn=msg.turn):
                tail, language = self.transcribe_after(audio[last.samples:], last.text)
            text = f"{last.text} {tail}".strip() if tail else last.text
        else:
            with self.inference_slot("speculative" if msg.speculative else "first", turn=msg.turn):
                text, language = self.transcribe_speech(msg, audio)
        # remembered while the user may go on (a speculative utterance), forgotten once it is over
        self._last = _Decoded(msg.start, len(audio), text, language) if msg.speculative else None
        return text, language
