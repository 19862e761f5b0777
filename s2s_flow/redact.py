"""Secrets never reach the terminal or a run or sweep directory.

What is secret: the parameters a node class declares in ``secret_params`` (read from the
class its ``_target_`` names, as validation does), the value after ``--api-key`` or
``--hf-token`` in ``server.command``, and environment variables named like keys
(``OPENAI_API_KEY``, ``HF_TOKEN``, ``server.env.VLLM_API_KEY``).

How they are kept out:
- :func:`hide_overrides`: a secret typed on the command line reaches Hydra as
  ``${oc.env:S2S_SECRET_n}``, its value in this process's environment, so what Hydra
  records and prints (multirun.yaml, launcher lines, job.json, sweep.csv) never holds it;
  jobs resolve it, joblib and submitit workers too (they inherit the environment).
- :func:`masked`: a config with every secret shown as ``***`` (the run's config.yaml;
  :class:`MaskSecrets` does the same for the sweep's multirun.yaml).
- :func:`guard`: stdout, stderr and every log record pass through :func:`text`, which masks
  each secret value this process knows (``--cfg job --resolve``, a server's error text);
  so do the files written from free text (error.txt, job.json, the model server's log).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

__all__ = ["MASK", "MaskSecrets", "argv", "command_secrets", "guard", "hide_overrides", "masked", "register",
           "text", "values"]

MASK = "***"
#: server command-line flags whose value is a secret (vLLM, llama-server, SGLang)
SECRET_FLAGS = ("--api-key", "--hf-token")
#: environment variables that hold secrets, by name
_SECRET_ENV = re.compile(r"^S2S_SECRET_|(API_KEY|_TOKEN|_SECRET|PASSWORD)$")
#: shorter values are masked in configs but not searched for in free text ("EMPTY", "none")
MIN_TEXT_LEN = 6

_known: tuple[str, ...] = ()  # secret values masked in text, longest first (replaced whole: thread-safe)


# -- what is secret ---------------------------------------------------------------------


@functools.cache
def _declared(target: str) -> frozenset[str]:
    from s2s_flow.errors import S2SError
    from s2s_flow.graph import load_class

    try:
        return frozenset(load_class(target, "").secret_params)
    except S2SError:
        return frozenset()  # not a node class: validation says so


def _plain(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=False)
    return cfg


def secret_paths(cfg: Any) -> set[str]:
    """Dotted paths of the secret parameters of every node in ``cfg`` (set or not), and of
    secret-named ``server.env`` entries."""
    found: set[str] = set()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                for name in _declared(node["_target_"]):
                    found.add(path + name)
                    source = _interpolated(node.get(name), path)
                    if source:  # io.source.api_key: ${..api_key} -> io.api_key holds the secret too
                        found.add(source)
            for key, value in node.items():
                if path or key != "hydra":
                    walk(value, f"{path}{key}.")

    data = _plain(cfg)
    walk(data, "")
    env = (data.get("server") or {}).get("env") if isinstance(data, dict) else None
    if isinstance(env, dict):
        found.update(f"server.env.{name}" for name in env if _SECRET_ENV.search(str(name)))
    return found


_INTERPOLATION = re.compile(r"^\$\{(\.*)([A-Za-z_][\w.]*)\}$")


def _interpolated(value: Any, path: str) -> str | None:
    """The config path a plain ``${a.b}`` or relative ``${..b}`` interpolation at ``path`` reads."""
    match = _INTERPOLATION.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    dots, key = match.groups()
    if not dots:
        return key
    parts = path.rstrip(".").split(".") if path else []
    up = len(dots) - 1
    if up > len(parts):
        return None
    return ".".join([*parts[: len(parts) - up], key])


def _flagged(args: list[Any]) -> Iterator[tuple[int, str, str]]:
    """(index, secret, masked argument) for each secret in a command line."""
    for i, arg in enumerate(map(str, args)):
        for flag in SECRET_FLAGS:
            if arg == flag and i + 1 < len(args):
                yield i + 1, str(args[i + 1]), MASK
            elif arg.startswith(flag + "="):
                yield i, arg[len(flag) + 1:], f"{flag}={MASK}"


def argv(args: Iterable[Any]) -> list[str]:
    """A command line as it may be shown or logged: secret flag values masked."""
    out = [str(a) for a in args]
    for i, _, shown in _flagged(out):
        out[i] = shown
    return out


def command_secrets(args: Iterable[Any], env: dict[str, str] | None = None) -> set[str]:
    """The secrets a server is started with: flag values in its argv, secret-named env entries."""
    found = {secret for _, secret, _ in _flagged(list(args))}
    return found | {str(v) for k, v in (env or {}).items() if _SECRET_ENV.search(k) and v}


def _command(value: Any) -> list[Any]:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError:
            return value.split()
    return list(value) if isinstance(value, (list, tuple)) else []


def values(cfg: Any) -> set[str]:
    """The secret values in ``cfg`` (resolved): for :func:`register`."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg or {})
    found = set()
    for path in secret_paths(cfg):
        try:
            value = OmegaConf.select(cfg, path)
        except Exception:  # an interpolation that does not resolve here: nothing to mask
            continue
        if value not in (None, ""):
            found.add(str(value))
    try:
        command = OmegaConf.select(cfg, "server.command")
        command = OmegaConf.to_container(command, resolve=True) if isinstance(command, ListConfig) else command
    except Exception:
        command = None
    return found | command_secrets(_command(command))


