"""Fail fast, before anything slow: a missing library, or a model that is neither local nor
downloadable from here.

A model loads from a local directory or the local hub cache first; the hub is asked only when
the files are missing and it accepts a connection within seconds. Otherwise the load raises
ModelNotAvailable at once instead of hanging on a network that is not there.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from s2s_flow.errors import ModelNotAvailable
from s2s_flow.node import require

__all__ = [
    "ensure_installed", "reachable", "hub_reachable", "hf_offline", "local_dir",
    "check_available", "load_offline_first", "hub_file",
]

T = TypeVar("T")
_PROBE_TIMEOUT_S = 3.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_probe_lock = threading.Lock()
_probed: dict[tuple[str, int], bool] = {}  # (host, port) -> answered, once per process


def ensure_installed(*modules: str, extra: str) -> None:
    """Report a missing library before anything slow: find_spec of a top-level name imports nothing."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            require(module, extra)  # raises MissingDependency with the install command


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _address(url: str) -> tuple[str, int]:
    """Host and port a connection to ``url`` opens: its proxy's when the environment names one."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _connects(address: tuple[str, int], timeout: float) -> bool:
    answer: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(address, timeout=timeout):
                answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="reachable-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)  # on a thread: name resolution has no timeout of its own
    return bool(answer and answer[0])


def reachable(url: str, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether ``url``'s host (or the proxy in front of it) accepts a TCP connection in ``timeout``.

    Asked once per address and process, so every model of a run pays for one probe at most.
    """
    address = _address(url)
    with _probe_lock:
        if address not in _probed:
            _probed[address] = _connects(address, timeout)
        return _probed[address]


def hub_reachable(timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """False when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set or the hub (HF_ENDPOINT) does not answer."""
    if any(_truthy(os.environ.get(name)) for name in _OFFLINE_VARS):
        return False
    return reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout)


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


def model_path(model: str) -> str:
    """A model given as a local file or directory (``~`` allowed) as a full path; a hub id as is.

    Nodes keep this, not what the user typed: the loaders do not expand ``~``, and would take
    ``~/models/x`` for a malformed hub id.
    """
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


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


def load_offline_first(
    model: str,
    backend: str,
    load: Callable[[bool], T],
    *,
    hint: str = "",
    progress: Callable[[str], object] | None = None,
) -> T:
    """``load(local_files_only)`` from the local cache; download only if the hub is reachable.

    A ``model`` that is a local directory is loaded with the hub switched off (nothing in it,
    tokenizer included, may reach for the network). ``load`` must raise OSError
    (huggingface_hub's LocalEntryNotFoundError is one) when the files are not cached. Raises
    ModelNotAvailable when they are not and the hub is down; ``progress`` (a node's
    ``ctx.progress``) hears of a download before it starts.
    """
    if local_dir(model) is not None:
        with hf_offline():
            return load(True)
    try:
        return load(True)
    except OSError as exc:
        if not hub_reachable():
            raise ModelNotAvailable(model, backend, hint) from exc
    if progress is not None:
        progress(f"downloading {model} from the hub")
    return load(False)


def hub_snapshot(model: str, backend: str, *, allow_patterns: list[str] | None = None, hint: str = "",
                 progress: Callable[[str], object] | None = None) -> Path:
    """A model's directory: the local directory it names, else its hub snapshot (from the cache,
    or downloaded when the hub answers; ModelNotAvailable when neither)."""
    path = local_dir(model)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download

    return Path(load_offline_first(
        model, backend, lambda local_only: snapshot_download(model, local_files_only=local_only,
                                                             allow_patterns=allow_patterns),
        hint=hint, progress=progress,
    ))


def hub_file(repo_id: str, filename: str, *, backend: str, hint: str = "") -> Path:
    """Path of ``filename`` in hub repo ``repo_id``: from the cache, else downloaded if the hub answers."""
    from huggingface_hub import hf_hub_download

    return Path(load_offline_first(
        repo_id, backend,
        lambda local_only: hf_hub_download(repo_id, filename, local_files_only=local_only),
        hint=hint,
    ))
