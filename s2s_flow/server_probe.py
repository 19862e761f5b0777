"""What answers a model server's ``ready_url`` (s2s_flow/model_server.py asks before it starts one,
while it waits for one to load, and while it watches one): nothing (``free``), a server still loading
its model (``loading``: HTTP 503), the server (``ready``), or something else (``foreign``); and
whether the server found serves the recipe's model (its OpenAI-style model listing)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from s2s_flow.errors import S2SError
from s2s_flow.model_server_spec import ServerSpec

__all__ = ["Probe", "ServerError", "check_identity", "model_ids", "probe_url", "same_model"]

_PROBE_TIMEOUT_S = 1.0
# Loopback probes must never go through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(S2SError):
    """The model server could not be used: missing binary, port taken, died, never ready."""


@dataclass
class Probe:
    state: str  # free | loading | ready | foreign
    detail: str = ""
    body: bytes = b""


def _get(url: str, timeout: float = _PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of a GET; raises OSError/HTTPException when nothing HTTP answers."""
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return resp.status, resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(1 << 16) if exc.fp else b""


def probe_url(url: str) -> Probe:
    try:
        status, body = _get(url)
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError | FileNotFoundError):
            return Probe("free")
        if isinstance(reason, socket.gaierror):
            raise ServerError(f"server.ready_url={url}: cannot resolve its host ({reason})") from None
        return Probe("foreign", f"{type(reason).__name__}: {reason}")
    except ConnectionRefusedError:
        return Probe("free")
    except (http.client.HTTPException, OSError) as exc:  # garbage, reset, or silence
        return Probe("foreign", f"{type(exc).__name__}: {exc}".rstrip(": "))
    if status == 200:
        return Probe("ready", body=body)
    if status in (401, 403):
        return Probe("ready", f"HTTP {status}: it wants an API key", body)
    if status == 503:
        return Probe("loading", _short(body))
    return Probe("foreign", f"HTTP {status} {_short(body)}".strip())


def _short(body: bytes, limit: int = 160) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def model_ids(spec: ServerSpec, ready_body: bytes) -> list[str] | None:
    """Model ids the server lists, or None when it has no OpenAI-style listing."""
    body = ready_body
    if spec.models_url != spec.ready_url:
        try:
            status, body = _get(spec.models_url, timeout=5.0)
        except (OSError, http.client.HTTPException):
            return None
        if status in (401, 403):
            return []  # a listing exists but needs a key: nothing to compare
        if status != 200:
            return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    ids = []
    for item in data["data"]:
        if isinstance(item, dict):
            ids += [str(item.get("id", ""))] + [str(a) for a in item.get("aliases") or ()]
    return list(dict.fromkeys(i for i in ids if i))


def same_model(expected: str, ids: list[str]) -> bool:
    """llama-server lists the -m path or the -hf repo; vLLM the served name."""
    path = Path(expected)
    keys = {expected, path.name, path.stem, expected.rstrip("/").split("/")[-1]}
    keys = {k.lower() for k in keys if k}
    return any(k in i.lower() for i in ids for k in keys)


def check_identity(spec: ServerSpec, probe: Probe) -> list[str]:
    ids = model_ids(spec, probe.body)
    if ids is None:
        raise ServerError(
            f"something answers {spec.ready_url} but it is not the expected server: "
            f"{spec.models_url} has no OpenAI-style model listing. Stop whatever listens on "
            f"{spec.host}:{spec.port}, or move this server to a free port (e.g. "
            f"llm.base_url=http://{spec.host}:<port>/v1)"
        )
    if spec.model and ids and not same_model(spec.model, ids):
        raise ServerError(
            f"the server at {spec.host}:{spec.port} serves {', '.join(ids[:3])}, not "
            f"{spec.model}. Stop it, move this recipe to a free port (llm.base_url=http://"
            f"{spec.host}:<port>/v1), or use the running server as it is with server=null"
        )
    return ids