def masked(cfg: Any) -> Any:
    """A plain copy of ``cfg`` (unresolved) with every secret shown as ``***``."""
    data = _plain(cfg)
    paths = secret_paths(data)

    def walk(node: Any, path: str) -> Any:
        if path == "server.command.":
            node = _masked_command(node)
        if isinstance(node, dict):
            return {k: MASK if f"{path}{k}" in paths and v not in (None, "") else walk(v, f"{path}{k}.")
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}{i}.") for i, v in enumerate(node)]
        return text(node) if isinstance(node, str) else node

    return walk(data, "")


def _masked_command(command: Any) -> Any:
    args = _command(command)
    shown = argv(args)
    if shown == [str(a) for a in args]:
        return command
    return shown if isinstance(command, list) else shlex.join(shown)


# -- text --------------------------------------------------------------------------------


def register(secrets: Iterable[Any]) -> None:
    """Mask these values, from now on, in everything :func:`text` sees."""
    global _known
    new = {str(s) for s in secrets if s is not None and len(str(s)) >= MIN_TEXT_LEN} - set(_known)
    if new:
        _known = tuple(sorted({*_known, *new}, key=len, reverse=True))


def text(value: str) -> str:
    """``value`` with every known secret replaced by ``***``."""
    for secret in _known:
        if secret in value:
            value = value.replace(secret, MASK)
    return value


class _Masked:
    """A text stream (stdout, stderr) that masks known secrets in what is written to it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        self._stream.write(text(s) if isinstance(s, str) else s)
        return len(s)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _masked_records(make: Any) -> Any:
    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if _known:
            try:
                message = record.getMessage()
            except Exception:  # bad format arguments: logging reports them when it emits the record
                return record
            shown = text(message)
            if shown != message:
                record.msg, record.args = shown, ()
            if record.exc_info and not record.exc_text:
                record.exc_text = text(logging.Formatter().formatException(record.exc_info))
        return record

    factory.masks_secrets = True  # type: ignore[attr-defined]
    return factory


def guard() -> None:
    """From now on this process's stdout, stderr and log records mask every known secret
    (those of the environment now, and all that :func:`register` is given later)."""
    register(value for name, value in os.environ.items() if _SECRET_ENV.search(name))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Masked):
            setattr(sys, name, _Masked(stream))
    make = logging.getLogRecordFactory()
    if not getattr(make, "masks_secrets", False):
        logging.setLogRecordFactory(_masked_records(make))


# -- the command line and Hydra ----------------------------------------------------------


def _first_job(args: list[str]) -> list[str]:
    """The overrides of a sweep's first job (each sweep's first value), to compose it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for arg in args:
        override = parser.parse_override(arg)
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()))
            arg = f"{arg.partition('=')[0]}={first}"
        out.append(arg)
    return out


