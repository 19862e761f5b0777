"""Hydra sweeps (`s2s-run -m`) gathered into sweep.csv / sweep.md / sweep.png.

Every sweep runs the real CLI in a subprocess on real components: the offline stack
(Silero, Whisper tiny.en, SmolLM2 in llama-server, Piper / espeak-ng) for the 2x2 sweep,
the cheap source -> VAD chain where only the bookkeeping is under test, and the small nodes of
tests/support/nodes.py where a job's outcome is (a dry run that sets nothing up, a failed job).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.support.managed import run_cli, write_recipes
from tests.support.speech import synthesize


@pytest.fixture(scope="module")
def question(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pcm = synthesize("What is the capital of France?")
    pcm = np.concatenate([np.zeros(8000, np.float32), pcm, np.zeros(4800, np.float32)])
    path = tmp_path_factory.mktemp("sweep-input") / "question.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    return path


def sweep(sweep_dir: Path, *overrides: str, timeout: float = 600, code: int = 0) -> subprocess.CompletedProcess:
    """The sweep; ``code`` is its exit code: 1 when a job failed (after the summary is written)."""
    env = {**os.environ, "S2S_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "s2s_flow.cli", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_2x2_sweep_of_the_offline_stack_gives_four_rows_a_csv_and_a_plot(tmp_path: Path, question: Path,
                                                                           smollm2_server: str):
    out = tmp_path / "sweep"
    proc = sweep(out, "tts=piper,espeak", "vad.min_silence_ms=300,500", "stt=whisper", "llm=chat",
                 f"llm.base_url={smollm2_server}/v1", "llm.max_tokens=24", "llm.temperature=0", "server=null",
                 f"io.input=[{question},{question}]", "io.realtime=true")
    rows = read_csv(out / "sweep.csv")
    assert len(rows) == 4
    assert {r["overrides"].split(" ")[0] + " " + r["overrides"].split(" ")[1] for r in rows} == {
        "tts=piper vad.min_silence_ms=300", "tts=piper vad.min_silence_ms=500",
        "tts=espeak vad.min_silence_ms=300", "tts=espeak vad.min_silence_ms=500"}
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["turns"] == "1"  # two conversations: the warm-up turn and one measured turn
        assert float(r["voice_to_voice_p50_ms"]) > float(r["stage_vad_p50_ms"]) >= 300
        assert float(r["warmup_voice_to_voice_ms"]) > 0
        assert r["launcher"] == "basic" and r["cpu"] and int(r["cores"]) >= 1 and float(r["ram_gb"]) > 0
        assert r["version:s2s-flow"] and r["version:hydra-core"] and r["version:onnxruntime"]
        assert r["server"] == "none"  # server=null: the test's llama-server, not started by the job
    # the shorter hangover is measured as such
    by = {(r["overrides"].split()[0], r["overrides"].split()[1]): r for r in rows}
    for tts in ("tts=piper", "tts=espeak"):
        assert float(by[(tts, "vad.min_silence_ms=300")]["stage_vad_p50_ms"]) < float(
            by[(tts, "vad.min_silence_ms=500")]["stage_vad_p50_ms"])
    # one process ran the four jobs in turn; each job's nodes and models were gone before the next
    assert [r["process"].split(" ")[0] for r in rows] == ["fresh", "reused", "reused", "reused"]
    assert len({r["pid"] for r in rows}) == 1
    assert all(r["leftovers_at_start"] == "" for r in rows), [r["leftovers_at_start"] for r in rows]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "sweep.md").read_text()
    assert md.count("| `tts=") == 4 and "voice-to-voice" in md and "4 jobs, 4 ok, 0 failed" in md
    assert "sweep: 4 jobs" in proc.stderr
    job = json.loads((out / "0" / "job.json").read_text())
    assert job["figures"]["voice_to_voice_p50_ms"] == pytest.approx(float(rows[0]["voice_to_voice_p50_ms"]))


def test_a_failing_job_is_reported_and_the_others_are_kept(tmp_path: Path, question: Path):
    out = tmp_path / "sweep"
    sweep(out, "chain=[io.source,vad]", "vad.threshold=0.5,2.0,0.6", f"io.input={question}", code=1)
    rows = read_csv(out / "sweep.csv")
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert "vad.threshold=2.0" in rows[1]["error"]
    assert "vad.threshold=2.0" in (out / "1" / "error.txt").read_text()
    for r in (rows[0], rows[2]):
        assert float(r["stage_vad_p50_ms"]) >= 500 and r["error"] == ""
        assert (Path(r["run_dir"]) / "metrics.json").exists()
    md = (out / "sweep.md").read_text()
    assert "3 jobs, 2 ok, 1 failed" in md and "## Failed jobs" in md and "vad.threshold=2.0" in md
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_joblib_runs_jobs_in_parallel_processes(tmp_path: Path, question: Path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install 's2s-flow[sweep-joblib]'")
    out = tmp_path / "sweep"
    sweep(out, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "chain=[io.source,vad]",
          "vad.min_silence_ms=300,500", "vad.threshold=0.5,3.0", f"io.input={question}", code=1)
    rows = read_csv(out / "sweep.csv")
    assert len(rows) == 4
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "failed"]
    assert all(r["launcher"] == "joblib (n_jobs=2)" for r in rows)
    assert len({r["pid"] for r in rows}) == 2  # two worker processes, not the sweep's own
    assert (out / "sweep.md").exists() and (out / "sweep.png").exists()


def test_the_summary_can_be_rebuilt_from_the_job_dirs(tmp_path: Path, question: Path):
    out = tmp_path / "sweep"
    sweep(out, "chain=[io.source,vad]", "vad.min_silence_ms=300,500", f"io.input={question}")
    before = (out / "sweep.csv").read_text()
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        (out / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "s2s_flow.sweep", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "sweep.csv").read_text() == before
    assert (out / "sweep.md").exists() and (out / "sweep.png").exists()


def test_a_sweep_over_the_hesitant_corpus_counts_false_ends_and_wasted_speculation(tmp_path: Path):
    """Silero alone on two prompts that pause 700 and 500 ms mid-sentence: a 300 ms hangover cuts
    both users off, 900 ms none; a speculation at 200 ms is withdrawn at each pause the user
    talks on after, and confirmed at each end of turn."""
    out = tmp_path / "sweep"
    prompts = "['Set a timer for, [700 ms] twenty minutes please.','Add eggs and milk to my, [500 ms] shopping list.']"
    sweep(out, "bench=hesitation", "chain=[io.source,vad]", f"bench.prompts={prompts}",
          "vad.min_silence_ms=300,900", "vad.speculate_ms=0,200")
    rows = {tuple(r["overrides"].split()[-2:]): r for r in read_csv(out / "sweep.csv")}
    counts = {k: (r["false_ends"], r["false_ends_hesitant"], r["hesitant_prompts"], r["speculations"],
                  r["speculation_wasted"]) for k, r in rows.items()}
    assert counts == {
        ("vad.min_silence_ms=300", "vad.speculate_ms=0"): ("2", "2", "2", "0", "0"),
        ("vad.min_silence_ms=300", "vad.speculate_ms=200"): ("2", "2", "2", "4", "0"),  # confirmed at the pause
        ("vad.min_silence_ms=900", "vad.speculate_ms=0"): ("0", "0", "2", "0", "0"),
        ("vad.min_silence_ms=900", "vad.speculate_ms=200"): ("0", "0", "2", "4", "2"),
    }
    assert all(r["wer"] == "" for r in rows.values())  # no STT in this chain: no words to score
    md = (out / "sweep.md").read_text()
    assert "| speculation wasted | false ends |" in md and "| WER |" not in md
    assert "`vad.min_silence_ms=900 vad.speculate_ms=200` |" in md and "| 2/4 (50 %) | 0/2, hesitant 0/2 |" in md
    assert f"Every job: `bench.prompts={prompts}" in md  # an override with spaces stays whole
    job = json.loads((out / "3" / "job.json").read_text())
    assert job["figures"]["false_ends"] == 0 and job["figures"]["speculation_wasted"] == 2
    scored = json.loads((Path(job["run_dir"]) / "accuracy.json").read_text())
    assert [d["cut_off_turns"] for d in scored["conversations"]] == [[], []]


# -- the outcome of a sweep ---------------------------------------------------------------------

T = "tests.support.nodes."
MARK = f"""chain: [src, mark]
src: {{_target_: {T}CountSource, n: 3}}
mark:
  _target_: {T}MarkSetup
  path: ???
  fail: false
