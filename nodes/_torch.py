"""The device option of the PyTorch backends (llm=transformers, stt=whisper_hf), checked alike."""

from __future__ import annotations

import re
from typing import Any

from s2s_flow.errors import ConfigError

__all__ = ["check_device", "pick_device"]


def check_device(device: str, option: str) -> None:
    """At compose time: the value's form only (torch is not imported here)."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise ConfigError(f"{option}={device!r} is unknown: use auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")


def pick_device(torch: Any, device: str, option: str) -> str:
    """At setup: ``auto`` resolved to the best device torch sees; a CUDA device it lacks is an error."""
    if device != "auto":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"{option}={device} but torch sees no CUDA GPU: use {option}=auto or cpu")
        return device
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"
