"""Errors that are answers: each says what was wrong, where, and what to type instead."""

from __future__ import annotations


class S2SError(Exception):
    """Base of the errors s2s-run reports as one paragraph (no traceback)."""

    exit_code = 1


def answer_within(exc: BaseException) -> S2SError | None:
    """The S2SError a wrapper was raised from, if any (e.g. a resolver's, inside OmegaConf's):
    report that answer rather than the wrapper around it."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, S2SError):
        cause = cause.__cause__ or cause.__context__
    return cause


class ConfigError(S2SError):
    """The composed configuration cannot run. Reported before any model loads."""

    exit_code = 2


class MissingDependency(S2SError):
    """A backend's library is not installed.

    ``command`` is the full install command where an extra cannot express it
    (``pip install --no-deps silero-vad onnxruntime``); it wins over ``pip_name``.
    """

    def __init__(self, module: str, extra: str, *, pip_name: str | None = None,
                 command: str | None = None, cause: Exception | None = None):
        self.module, self.extra = module, extra
        package = pip_name or f"s2s-flow[{extra}]"
        self.command = command or f"pip install '{package}'"
        why = f" ({cause})" if cause else ""
        super().__init__(
            f"the {extra} backend needs the Python module '{module}', which is not installed{why}. "
            f"Install it with: {self.command}"
        )


class ModelNotAvailable(S2SError):
    """A model that needs a download was asked for on a machine that cannot reach its source.

    ``download`` is the command that fetches it, for a model that does not come from the hub
    (a spaCy wheel, say); a hub model's is ``huggingface-cli download {model}``.
    """

    def __init__(self, model: str, backend: str, hint: str = "", *, download: str | None = None):
        self.model, self.backend = model, backend
        self.download = download or f"huggingface-cli download {model}"
        if download is None:
            need = "a download from the hub, which this machine cannot reach"
            fix = (f"Download it once where the hub is reachable ({self.download}) "
                   "and point the option at the local directory")
        else:
            need = "a download this machine cannot make"
            fix = f"Fetch it once while the network is reachable ({download})"
        super().__init__(
            f"model {model!r} is not available locally and needs {need} ({backend}). "
            f"{fix}{'; ' + hint if hint else ''}."
        )


class NodeFailed(S2SError):
    """A node raised while running; the graph was stopped."""

    def __init__(self, node: str, exc: BaseException):
        self.node, self.exc = node, exc
        detail = str(exc) if isinstance(exc, S2SError) else f"{type(exc).__name__}: {exc}"
        super().__init__(f"node '{node}' failed: {detail}")


class Stopped(S2SError):
    """The run was stopped by a signal (SIGINT, SIGTERM): what was already written is kept."""

    exit_code = 130


class Abort(BaseException):
    """Carries an answer out through code that catches every Exception (Hydra's launchers
    and its error report, which would print a traceback) up to s2s-run, which prints it."""

    def __init__(self, error: S2SError):
        super().__init__(str(error))
        self.error = error
