"""What every STT backend shares: one finished utterance in, one final transcript out."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from s2s_flow.audio import resample
from s2s_flow.messages import Speech, Transcript
from s2s_flow.node import Node

__all__ = ["UtteranceSTT"]


class UtteranceSTT(Node):
    """A backend implements ``transcribe(audio at input_rate) -> (text, language or None)``."""

    inputs = {"audio": Speech}
    outputs = {"text": Transcript}

    #: rate the backend's model reads; utterances are resampled to it
    input_rate = 16000

    def transcribe(self, audio: np.ndarray) -> tuple[str, str | None]:
        raise NotImplementedError

    def process(self, port: str, msg: Speech) -> Iterator[Transcript]:
        audio = resample(msg.pcm, msg.rate, self.input_rate)
        if len(audio) == 0:
            return
        text, language = self.transcribe(audio)
        if not text:  # nothing for the LLM to answer; the turn ends here
            self.ctx.log.info("turn %d: no words recognised in %.2f s of speech",
                              msg.turn, msg.end - msg.start)
            return
        yield Transcript(turn=msg.turn, text=text, language=language)
