"""Composing the Hydra config outside of a run, and turning Hydra's errors into answers."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from s2s_flow.errors import ConfigError

__all__ = ["conf_dir", "compose", "config_error", "redact", "search_path"]

_SECRET = re.compile(r"(api_?key|token|secret|password)", re.I)


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


def config_error(exc: BaseException) -> ConfigError:
    """One paragraph for the common Hydra/OmegaConf failures; the raw text otherwise."""
    text = str(exc).strip()
    m = re.search(r"Could not find '([\w/]+)/(\w[\w.-]*)'\s*\n*\s*Available options in '(\w+)':\s*(.*)",
                  text, re.S)
    if m:
        group, bad, options = m.group(1), m.group(2), m.group(4).split()
        return ConfigError(f"{group}={bad} is not a known {group} option; choose one of: "
                           f"{', '.join(f'{group}={o}' for o in options)}")
    m = re.search(r"Could not override '([\w.]+)'.*?Key '(\w+)' is not in struct", text, re.S)
    if m:
        return ConfigError(f"{m.group(1)} is not a known option ({text.splitlines()[0]}); check the spelling "
                           f"with `s2s-run --cfg job`, or add it with +{m.group(1)}=... if it is new")
    if "Error parsing override" in text or "mismatched input" in text or "no viable alternative" in text:
        first = text.splitlines()[0]
        return ConfigError(f"{first}. Overrides look like group=option or key.sub=value "
                           "(e.g. llm=chat llm.model=qwen3 io.input=question.wav)")
    return ConfigError(text.splitlines()[0] if text else type(exc).__name__)


def compose(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """The job config for these overrides, and the chosen option of each group."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    extra = search_path()
    if extra:
        overrides = [*overrides, f"hydra.searchpath=[{','.join(extra)}]"]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="s2s-run"):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as exc:
        raise config_error(exc) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with_flag = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(with_flag, dict)
    with_flag.pop("hydra", None)
    return OmegaConf.create(with_flag), choices


def redact(cfg: Any) -> Any:
    """A plain copy of ``cfg`` with every secret-looking value replaced by '***'."""
    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ("***" if _SECRET.search(str(k)) and v else walk(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(data)
