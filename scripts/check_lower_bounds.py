"""Run the tests on the oldest versions pyproject.toml allows, so its lower bounds are true.

    .venv/bin/python scripts/check_lower_bounds.py          # needs PyPI; ~10 min on 2 cores
    .venv/bin/python scripts/check_lower_bounds.py --only newest-numpy

Every direct dependency of the core and of the extras below is installed at its floor (the
``>=`` version in pyproject.toml), and the tests of what it serves run against it:

- ``oldest``: a fresh venv with everything at its floor, NumPy included;
- ``newest-numpy``: the floors laid over the dev venv (``.venv``) with ``pip --target``, so
  NumPy and every indirect dependency are at their newest (old wheels built against NumPy 1
  fail to import under NumPy 2: that is what raised soxr, onnxruntime and matplotlib);
- ``local-llm``: the transformers and mlx floors over ``.venv`` (torch stays the one there:
  only that one is installed on the machines this is run on, and it is the declared floor).

Each run checks that the floors are what the tests imported. Standard library + packaging.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
OFFLINE_EXTRAS = ("remote", "vad", "whisper", "piper", "espeak", "audio", "plot")
LOCAL_LLM_EXTRAS = ("transformers", "mlx")
MODEL_WHEELS = ("silero-vad==6.2.3",)  # model files shipped as wheels, installed --no-deps as bootstrap does
TEST_TOOLS = ("pytest", "hypothesis", "psutil")
OFFLINE_TESTS = (
    "tests/test_graph.py", "tests/test_rings.py", "tests/test_scheduler.py", "tests/test_trace.py",
    "tests/test_metrics.py", "tests/test_cache.py", "tests/test_vad_silero.py", "tests/test_stt_whisper.py",
    "tests/test_tts_piper.py", "tests/test_tts_espeak.py", "tests/test_corpus.py",
    "tests/test_llm_remote_requests.py", "tests/test_llm_remote_faults.py", "tests/test_tts_openai.py",
    "tests/test_live_audio.py",
)
LOCAL_LLM_TESTS = ("tests/test_llm_local.py", "tests/test_stt_whisper_hf.py", "tests/test_tiny_llama.py",
                   "tests/test_stt_parakeet.py")
LOCAL_ONLY = {"torch"}  # never downloaded: the installed one is the floor


def floors(extras: tuple[str, ...], *, core: bool) -> dict[str, str]:
    """``name[extras]`` -> floor for the direct dependencies that apply on this machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) if core else []
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        low = [s.version for s in req.specifier if s.operator == ">="]
        if not low:
            raise SystemExit(f"pyproject.toml: {text!r} has no lower bound to test")
        name = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
        pins[name] = low[0]
    return pins


def pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True)


def pytest(python: Path | str, tests: tuple[str, ...], pins: dict[str, str], env: dict[str, str]) -> bool:
    """The tests, then a check that every pinned distribution is the one imported at its floor."""
    check = (
        "import importlib.metadata as md, sys\n"
        "from packaging.version import Version\n"
        f"pins = {{n.split('[')[0]: v for n, v in {pins!r}.items()}}\n"
        "used = {n: md.version(n) for n in pins}\n"
        "wrong = {n: v for n, v in used.items() if Version(Version(v).base_version) != Version(pins[n])}\n"
        "print('in use:', ', '.join(f'{n} {v}' for n, v in sorted(used.items())))\n"
        "sys.exit(f'not at the floor: {wrong}' if wrong else 0)\n"
    )
    ran = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests],
                         cwd=ROOT, env=env).returncode == 0
    return subprocess.run([str(python), "-c", check], cwd=ROOT, env=env).returncode == 0 and ran


def run_oldest(work: Path) -> bool:
    pins = floors(OFFLINE_EXTRAS, core=True)
    venv = work / "oldest"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip(python, "install", "--prefer-binary", *(f"{n}=={v}" for n, v in pins.items()), *TEST_TOOLS)
    pip(python, "install", "--no-deps", *MODEL_WHEELS)
    return pytest(python, OFFLINE_TESTS, pins, {**os.environ, "PYTHONPATH": str(ROOT)})


def overlay(work: Path, name: str, pins: dict[str, str], *, deps: bool) -> dict[str, str]:
    """The pins installed into a directory that goes first on PYTHONPATH in front of .venv."""
    target = work / name
    pinned = [f"{n}=={v}" for n, v in pins.items() if n.split("[")[0] not in LOCAL_ONLY]
    pip(VENV_PYTHON, "install", "--upgrade", "--only-binary", ":all:", "--target", str(target),
        *([] if deps else ["--no-deps"]), *pinned)
    return {**os.environ, "PYTHONPATH": f"{target}:{ROOT}"}


def run_newest_numpy(work: Path) -> bool:
    pins = {n: v for n, v in floors(OFFLINE_EXTRAS, core=True).items() if n != "numpy"}
    return pytest(VENV_PYTHON, (*OFFLINE_TESTS,), pins, overlay(work, "newest-numpy", pins, deps=False))


def run_local_llm(work: Path) -> bool:
    pins = floors(LOCAL_LLM_EXTRAS, core=False)
    pins |= {n: v for n, v in floors(("test",), core=False).items() if n == "parakeet-mlx"}
    # with their dependencies (e.g. the huggingface-hub < 2 an old transformers asks for); none is torch
    env = overlay(work, "local-llm", pins, deps=True)
    return pytest(VENV_PYTHON, LOCAL_LLM_TESTS, pins, env)


RUNS = {"oldest": run_oldest, "newest-numpy": run_newest_numpy, "local-llm": run_local_llm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(RUNS), action="append", help="run only these (repeatable)")
    parser.add_argument("--work", type=Path, help="keep the venvs and overlays here (default: a temp dir)")
    args = parser.parse_args()
    if not VENV_PYTHON.exists():
        raise SystemExit("no .venv: run scripts/bootstrap.sh first")
    with tempfile.TemporaryDirectory(prefix="s2s-lower-bounds-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = {name: RUNS[name](work) for name in (args.only or RUNS)}
    for name, ok in results.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