def _carry(secret: Any) -> str:
    """``${oc.env:NAME}`` with the secret in this process's environment under NAME."""
    secret = str(secret)
    for name, value in os.environ.items():
        if name.startswith("S2S_SECRET_") and value == secret:
            break
    else:
        n = 1
        while f"S2S_SECRET_{n}" in os.environ:  # never a name the user set
            n += 1
        name = f"S2S_SECRET_{n}"
        os.environ[name] = secret
    register([secret])
    return "${oc.env:" + name + "}"


def hide_overrides(args: list[str], cfg: DictConfig | None = None) -> list[str]:
    """``args`` with each secret value of an override replaced by ``${oc.env:S2S_SECRET_n}``;
    every secret of the config is masked in this process's output from now on.

    Which overrides hold secrets is read from the composed config ``cfg`` (else the first job
    of the sweep is composed here); when that fails, Hydra reports the error and nothing
    is hidden."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, Override

    from s2s_flow.compose import compose

    overrides = [(i, a) for i, a in enumerate(args) if "=" in a and not a.startswith("-")]
    if not overrides:
        return list(args)
    parser = OverridesParser.create()
    try:
        parsed: list[tuple[int, str, Override]] = [(i, a, parser.parse_override(a)) for i, a in overrides]
        if cfg is None:
            cfg, _ = compose(_first_job([a for _, a in overrides]))
    except Exception:  # not parsable or not composable: Hydra answers with the error
        return list(args)
    register(values(cfg))
    paths, out = secret_paths(cfg), list(args)
    for i, arg, override in parsed:
        key = override.key_or_group
        head, _, body = arg.partition("=")
        value = override.value()
        if key in paths or (key.startswith("server.env.") and _SECRET_ENV.search(key)):
            if isinstance(value, ChoiceSweep):
                out[i] = f"{head}=" + ",".join(_carry(v) for v in value.list)
            elif not override.is_sweep_override() and value not in (None, "") and "${" not in str(value):
                out[i] = f"{head}={_carry(value)}"
        elif key == "server.command" and not override.is_sweep_override():
            for _, secret, _ in _flagged(_command(value)):
                if secret and "${" not in secret and secret in body:
                    body = body.replace(secret, _carry(secret))
            out[i] = f"{head}={body}"
    return out


class MaskSecrets(Callback):
    """Hydra callback (conf/config.yaml): masks the sweep's multirun.yaml, and lets every job,
    also in a worker process, mask its secrets in its output."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra saves this very config as multirun.yaml next. Jobs are composed afresh from
        # the config files and the overrides, so masking the sweep's copy changes no job.
        shown = masked(_body(config))
        with read_write(config), open_dict(config):
            for key, value in shown.items():
                config[key] = value

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        guard()
        register(values(config))
        subdir = config.hydra.output_subdir
        if subdir is not None:  # hydra.output_subdir=.hydra: Hydra has just saved the config there
            path = Path(config.hydra.runtime.output_dir, subdir, "config.yaml")
            if path.exists():
                path.write_text(OmegaConf.to_yaml(OmegaConf.create(masked(_body(config)))))


def _body(config: DictConfig) -> dict[str, Any]:
    """The job's part of a Hydra config (without ``hydra:``), unresolved."""
    data = OmegaConf.to_container(config, resolve=False)
    assert isinstance(data, dict)
    data.pop("hydra", None)
    return data
