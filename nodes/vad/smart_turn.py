"""Smart Turn v3.2: decides from the audio itself whether the user has finished their turn.

Used by ``vad=silero`` with ``vad.turn=smart_turn``: after a short silence the VAD asks the
model whether the utterance so far sounds finished (prosody and words: "Set a timer for"
does not); if not, it waits for more speech or for ``vad.max_silence_ms`` of silence.

The ONNX file (8.7 MB, CPU) ships inside the ``pipecat-ai`` wheel, installed with
``--no-deps`` as a model wheel; it is located with ``find_spec`` and pipecat is never
imported. It is fed as pipecat's own analyzer (``LocalSmartTurnAnalyzerV3``) feeds it: the whole
turn from half a second before its start up to the decision (the VAD keeps that much audio
before speech: ``nodes.vad.silero.TURN_PRE_SPEECH_S``), of which the model reads the last 8 s,
zeros in front of a shorter one (tests/test_turn_smart.py holds both to pipecat's analyzer on
the same stream). The model reads 16 kHz audio as Whisper log-mel features
(80 bins x 800 frames), computed here with numpy exactly as Whisper's feature extractor
does (tests/test_turn_smart.py holds them to pipecat's own extractor).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from s2s_flow import inference
from s2s_flow.errors import MissingDependency
from s2s_flow.node import require, shared

__all__ = ["SmartTurn", "shared_smart_turn", "smart_turn_model_path", "whisper_log_mel"]

RATE = 16000
WINDOW_S = 8  # the model sees the last 8 s of the turn
_N_FFT, _HOP, _N_MELS = 400, 160, 80
_INSTALL = "pip install --no-deps pipecat-ai onnxruntime"


def smart_turn_model_path() -> Path:
    """``smart-turn-v3.2-cpu.onnx`` inside the installed pipecat-ai wheel, found without importing it."""
    spec = importlib.util.find_spec("pipecat")  # a top-level spec: nothing is executed
    root = Path(spec.origin).parent if spec and spec.origin else None
    path = root / "audio" / "turn" / "smart_turn" / "data" / "smart-turn-v3.2-cpu.onnx" if root else None
    if path is None or not path.is_file():
        raise MissingDependency("pipecat", "vad", command=_INSTALL, cause=ImportError(
            "vad.turn=smart_turn reads smart-turn-v3.2-cpu.onnx from the pipecat-ai wheel; "
            "--no-deps keeps out the framework it would pull in"))
    return path


def _slaney_mel_filters() -> np.ndarray:
    """Whisper's mel filterbank (Slaney scale and area normalisation), shape (201, 80)."""
    def to_mel(hz: np.ndarray) -> np.ndarray:
        log = hz >= 1000.0
        mel = 3.0 * hz / 200.0
        mel[log] = 15.0 + np.log(hz[log] / 1000.0) * (27.0 / np.log(6.4))
        return mel

    def to_hz(mel: np.ndarray) -> np.ndarray:
        log = mel >= 15.0
        hz = 200.0 * mel / 3.0
        hz[log] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log] - 15.0))
        return hz

    edges = to_hz(np.linspace(0.0, to_mel(np.array([RATE / 2.0]))[0], _N_MELS + 2))
    fft_hz = np.linspace(0, RATE // 2, _N_FFT // 2 + 1)
    slopes = edges[None, :] - fft_hz[:, None]
    width = np.diff(edges)
    filters = np.maximum(0.0, np.minimum(-slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


_MEL_FILTERS = _slaney_mel_filters()
_HANN = np.hanning(_N_FFT + 1)[:-1]  # periodic, as torch.hann_window


def whisper_log_mel(audio: np.ndarray) -> np.ndarray:
    """Whisper log-mel features of exactly 8 s of 16 kHz audio, normalised: float32 (80, 800)."""
    x = np.asarray(audio, np.float32)
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), _N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, _N_FFT)[::_HOP]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2
    log_spec = np.log10(np.maximum(1e-10, power @ _MEL_FILTERS)).T[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


class SmartTurn:
    """The model, loaded once: ``probability(pcm)`` that a 16 kHz utterance is a finished turn.

    Stateless between calls (onnxruntime's ``run`` is thread-safe), so every session shares one,
    asking in a slot of ``inference`` (s2s_flow/inference.py): one call at a time per thread
    budget, a session's end-of-turn decision being on its critical path (``first`` work).
    """

    def __init__(self, threads: int = 1) -> None:
        self.inference = inference.scheduler(f"smart_turn:{threads}", 1)
        ort = require("onnxruntime", "vad")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(
            str(smart_turn_model_path()), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self.probability(np.zeros(RATE // 10, np.float32))  # warm up

    def probability(self, pcm: np.ndarray) -> float:
        """The last 8 s of the turn (zeros in front of a shorter one), as the model was trained."""
        n = RATE * WINDOW_S
        audio = pcm[-n:] if len(pcm) >= n else np.pad(pcm, (n - len(pcm), 0))
        features = whisper_log_mel(audio)[None]
        return float(self._session.run(None, {"input_features": features})[0].reshape(-1)[0])


def shared_smart_turn(threads: int = 1) -> SmartTurn:
    """One model per process and thread count, for every session that holds it (freed with the
    last, kept warm by a server): the node contract's cache, :func:`s2s_flow.node.shared`."""
    return shared((__name__, threads), lambda: SmartTurn(threads))
