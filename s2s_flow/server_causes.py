"""Why a model server failed to start, read from its log: one table of what llama-server (and
vLLM) print when a start goes wrong, each with the cause in words and the fix.

A server's last lines are often a consequence ("failed to load model ''", "exiting due to model
loading error"); the cause is a few lines up ("HTTPLIB failed: Could not establish connection").
:func:`explain` finds the first known cause anywhere in the log, so that is what the user reads.

    explain(log_text, argv, host="127.0.0.1", port=8080)  # "... the model hub ... Fix: ..." or None
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CAUSES", "Cause", "explain", "last_start"]


@dataclass(frozen=True)
class Cause:
    """A known failure: a pattern of the server's log, what it means, and the fix (both may name
    ``{repo}``, ``{model}``, ``{host}``, ``{port}`` and the pattern's named groups)."""

    name: str
    pattern: str
    what: str
    fix: str


CAUSES: tuple[Cause, ...] = (
    Cause(
        "no_hub",
        r"HTTPLIB failed: (?P<detail>[^\n]+)|(?:Failed to resolve|Max retries exceeded with url).*huggingface",
        "it could not reach the model hub to download {repo} ({detail})",
        "run it once on a machine with access to the hub (the download is cached under ~/.cache/llama.cpp "
        "and used from then on), or download the GGUF yourself (huggingface-cli download {repo}) and start "
        "it with -m /path/to/model.gguf (server.command, server.model); HF_ENDPOINT names a mirror",
    ),
    Cause(
        "no_https",
        r"HTTPS is not supported",
        "this llama-server was built without HTTPS and cannot download {repo}",
        "rebuild it with `s2s-build-llama-server --force` (it builds with OpenSSL: apt-get install "
        "libssl-dev), point S2S_LLAMA_SERVER at a llama.cpp release, or download the GGUF and use -m",
    ),
    Cause(
        "missing_file",
        r"failed to open GGUF file '(?P<path>[^']*)' \((?P<detail>[^)]*)\)|failed to open (?P<path2>\S+): "
        r"(?P<detail2>No such file or directory|Permission denied)",
        "the model file {path} cannot be read ({detail})",
        "check server.model (the path of a .gguf file on this machine; s2s-run passes it as {{model}}), "
        "or download the model first",
    ),
    Cause(
        "port_taken",
        r"couldn't bind HTTP server socket|Address already in use|address already in use",
        "it could not listen on {host}:{port}: another process holds the port",
        "stop that process (`ss -ltnp 'sport = :{port}'` names it), or move this server to a free port "
        "(e.g. llm.base_url=http://{host}:<port>/v1)",
    ),
    Cause(
        "no_memory",
        r"failed to allocate|unable to allocate|insufficient memory|std::bad_alloc|out of memory|"
        r"Cannot allocate memory|OutOfMemoryError|No available memory for the cache blocks",
        "it ran out of memory while loading the model or allocating its context",
        "free memory, use a smaller model or quantisation, or ask for less: a smaller context (-c / "
        "--ctx-size, vLLM --max-model-len), fewer parallel slots (-np), fewer GPU layers (-ngl)",
    ),
)

_COMPILED = [(cause, re.compile(cause.pattern)) for cause in CAUSES]


def _repo(argv: list[str]) -> str:
    for flag in ("-hf", "--hf-repo", "-hfr"):
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1]
    return "the model"


def explain(log_text: str, argv: list[str], *, host: str, port: int) -> tuple[str, str] | None:
    """(cause's name, "what went wrong. Fix: how") for the first known cause in the log, if any;
    the log line it was read from is quoted."""
    for cause, pattern in _COMPILED:
        match = pattern.search(log_text)
        if match is None:
            continue
        groups = {k.rstrip("2"): v for k, v in match.groupdict().items() if v}
        values = {"repo": _repo(argv), "host": host, "port": port, "detail": "", "path": "the model", **groups}
        line = log_text[log_text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
        what = cause.what.format(**values)
        return cause.name, f"{what}. Fix: {cause.fix.format(**values)}. (Its log says: {line[:300]})"
    return None


def last_start(path: Path | None) -> str:
    """The log of the server's last start (a restart appends to the same file, after a ``$ argv``
    line), its last 256 kB at most."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - (256 << 10)))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    start = text.rfind("\n$ ")
    return text[start + 1:] if start >= 0 else text
