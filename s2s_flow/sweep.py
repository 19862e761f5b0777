"""Hydra sweeps that benchmark configurations side by side.

``s2s-run -m bench=latency tts=piper,espeak llm.model=a,b`` runs every combination. This
callback (conf/config.yaml, ``hydra.callbacks``) writes ``job.json`` into each job's dir --
its overrides, latency figures or error, the launcher, whether the job ran in a fresh
process or one that had run jobs before, the hardware, package versions and the model
server it used -- and gathers all jobs into ``sweep.csv``, ``sweep.md`` and ``sweep.png``
in the sweep dir. A failed job is a row with its error; the other rows are kept, and
s2s-run then exits 1. Ctrl-C or SIGTERM ends the sweep after the row of the job it stopped.
A job that played the benchmark corpus (bench=latency, bench=hesitation) is also scored
against it: turns that ended before the user had finished, and the WER of what STT heard
(s2s_flow/accuracy.py); withdrawn speculative replies come with the latency figures.

Rebuild the summary of a sweep dir (e.g. after a crash): ``python -m s2s_flow.sweep DIR``
"""

from __future__ import annotations

import csv
import gc
import json
import os
import re
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hydra.experimental.callback import Callback

from s2s_flow import redact
from s2s_flow.machine import hardware, rss_mb, versions
from s2s_flow.metrics import PARTS

__all__ = ["SweepReport", "collect", "write_report", "main", "last_sweep"]

#: Columns of the per-stage figures, in table order: (job.json key, column title).
STAGE_COLUMNS = (("voice_to_voice", "voice-to-voice"), ("stage_vad", "VAD"), ("stage_stt", "STT"),
                 ("stage_llm", "LLM 1st words"), ("stage_tts", "TTS 1st audio"),
                 ("stage_gate", "held"), ("ring_wait", "rings"))

_jobs_in_process = 0  # jobs started in this process: more than one means a reused process


class SweepReport(Callback):
    """Per job: ``job.json``. Per sweep: ``sweep.csv``, ``sweep.md``, ``sweep.png``, and the
    outcome s2s-run's exit code tells (:func:`last_sweep`); a job stopped by a signal stops
    the sweep."""

    def __init__(self) -> None:
        self._sweep_pid: int | None = None
        self._started: tuple[float, float | None, dict[str, int]] | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._sweep_pid = os.getpid()

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if not _multirun(config):
            return
        global _jobs_in_process
        _jobs_in_process += 1
        gc.collect()  # a previous job's models, held only by reference cycles, go before this one loads
        self._started = (time.monotonic(), rss_mb(), _leftovers() if _jobs_in_process > 1 else {})

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        if not _multirun(config):
            return
        out = Path(config.hydra.runtime.output_dir)
        info = job_info(config, job_return, self._started)
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.json").write_text(redact.text(json.dumps(info, indent=1, default=str)))
        if info["status"] != "ok" and not (out / "error.txt").exists():
            (out / "error.txt").write_text(redact.text(info["error"] + "\n"))
        if os.getpid() != self._sweep_pid:
            return
        # sequential, in the sweep's process: keep the summary current (the plot comes at the end,
        # or from `python -m s2s_flow.sweep DIR`: drawing it takes a second)
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir, plot=False)
        value = job_return._return_value
        if isinstance(value, Mapping) and value.get("stopped"):  # Ctrl-C or SIGTERM: end the sweep too
            from s2s_flow.errors import Abort, Stopped

            raise Abort(Stopped(f"job {info['job']}: {info['error']}. No further job was started; the summary "
                                f"of the {len(rows)} job{'s' * (len(rows) != 1)} run: {sweep_dir / 'sweep.md'}"))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        global _last
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir, plot=not config.get("dry_run"))
        failed = sum(r["status"] != "ok" for r in rows)
        _last = SweepOutcome(len(rows), failed, sweep_dir / "sweep.md")
        print(f"sweep: {len(rows)} job{'s' * (len(rows) != 1)}"
              f"{f', {failed} failed' if failed else ''}: {sweep_dir / 'sweep.md'}", file=sys.stderr)


