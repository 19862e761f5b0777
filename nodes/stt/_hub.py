"""Offline-first model loading shared by the STT backends.

A model is loaded from a local directory or the local hub cache first; the hub is asked
only when the model is missing locally and the hub answers within a few seconds.
Otherwise the load fails fast with ModelNotAvailable instead of hanging on the network.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from s2s_flow.errors import ModelNotAvailable

__all__ = ["hub_reachable", "hf_offline", "load_offline_first", "local_dir", "check_available"]

T = TypeVar("T")
_PROBE_TIMEOUT_S = 3.0
_probe_lock = threading.Lock()
_probe_result: bool | None = None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def hub_reachable(timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether the model hub accepts a TCP connection (asked once per process, bounded in time).

    The probe runs on a daemon thread because name resolution has no timeout of its own.
    """
    global _probe_result
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        return False
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
        if proxy and url.scheme == "https":
            url = urlparse(proxy if "://" in proxy else f"http://{proxy}")  # the hub is reached through it
        port = url.port or (443 if url.scheme == "https" else 80)
        answer: list[bool] = []

        def probe() -> None:
            try:
                with socket.create_connection((url.hostname or "", port), timeout=timeout):
                    answer.append(True)
            except OSError:
                answer.append(False)

        thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
        thread.start()
        thread.join(timeout + 0.5)
        _probe_result = bool(answer and answer[0])
        return _probe_result


@contextmanager
def hf_offline() -> Iterator[None]:
    """Set HF_HUB_OFFLINE=1 while loading from a local directory, then restore it."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def local_dir(model: str) -> Path | None:
    """The model as an existing local directory, or None when it names a hub model."""
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def check_available(repo_id: str, backend: str, *, hint: str = "", marker: str = "config.json") -> None:
    """Fail fast, before the backend's heavy imports, when a hub model is neither cached nor reachable.

    Only a cheap look into the hub cache; anything unusual is left to the loader to report.
    """
    if local_dir(repo_id) is not None:
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, marker)
    except Exception:  # no huggingface_hub, or not a valid repo id: the loader will say more
        return
    if not isinstance(cached, str) and not hub_reachable():
        raise ModelNotAvailable(repo_id, backend, hint)


def load_offline_first(model: str, backend: str, load: Callable[[bool], T], *, hint: str = "") -> T:
    """``load(local_files_only)`` from the local cache; download only if the hub is reachable.

    ``load`` must raise OSError (huggingface_hub's LocalEntryNotFoundError is one) when the
    files are not cached. Raises ModelNotAvailable when they are not and the hub is down.
    """
    try:
        return load(True)
    except OSError as exc:
        if not hub_reachable():
            raise ModelNotAvailable(model, backend, hint) from exc
    return load(False)