"""


def test_a_dry_run_sweep_sets_nothing_up_and_starts_no_server(tmp_path):
    mark = tmp_path / "setup-ran"
    marked = MARK.replace("???", str(mark))
    env = write_recipes(tmp_path / "conf", stops_mark=marked, stops_mark_server=marked + f"""server:
  command: [sh, -c, "echo started > {mark}.server"]
  ready_url: http://127.0.0.1:9/health
  start_timeout_s: 2
""")
    out = run_cli(["-m", "recipe=stops_mark_server,stops_mark", "dry_run=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("src.text -> mark.text") == 2  # each job's graph, printed
    assert not mark.exists() and not Path(f"{mark}.server").exists()
    rows = read_csv(tmp_path / "sweep" / "sweep.csv")
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_a_sweep_with_a_failed_job_writes_its_report_then_exits_non_zero(tmp_path):
    env = write_recipes(tmp_path / "conf", stops_mark=MARK)
    out = run_cli(["-m", "recipe=stops_mark", f"mark.path={tmp_path / 'setup-ran'}", "mark.fail=false,true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, env, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    rows = read_csv(tmp_path / "sweep" / "sweep.csv")
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "node 'mark' failed: RuntimeError: model file is corrupt" in rows[1]["error"]
    assert "2 jobs, 1 ok, 1 failed" in (tmp_path / "sweep" / "sweep.md").read_text()
    assert "sweep: 2 jobs, 1 failed" in out.stderr