class SweepOutcome(NamedTuple):
    """How a sweep ended: its jobs, how many failed, and where its summary is."""

    jobs: int
    failed: int
    summary: Path


_last: SweepOutcome | None = None


def last_sweep() -> SweepOutcome | None:
    """What the last sweep of this process came to: s2s-run exits 1 when a job failed."""
    return _last


def _multirun(config: Any) -> bool:
    from hydra.types import RunMode

    return config.hydra.mode == RunMode.MULTIRUN


# -- what one job records -------------------------------------------------------------------


def job_info(config: Any, job_return: Any,
             started: tuple[float, float | None, dict[str, int]] | None = None) -> dict[str, Any]:
    """Everything a row of the sweep needs, taken where the job ran."""
    from hydra.core.utils import JobStatus

    value = job_return._return_value  # the property re-raises a failure; we want to record it
    if job_return.status == JobStatus.FAILED:
        error = f"{type(value).__name__}: {value}"
        result: dict[str, Any] = {}
    else:
        result = dict(value) if isinstance(value, Mapping) else {}
        error = str(result.get("error") or "")
    server = result.pop("server", None)
    if not error and not result.get("dry_run"):
        result.update(_accuracy(config))
    launcher = str(config.hydra.launcher.get("_target_", ""))
    t0, rss0, leftovers = started or (None, None, {})
    return {
        "job": int(config.hydra.job.num),
        "overrides": list(job_return.overrides or []),
        "choices": {k: str(v) for k, v in config.hydra.runtime.choices.items()
                    if v is not None and not str(k).startswith("hydra/")},
        "status": "failed" if error else "ok",
        "error": error,
        "figures": {k: v for k, v in result.items() if k not in ("run_dir", "error", "stopped", "dry_run")},
        "run_dir": str(config.hydra.runtime.output_dir),
        "launcher": _launcher_name(launcher, config.hydra.launcher),
        "process": "fresh" if _jobs_in_process <= 1 else f"reused (its job {_jobs_in_process})",
        "pid": os.getpid(),
        "server": _server_text(server),
        "duration_s": round(time.monotonic() - t0, 2) if t0 else None,
        "rss_mb_start": rss0,
        "leftovers_at_start": leftovers,
        "rss_mb_end": rss_mb(),
        "threads_end": threading.active_count(),
        "hardware": hardware(),
        "versions": versions(),
    }


