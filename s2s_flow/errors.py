"""Errors that are answers: each says what was wrong, where, and what to type instead."""

from __future__ import annotations


class S2SError(Exception):
    """Base of the errors s2s-run reports as one paragraph (no traceback)."""

    exit_code = 1


class ConfigError(S2SError):
    """The composed configuration cannot run. Reported before any model loads."""

    exit_code = 2


class MissingDependency(S2SError):
    """A backend's library is not installed."""

    def __init__(self, module: str, extra: str, *, pip_name: str | None = None,
                 cause: Exception | None = None):
        self.module, self.extra = module, extra
        what = f"'{pip_name}'" if pip_name else f"'s2s-flow[{extra}]'"
        super().__init__(
            f"the {extra} backend needs the Python module '{module}', which is not installed "
            f"({cause}). Install it with: pip install {what}"
        )


class ModelNotAvailable(S2SError):
    """A model that needs a hub download was asked for on a machine that cannot reach the hub."""

    def __init__(self, model: str, backend: str, hint: str = ""):
        super().__init__(
            f"model {model!r} is not available locally and needs a download from the hub, "
            f"which this machine cannot reach ({backend}). Download it once where the hub is "
            f"reachable (huggingface-cli download {model}) and point the option at the local "
            f"directory{'; ' + hint if hint else ''}."
        )


class NodeFailed(S2SError):
    """A node raised while running; the graph was stopped."""

    def __init__(self, node: str, exc: BaseException):
        self.node, self.exc = node, exc
        detail = str(exc) if isinstance(exc, S2SError) else f"{type(exc).__name__}: {exc}"
        super().__init__(f"node '{node}' failed: {detail}")
