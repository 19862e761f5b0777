"""``s2s-run``: compose with Hydra, validate, then run the graph (or print it with dry_run=true).

A plain run is composed once up front with Hydra's compose API, so configuration errors
are reported as one paragraph with exit code 2 before anything loads, and ``dry_run``
never creates a run directory. Runs and sweeps (``-m``) then go through ``hydra.main``
for run directories, multirun and launchers. Exit codes: 2 for a configuration error (a run
dir that cannot be made too), 1 for a failed run or a sweep with a failed job, 130 for a signal.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from s2s_flow import redact
from s2s_flow.compose import compose, conf_dir, given_search_path, search_path, with_search_path
from s2s_flow.errors import Abort, ConfigError, S2SError, Stopped
from s2s_flow.graph import Graph, build_graph
from s2s_flow.node import Serving
from s2s_flow.validate import validate

log = logging.getLogger("s2s_flow")

__all__ = ["RunDir", "main", "describe", "plan", "make_output_dir"]


def plan(cfg: DictConfig, choices: dict[str, str]) -> Graph:
    """Compose-time work: wire and validate the graph. Loads no model."""
    if not isinstance(cfg.get("dry_run"), bool):
        raise ConfigError(f"dry_run={cfg.get('dry_run')!r} must be true or false")
    if cfg.get("server") is not None:  # the recipe's model server: its block is checked now, started later
        from s2s_flow.model_server_spec import ServerSpec

        ServerSpec.from_config(cfg.server)
    return validate(build_graph(cfg, choices), conf_dir())


def describe(graph: Graph) -> str:
    """The graph as text: nodes with their ports, then edges with ring capacity/policy."""
    lines = ["nodes:"]
    for name, spec in graph.nodes.items():
        ins = ", ".join(f"{p}:{t.__name__}" for p, t in spec.cls.inputs.items()) or "-"
        outs = ", ".join(f"{p}:{t.__name__}" for p, t in spec.cls.outputs.items()) or "-"
        lines.append(f"  {name:<8} {spec.label:<18} {spec.cls.__module__}.{spec.cls.__name__}")
        lines.append(f"  {'':<8} in [{ins}]  out [{outs}]")
    if graph.skipped:
        lines.append(f"skipped: {', '.join(s + '=none' for s in graph.skipped)}")
    lines.append("edges:")
    for e in graph.edges:
        tag = " (explicit)" if e.explicit else ""
        lines.append(f"  {e.key:<34} {e.type.__name__:<13} ring {e.capacity:>4} {e.policy}{tag}")
    lines += [f"serves: {spec.node.serves}" for spec in graph.nodes.values() if isinstance(spec.node, Serving)]
    return "\n".join(lines)


def _list_recipes(argv: list[str]) -> str:
    """``s2s-run --list-recipes``: every recipe (built-in, then S2S_FLOW_CONFIG_PATH and
    hydra.searchpath roots) with the first line of its header and the command that runs it."""
    roots = [conf_dir(), *search_path()]
    for arg in argv:
        if arg.startswith("hydra.searchpath="):
            roots += given_search_path(arg)
    roots = [str(r).removeprefix("file://") for r in roots]
    lines, seen = [], set()
    for i, root in enumerate(dict.fromkeys(str(r) for r in roots)):
        files = sorted(Path(root, "recipe").glob("*.yaml"))
        if i and files:
            lines.append(f"from {root}/recipe:")
        for path in files:
            header = [ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
            header = [h for h in header if h and not h.startswith("@package")]
            about = header[0] if header else ""
            run = next((h for h in header if h.startswith("s2s-run")), f"s2s-run recipe={path.stem}")
            shadowed = " (shadowed by a recipe of that name listed above)" if path.stem in seen else ""
            seen.add(path.stem)
            lines += [f"  {path.stem:<18} {about}{shadowed}", f"  {'':<18} {run}"]
    return "\n".join(lines) if lines else "no recipes found"


def _list_devices(argv: list[str]) -> str:
    """``s2s-run --list-devices [io=...]``: the sound devices, as the io source lists them (io=mic
    by default); the class is reached through its ``_target_``, so the engine imports no node."""
    from s2s_flow.graph import load_class

    overrides = [a for a in argv if a != "--list-devices"]
    if not any(a.startswith("io=") for a in overrides):
        overrides.append("io=mic")
    cfg, choices = compose(overrides)
    cls = load_class(str(OmegaConf.select(cfg, "io.source._target_")), "io.source")
    lister = getattr(cls, "list_devices", None)
    if lister is None:
        raise ConfigError(f"io={choices.get('io')} has no sound devices to list; use s2s-run --list-devices "
                          "(io=mic)")
    return lister()


def _is_plain(argv: list[str]) -> bool:
    return all(not a.startswith("-") for a in argv)


def _fail(exc: S2SError) -> None:
    print(f"s2s-run: error: {exc}", file=sys.stderr)
    _exit(exc.exit_code)


_threads_before: set[int | None] = set()  # idents of the threads alive when main() began (picklable)


def _exit(code: int) -> None:
    """sys.exit, unless a thread this run started is still alive (a setup() stalled in a
    download, which nothing can stop): Python would wait for it at exit (non-daemon threads,
    and every thread-pool worker, daemon or not: a worker started by a daemon setup thread is a
    daemon too, and concurrent.futures joins it at exit), so flush and leave at once. The recipe
    server and the run dir were seen to on the way here."""
    stuck = [t for t in threading.enumerate() if t.is_alive() and t is not threading.current_thread()
             and t.ident not in _threads_before]
    if stuck:
        log.debug("leaving %d thread(s) behind: %s", len(stuck), ", ".join(t.name for t in stuck))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run_job(cfg: DictConfig, choices: dict[str, str], run_dir: Path) -> dict[str, Any]:
    """One job: plan, run every conversation, write the results into ``run_dir``.
    With dry_run=true (each job of a sweep too) it plans, prints the graph and loads nothing."""
    graph = plan(cfg, choices)
    if cfg.get("dry_run"):
        print(describe(graph), flush=True)
        return {"dry_run": True, "run_dir": str(run_dir)}

    from rich.console import Console

    from s2s_flow import metrics
    from s2s_flow.model_server import managed_server
    from s2s_flow.scheduler import Scheduler

    console = Console(stderr=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(redact.masked(cfg))))
    (run_dir / "choices.json").write_text(json.dumps(choices, indent=2))
    serving = next((spec.node for spec in graph.nodes.values() if isinstance(spec.node, Serving)), None)
    if serving is not None:  # io=realtime: the source serves the run, one fresh graph per connection
        # (Graph.instance(): new nodes, so no session sees another's state; the models stay loaded)
        with managed_server(cfg.get("server"), run_dir, console=console):
            return serving.serve(graph.instance, run_dir, console=console)
    scheduler = Scheduler(graph, run_dir, console=console)
    server = None
    try:
        # The recipe's model server (if any) must answer before the nodes' setup() warms up.
        with managed_server(cfg.get("server"), run_dir, console=console) as server:
            trace = scheduler.run()
    finally:
        (run_dir / "trace.json").write_text(json.dumps(
            {**scheduler.trace.to_dict(), "rings": scheduler.ring_stats}, indent=1))
    if not trace.turns():
        log.warning("no speech was found in the input: no turn was run")
        console.print("[yellow]no speech was found in the input: no turn was run[/yellow]")
    report = metrics.report(trace, scheduler.ring_stats, graph)
    metrics.write(report, run_dir, timeline=bool(OmegaConf.select(cfg, "metrics.timeline", default=False)))
    metrics.show(report, console)
    result: dict[str, Any] = {"turns": len(trace.turns()), "run_dir": str(run_dir), **metrics.figures(report)}
    result.update(_heard(cfg, run_dir, console))
    if server is not None:
        result["server"] = server.info()  # url, started (False: an already running one was used)
    return result


def _heard(cfg: DictConfig, run_dir: Path, console: Any) -> dict[str, Any]:
    """A run that played a corpus (bench=latency, bench=hesitation): how well it heard the user,
    written to accuracy.json and shown. A scoring failure is a warning: the latency figures stand."""
    from s2s_flow import accuracy

    try:
        heard = accuracy.for_job(cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 -- shown, never hidden
        log.warning("not scored against the corpus: %s: %s", type(exc).__name__, exc)
        return {}
    if not heard:
        return {}
    ends = "n/a (io.realtime=false)" if heard["false_ends"] is None else f"{heard['false_ends']}/{heard['prompts']}"
    wer = "n/a" if heard["wer"] is None else f"{heard['wer'] * 100:.1f} %"
    console.print(f"against the corpus: WER {wer}, turns ended before the user had finished {ends} (accuracy.json)")
    return {key: heard[key] for key, _ in accuracy.FIGURES}


# -- the run directory ----------------------------------------------------------------------


class RunDir(Callback):
    """Makes the run dir (``-m``: the sweep dir) before Hydra does (conf/config.yaml,
    ``hydra.callbacks``): one that cannot be made is an answer, not a traceback."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        make_output_dir(config, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        make_output_dir(config, "hydra.sweep.dir")