def _accuracy(config: Any) -> dict[str, Any]:
    """The job's score against the corpus it played (none: no corpus). A scoring failure is
    the row's note, not the job's: its latency figures stand."""
    from s2s_flow import accuracy

    try:
        result = accuracy.for_job(config, config.hydra.runtime.output_dir)
    except Exception as exc:  # noqa: BLE001 -- shown in the row and on stderr, never hidden
        print(f"sweep: job {config.hydra.job.num}: not scored against its corpus: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return {"accuracy_error": f"{type(exc).__name__}: {exc}"}
    return {key: result[key] for key, _ in accuracy.FIGURES} if result else {}


def _launcher_name(target: str, launcher: Any) -> str:
    name = target.rsplit(".", 1)[-1].removesuffix("Launcher").lower() or "basic"
    if "joblib" in target:
        return f"joblib (n_jobs={launcher.get('n_jobs')})"
    if "submitit" in target:
        return f"submitit_{name}"
    return name


def _server_text(server: Any) -> str:
    if not isinstance(server, Mapping):
        return "none"
    how = "started for this job" if server.get("started") else "shared (already running)"
    return f"{how}: {server.get('url', '?')}"


#: Types whose instances hold a model: none may outlive the job that made them.
_MODEL_TYPES = frozenset({"InferenceSession", "WhisperModel", "PiperVoice", "Llama", "PreTrainedModel"})


def _leftovers() -> dict[str, int]:
    """Nodes and model objects still alive when a job starts in a reused process: a previous
    job's ``close()`` and teardown should have freed them all (empty dict)."""
    from s2s_flow.node import Node

    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in _MODEL_TYPES or isinstance(obj, Node):
            key = "Node" if isinstance(obj, Node) else name
            counts[key] = counts.get(key, 0) + 1
    return counts


# -- the sweep's summary -------------------------------------------------------------------


def collect(sweep_dir: Path | str) -> list[dict[str, Any]]:
    """One flat row per job of a sweep dir, from each job's ``job.json`` (sorted by job number)."""
    rows = []
    for path in Path(sweep_dir).glob("**/job.json"):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows.append(_row(info))
    return sorted(rows, key=lambda r: r["job"])


def _row(info: Mapping[str, Any]) -> dict[str, Any]:
    fig = info.get("figures", {})
    row: dict[str, Any] = {
        "job": info["job"],
        "overrides": " ".join(info.get("overrides", [])),
        "status": info["status"],
        "error": info.get("error", ""),
        "turns": fig.get("measured_turns"),
    }
    for key, _ in STAGE_COLUMNS:
        row[f"{key}_p50_ms"], row[f"{key}_p95_ms"] = fig.get(f"{key}_p50_ms"), fig.get(f"{key}_p95_ms")
    row["voice_to_voice_max_ms"] = fig.get("voice_to_voice_max_ms")
    row["warmup_voice_to_voice_ms"] = fig.get("warmup_voice_to_voice_ms")
    for key in ("turn_confirmed", "stt", "llm_first_token", "llm_first_words", "llm_first_sentence", "tts_first_audio"):
        row[f"{key}_p50_ms"] = fig.get(f"{key}_p50_ms")
    row["drops"] = fig.get("drops_total")
    row["calibration"] = fig.get("calibration")  # threads: auto, as timed on the machine of the row
    for key in ("speculations", "speculation_wasted", "speculation_confirmed", "prompts", "false_ends",
                "hesitant_prompts", "false_ends_hesitant", "wer", "accuracy_error"):
        row[key] = fig.get(key)
    for group, choice in info.get("choices", {}).items():
        row[f"choice:{group}"] = choice
    for key in ("launcher", "process", "pid", "server", "duration_s", "rss_mb_start", "rss_mb_end",
                "threads_end"):
        row[key] = info.get(key)
    row["leftovers_at_start"] = " ".join(f"{k}:{n}" for k, n in (info.get("leftovers_at_start") or {}).items())
    for key, value in info.get("hardware", {}).items():
        row[key] = value
    for name, version in info.get("versions", {}).items():
        row[f"version:{name}"] = version
    row["run_dir"] = info.get("run_dir")
    return row


def write_report(sweep_dir: Path | str, *, plot: bool = True) -> list[dict[str, Any]]:
    """``sweep.csv`` and ``sweep.md`` (and ``sweep.png`` when ``plot``) in ``sweep_dir``."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        return rows
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(sweep_dir / "sweep.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (sweep_dir / "sweep.md").write_text(markdown(rows, sweep_dir))
    if plot:
        try:
            plot_sweep(rows, sweep_dir / "sweep.png")
        except ImportError as exc:
            print(f"sweep: no sweep.png: matplotlib is missing ({exc}); pip install 's2s-flow[plot]'",
                  file=sys.stderr)
    return rows


def _overrides(row: Mapping[str, Any]) -> list[str]:
    """A row's overrides, split where the next one begins (a value may hold spaces: a prompt)."""
    return [o for o in re.split(r" +(?=[+~]{0,2}[\w./@-]+=)", row["overrides"]) if o]


def _common(rows: list[Mapping[str, Any]]) -> list[str]:
    """Overrides every job shares (e.g. bench=latency): said once, not in every row."""
    sets = [set(_overrides(r)) for r in rows]
    return sorted(set.intersection(*sets)) if sets else []


def _label(row: Mapping[str, Any], common: Iterable[str]) -> str:
    own = [o for o in _overrides(row) if o not in set(common)]
    return " ".join(own) or "(defaults)"


def _cell(row: Mapping[str, Any], key: str) -> str:
    p50, p95 = row.get(f"{key}_p50_ms"), row.get(f"{key}_p95_ms")
    if p50 is None:
        return "-"
    return f"{p50:.0f} / {p95:.0f}" if p95 is not None else f"{p50:.0f}"


def _wasted(row: Mapping[str, Any]) -> str:
    made, wasted = row.get("speculations"), row.get("speculation_wasted")
    return f"{wasted}/{made} ({100 * wasted / made:.0f} %)" if made and wasted is not None else "-"


def _false_ends(row: Mapping[str, Any]) -> str:
    if row.get("false_ends") is None:
        return "-"
    cut = f"{row['false_ends']}/{row.get('prompts')}"
    if row.get("hesitant_prompts"):
        cut += f", hesitant {row.get('false_ends_hesitant')}/{row['hesitant_prompts']}"
    return cut


def _wer(row: Mapping[str, Any]) -> str:
    return "-" if row.get("wer") is None else f"{100 * row['wer']:.1f} %"


#: Counts after the stages: (title, the row key that says a job measured it, the cell)
COUNT_COLUMNS = (("speculation wasted", "speculations", _wasted), ("false ends", "false_ends", _false_ends),
                 ("WER", "wer", _wer))


def _columns(rows: list[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[tuple[str, str, Any]]]:
    """The stage and count columns some job filled: a sweep without speculation or corpus has none
    of theirs."""
    stages = [(k, t) for k, t in STAGE_COLUMNS if k != "stage_gate" or any(r.get(f"{k}_p50_ms") is not None
                                                                           for r in rows)]
    counts = [c for c in COUNT_COLUMNS if any(r.get(c[1]) for r in rows)]
    return stages, counts


def _env_keys(rows: list[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """Environment columns that are the same in every row, and those that differ."""
    keys = ["host", "cpu", "cores", "ram_gb", "gpu", "os", "python"]
    keys += sorted({k for r in rows for k in r if k.startswith("version:")})
    same = [k for k in keys if len({str(r.get(k)) for r in rows}) == 1]
    return same, [k for k in keys if k not in same]


def markdown(rows: list[Mapping[str, Any]], sweep_dir: Path | str = "") -> str:
    """The sweep as a Markdown page: one row per configuration, environment below."""
    common = _common(rows)
    failed = [r for r in rows if r["status"] != "ok"]
    same, differ = _env_keys(rows)
    lines = [f"# Sweep {sweep_dir}".rstrip(), ""]
    lines.append(f"{len(rows)} jobs, {len(rows) - len(failed)} ok, {len(failed)} failed."
                 + (f" Every job: `{' '.join(common)}`." if common else ""))
    lines.append("Latency in ms after the user's true end of speech, p50 / p95 over the measured turns "
                 "(the warm-up turn, first of each job, is shown on its own). Stages are the parts of "
                 "the critical path; they add up to voice-to-voice (held: a speculative reply waiting "
                 "for its turn to be confirmed). Speculation wasted: replies started on a pause and "
                 "withdrawn because the user went on, of all started early. False ends: turns that "
                 "ended before the user had finished, of the prompts played (and of those with a "
                 "hesitation). WER: the user's final transcripts against the prompts.")
    lines.append("")
    stages, counts = _columns(rows)
    timed = ["threads timed here"] if any(r.get("calibration") for r in rows) else []  # threads: auto
    head = ["job", "overrides", *(title for _, title in stages), *(title for title, _, _ in counts), "warm-up",
            "turns", "drops", *timed, "launcher", "process", "server", *differ]
    numeric = range(2, 2 + len(stages) + len(counts) + 3)
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("--:" if i in numeric else "---" for i in range(len(head))) + "|")
    for r in rows:
        if r["status"] != "ok":
            cells = [str(r["job"]), f"`{_label(r, common)}`", "**failed**", *[""] * (len(stages) + len(counts) + 1)]
        else:
            warmup = r["warmup_voice_to_voice_ms"]
            cells = [str(r["job"]), f"`{_label(r, common)}`", *(_cell(r, k) for k, _ in stages),
                     *(cell(r) for _, _, cell in counts), "-" if warmup is None else f"{warmup:.0f}",
                     str(r["turns"] if r["turns"] is not None else "-")]
        cells += [str(r.get("drops") if r.get("drops") is not None else "-"),
                  *([str(r.get("calibration") or "-")] if timed else []), str(r.get("launcher") or "-"),
                  str(r.get("process") or "-"), str(r.get("server") or "-"),
                  *(str(r.get(k, "-")) for k in differ)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if failed:
        lines += ["", "## Failed jobs", ""]
        for r in failed:
            lines.append(f"- job {r['job']} `{r['overrides']}`: {r['error']} ({r['run_dir']})")
    unscored = [r for r in rows if r.get("accuracy_error")]
    if unscored:
        lines += ["", "## Jobs not scored against their corpus", ""]
        lines += [f"- job {r['job']}: {r['accuracy_error']}" for r in unscored]
    leaks = [r for r in rows if r.get("leftovers_at_start")]
    if leaks:
        lines += ["", "## Objects a previous job left alive in a reused process", ""]
        lines += [f"- job {r['job']} started with {r['leftovers_at_start']} still alive" for r in leaks]
    lines += ["", "## Environment (every job)", ""]
    hw = [f"{k}: {rows[0].get(k)}" for k in same if not k.startswith("version:")]
    ver = [f"{k.removeprefix('version:')} {rows[0].get(k)}" for k in same if k.startswith("version:")]
    lines.append("- " + "; ".join(hw))
    if ver:
        lines.append("- versions: " + ", ".join(ver))
    return "\n".join(lines) + "\n"


_PART_KEYS = {"vad": "stage_vad", "stt": "stage_stt", "llm": "stage_llm", "tts": "stage_tts", "gate": "stage_gate",
              "ring": "ring_wait"}


def plot_sweep(rows: list[Mapping[str, Any]], path: Path | str) -> Path:
    """One bar per configuration: its p50 critical path by stage, with voice-to-voice p50 and p95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common = _common(rows)
    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.45 * len(rows)))
    for y, r in enumerate(rows):
        if r["status"] != "ok" or r.get("voice_to_voice_p50_ms") is None:
            ax.text(0, y, f"  {'failed' if r['status'] != 'ok' else 'no reply audio'}", va="center",
                    color="firebrick", fontsize=8)
            continue
        left = 0.0
        for part, (label, color) in PARTS.items():  # the timeline's colours, part for part
            width = r.get(f"{_PART_KEYS[part]}_p50_ms") or 0.0
            ax.barh(y, width, left=left, height=0.6, color=color, label=label if y == 0 else None)
            left += width
        p50, p95 = r["voice_to_voice_p50_ms"], r.get("voice_to_voice_p95_ms")
        ax.plot([p50], [y], "kD", ms=4, label="voice-to-voice p50" if y == 0 else None)
        if p95 is not None:
            ax.plot([p50, p95], [y, y], color="black", lw=1)
            ax.plot([p95], [y], "k|", ms=10, label="p95" if y == 0 else None)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['job']}: {_label(r, common)}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms after the user's true end of speech (bars: stage p50s; diamond: p50, tick: p95)")
    title = "voice-to-voice latency by configuration"
    if common:
        shared = " ".join(re.sub(r"(?<=[=,\[])[~/][^,\]\s]*/", "", o) for o in common)  # paths: file names only
        title += "\n" + textwrap.shorten(f"every job: {shared}", 150, placeholder=" ...")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        order = sorted(range(len(labels)), key=lambda i: labels[i] in ("voice-to-voice p50", "p95"))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7, ncol=7, frameon=False,
                  loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=fig.transFigure)
    ax.grid(axis="x", alpha=0.3)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m s2s_flow.sweep DIR``: rebuild a sweep's summary from its jobs' job.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m s2s_flow.sweep SWEEP_DIR   (e.g. multirun/2025-01-31/12-00-00)", file=sys.stderr)
        sys.exit(2)
    rows = write_report(args[0])
    if not rows:
        print(f"no job.json under {args[0]}: not a sweep dir of s2s-run -m", file=sys.stderr)
        sys.exit(1)
    print(Path(args[0]) / "sweep.md")


if __name__ == "__main__":
    main()
