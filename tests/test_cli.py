"""s2s-run: composition, dry runs, and configuration errors (an impossible run directory too) as one
paragraph with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.managed import run_cli

ROOT = Path(__file__).resolve().parents[1]
T = "tests.support.nodes."
S2S_RUN = [sys.executable, "-m", "s2s_flow.cli"]


def s2s_run(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*S2S_RUN, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, **(env or {})})


def test_dry_run_prints_the_graph_and_loads_no_model_library():
    code = ("import sys; sys.argv=['s2s-run','dry_run=true']; from s2s_flow.cli import main; main(); "
            "heavy=[m for m in ('torch','onnxruntime','faster_whisper','ctranslate2','piper','transformers',"
            "'mlx','httpx') if m in sys.modules]; print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr  # its wall time and memory: benchmarks/bench_engine.py
    assert "HEAVY []" in out.stdout
    for line in ("source.audio -> vad.audio", "vad.speech -> stt.audio", "stt.text -> llm.text",
                 "llm.text -> tts.text", "tts.audio -> sink.audio"):
        assert line in out.stdout
    assert "ring" in out.stdout and "block" in out.stdout


def test_dry_run_with_stt_none_wires_speech_straight_into_the_chat_llm():
    out = s2s_run("stt=none", "llm=chat", "dry_run=true")
    assert out.returncode == 0, out.stderr
    assert "vad.speech -> llm.audio" in out.stdout and "skipped: stt=none" in out.stdout
    assert "stt.text" not in out.stdout


def test_stt_none_with_an_llm_that_takes_no_audio_names_the_eligible_choice():
    out = s2s_run("stt=none", "llm=responses", "dry_run=true")
    assert out.returncode == 2
    err = out.stderr.strip()
    assert "llm=responses" in err and "stt=none" in err and "llm=chat" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("override, expected", [
    ("llm=chta", "did you mean llm=chat?"),
    ("llm.modle=x", "did you mean llm.model?"),
    ("+llm.modle=x", "did you mean llm.model?"),
    ("llm.max_tokens=many", "llm.max_tokens='many' has the wrong type"),
    ("io.input=/no/such.wav", "does not exist"),
    ("io.input=/etc/hostname", "is not a readable audio file"),
    ("+rings.stt.audio.policy=lifo", "choose one of block, drop_oldest, drop_newest"),
    ("+rings.stt.audio.capacity=abc", "must be a whole number >= 1"),
    ("vad.sample_rate=8000", "sample rates disagree"),
    ("llm=", "is not a known llm option"),
    ("llm.base_url=https://api.example.com/v1", "no API key is set"),
    ('edges=["stt.text -> nowhere.in"]', "no node 'nowhere'"),
    ("edges=[stt.text->nowhere.in]", "cannot parse the override"),
])
def test_configuration_errors_are_one_paragraph_with_exit_code_2(override, expected):
    out = s2s_run(override, "dry_run=true", env={"OPENAI_API_KEY": ""})
    assert out.returncode == 2, out.stdout + out.stderr
    assert expected in out.stderr
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr


def test_an_empty_wav_is_a_clear_error(tmp_path):
    import numpy as np
    import soundfile as sf

    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    out = s2s_run(f"io.input={empty}", "dry_run=true")
    assert out.returncode == 2 and "is empty (0 audio frames)" in out.stderr


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = s2s_run(f"io.output_dir={blocker}/replies", "dry_run=true")
    assert out.returncode == 2 and "io.output_dir" in out.stderr and "writable" in out.stderr


def test_the_wheel_installs_into_a_fresh_venv_and_finds_its_configs(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(ROOT)], check=True, timeout=300)
    wheel = next(wheel_dir.glob("s2s_flow-*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # pure Python: nothing to compile on install
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # nothing may come from the checkout: no PYTHONPATH to it, and an unrelated working directory
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600, env=alone)
    out = subprocess.run([str(env_dir / "bin" / "s2s-run"), "dry_run=true", "stt=none", "tts=espeak"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120, env=alone)
    assert out.returncode == 0, out.stderr
    assert "vad.speech -> llm.audio" in out.stdout and "tts=espeak" in out.stdout
    listed = subprocess.run([str(py), "-c", "import s2s_flow.compose as c; print(c.conf_dir())"],
                            capture_output=True, text=True, cwd=tmp_path, check=True, env=alone).stdout
    assert str(env_dir) in listed


@pytest.mark.parametrize("multirun", [False, True])
@pytest.mark.parametrize("where", ["/proc/x", "{file}/sub"])
def test_an_impossible_run_dir_is_one_paragraph_with_exit_code_2(where, multirun, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    where = where.format(file=tmp_path / "file")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    mark = tmp_path / "setup-ran"
    args = ["chain=[src,mark]", f"+src={{_target_:{T}CountSource,n:3}}",
            f"+mark={{_target_:{T}MarkSetup,path:'{mark}'}}", f"{key}={where}"]
    out = run_cli(["-m", *args] if multirun else args, tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip()
    assert err.startswith(f"s2s-run: error: {key}={where}: the ") and f"Point {key} at a directory" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not mark.exists()
