"""Find hub model files without ever hanging on a network that is not there.

Cached files are used as they are; a missing file is downloaded only when the hub answers
a TCP probe within a second or two, otherwise ``ModelNotAvailable`` is raised at once.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from s2s_flow.errors import MissingDependency, ModelNotAvailable

__all__ = ["check_installed", "reachable", "hub_reachable", "hub_file"]

_TRUE = {"1", "true", "yes", "on"}


def check_installed(*modules: str, extra: str) -> None:
    """Fail with the install command before paying for a slow import (kokoro's takes ~10 s)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingDependency(module, extra, cause=ImportError(f"No module named {module!r}"))


def reachable(url: str, timeout: float = 1.5) -> bool:
    """Can a TCP connection to ``url``'s host be opened within ``timeout``? (DNS included.)"""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo ignores socket timeouts
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answer and answer[0])


def hub_reachable(timeout: float = 1.5) -> bool:
    """False when HF_HUB_OFFLINE is set or the Hugging Face endpoint does not answer."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return False
    return reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout)


def hub_file(repo_id: str, filename: str, *, backend: str, hint: str = "") -> Path:
    """Path of ``filename`` in hub repo ``repo_id``: from the cache, else downloaded if the hub answers."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, local_files_only=True))
    except Exception as exc:  # not cached (LocalEntryNotFoundError and friends)
        if not hub_reachable():
            raise ModelNotAvailable(repo_id, backend, hint) from exc
    return Path(hf_hub_download(repo_id=repo_id, filename=filename))