def make_output_dir(config: Any, key: str) -> None:
    """Make the run (or sweep) dir before Hydra does, so that one that cannot be made or
    written (hydra.run.dir=/proc/x, a path through a file, a read-only disk) is an answer
    with exit code 2, not Hydra's traceback."""
    try:
        path = Path(str(OmegaConf.select(config, key, throw_on_missing=True)))
    except Exception:  # an interpolation only Hydra resolves: it makes the dir itself
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    except OSError as exc:
        what, example = ("run", "outputs/run1") if key == "hydra.run.dir" else ("sweep", "multirun/sweep1")
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise Abort(ConfigError(
            f"{key}={path}: the {what} directory cannot be made or written: {exc.strerror or exc}{where}. "
            f"Point {key} at a directory s2s-run can create and write, e.g. {key}={example}")) from None


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def _job(cfg: DictConfig) -> Any:
        hc = HydraConfig.get()
        choices = {k: str(v) for k, v in hc.runtime.choices.items() if v is not None}
        run_dir = Path(hc.runtime.output_dir)
        try:
            return run_job(cfg, choices, run_dir)
        except Exception as exc:
            if hc.mode != RunMode.MULTIRUN:
                if isinstance(exc, S2SError):
                    _fail(exc)
                raise
            # A failed job is a row of the sweep and the next job runs; a job stopped by a
            # signal stops the sweep after its row (sweep.SweepReport.on_job_end).
            error = str(exc) if isinstance(exc, S2SError) else f"{type(exc).__name__}: {exc}"
            detail = error if isinstance(exc, S2SError) else traceback.format_exc()
            (run_dir / "error.txt").write_text(redact.text(f"{detail}\n"))
            log.error("job failed: %s", error)
            stopped = {"stopped": True} if isinstance(exc, Stopped) else {}
            return {"error": error, "run_dir": str(run_dir), **stopped}

    _job()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _threads_before.update(t.ident for t in threading.enumerate())
    redact.guard()  # first: the log handlers made below write through the masked stderr
    logging.basicConfig(level=os.environ.get("S2S_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # one INFO line per request drowns the turn log
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if "--list-recipes" in argv:
        print(_list_recipes(argv))
        return
    if "--list-devices" in argv:
        try:
            print(_list_devices(argv))
        except S2SError as exc:
            _fail(exc)
        return
    if _is_plain(argv):
        try:
            cfg, choices = compose(argv)
            argv = redact.hide_overrides(argv, cfg)  # Hydra gets ${oc.env:..} for each secret
            graph = plan(cfg, choices)
        except S2SError as exc:
            _fail(exc)
        if cfg.get("dry_run"):
            print(describe(graph))
            return
    else:
        argv = redact.hide_overrides(argv)
    argv = with_search_path(argv)
    sys.argv = [sys.argv[0] if sys.argv else "s2s-run", *argv]
    from s2s_flow.sweep import last_sweep

    before = last_sweep()
    try:
        _hydra_entry()
    except ConfigError as exc:
        _fail(exc)
    except Abort as exc:  # raised past Hydra's catch-alls by the sweep callback (run dir, Ctrl-C)
        _fail(exc.error)
    sweep = last_sweep()
    if sweep is not before and sweep is not None and sweep.failed:  # after its summary was written
        # Every job has ended (a stalled setup can only end a job through a signal, which takes
        # _fail's way out), so this is a plain exit: os._exit would skip the joblib launcher's
        # atexit shutdown and leave its workers holding our stdout for loky's 300 s idle timeout.
        sys.exit(1)


if __name__ == "__main__":
    main()
