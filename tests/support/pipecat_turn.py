"""Smart Turn fed by pipecat's own analyzer beside ours, on the same stream: what each gives the model.

    python -m tests.support.pipecat_turn     # prints one JSON line per decision of our VAD

Run in a process of its own (tests/test_turn_smart.py starts it): importing pipecat replaces
``asyncio.wait_for`` on Python < 3.12 and logs through loguru, neither of which belongs in the
test process. pipecat's ``LocalSmartTurnAnalyzerV3`` (the pipecat-ai wheel, as installed) keeps
its audio buffer by ``time.monotonic()``; its module clock is set to the stream's time here, so
both see the same stream at the same positions, fed in 32 ms pieces (the VAD's windows: our
utterance then ends where pipecat's buffer does). pipecat is told a speech start when our VAD
starts one (``is_speech``: a voiced window of a turn under way), with ``vad_start_secs`` of one
window, as its own VAD would report the start one window late.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

RATE, WINDOW = 16000, 512


def main() -> None:
    import pipecat.audio.turn.smart_turn.base_smart_turn as base
    from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

    from nodes.vad import smart_turn
    from nodes.vad.silero import SileroVAD
    from s2s_flow.messages import AudioChunk, Speech
    from s2s_flow.node import Context
    from tests.support.speech import synthesize

    clock = {"t": 0.0}
    base.time.monotonic = lambda: clock["t"]  # the analyzer's buffer in stream time
    analyzer = LocalSmartTurnAnalyzerV3(sample_rate=RATE)
    analyzer._sample_rate = RATE  # set by pipecat's pipeline when it starts
    analyzer.update_vad_start_secs(WINDOW / RATE)
    theirs: list[tuple[int, float]] = []
    predict = analyzer._predict_endpoint

    def recorded(audio: np.ndarray) -> dict:
        result = predict(audio)
        theirs.append((len(audio), float(result["probability"])))
        return result

    analyzer._predict_endpoint = recorded
    ours: list[tuple[int, float]] = []

    class Asked(smart_turn.SmartTurn):
        def probability(self, pcm: np.ndarray) -> float:
            p = super().probability(pcm)
            ours.append((len(pcm), p))
            return p

    vad = SileroVAD(turn="smart_turn", min_silence_ms=200, max_silence_ms=1000)
    vad.ctx = Context("vad", Path("."), record=lambda kind, **fields: None)
    vad.setup()
    vad._smart_turn = Asked(1)
    ours.clear()  # its warm-up
    texts = [["What is the capital of Australia?"], ["What is the weather going to be like in", "Paris tomorrow?"]]
    for parts in texts:
        pieces = [np.zeros(RATE, np.float32)]
        for part in parts:
            pieces += [synthesize(part, RATE), np.zeros(RATE * 6 // 10, np.float32)]
        pcm = np.concatenate(pieces + [np.zeros(2 * RATE, np.float32)])
        pcm = np.round(np.clip(pcm, -1, 1) * 32767) / 32767  # pipecat reads int16: both get the same values
        vad.reset()
        analyzer.clear()
        for i in range(0, len(pcm) - WINDOW + 1, WINDOW):
            piece = pcm[i : i + WINDOW]
            clock["t"] = (i + WINDOW) / RATE
            asked = len(ours)
            out = list(vad.process("audio", AudioChunk(pcm=piece, rate=RATE, start=i / RATE, t=clock["t"])))
            voiced = vad._phase != "idle" and vad._temp_end is None
            analyzer.append_audio((piece * 32767).round().astype(np.int16).tobytes(), voiced)
            if len(ours) > asked:  # our VAD asked the model at this window: pipecat is asked too
                analyzer._process_speech_segment(analyzer._audio_buffer)
            if any(isinstance(m, Speech) and not m.speculative for m in out):
                analyzer.clear()  # the turn ended: pipecat starts a new one too
    for (n_ours, p_ours), (n_theirs, p_theirs) in zip(ours, theirs, strict=True):
        print(json.dumps({"ours_samples": n_ours, "pipecat_samples": n_theirs, "ours": p_ours, "pipecat": p_theirs}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
