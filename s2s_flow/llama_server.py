"""Build and locate llama.cpp's ``llama-server`` binary.

The sources come from the ``llama-cpp-python`` sdist on PyPI (it vendors llama.cpp), so a
machine that can reach PyPI but no model hub or GitHub can still get a server. The binary
is built once and cached under ``s2s_flow.cache.cache_dir()``, one directory per sources
version and build options. Standard library only, so importing this module costs nothing.

    s2s-build-llama-server                # build once (a few minutes on 2 cores)
    s2s-build-llama-server --print-path   # where the binary is, or exit 1
    s2s-build-llama-server --python-wheel # llama-cpp-python's wheel (python -m llama_cpp.server), built once
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from s2s_flow.cache import cache_dir, make_once

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Small, portable, self-contained: no -march=native (the cache may move between CPUs, and on AMD
# EPYC Zen 4 with AVX-512 a native build was no faster: 5.6 vs 5.3 ms a prompt token, 11.3-11.5 vs
# 11.4-11.7 ms a generated token, SmolLM2-135M Q4_1 on 1 thread), no
# shared libs (the build tree is deleted), no network at build time (no curl, and no web UI,
# which would otherwise be fetched from a Hugging Face bucket). OpenSSL is on, so the
# recipes' `-hf org/model` downloads work over HTTPS on a machine that has the internet
# (Debian: libssl-dev to build, libssl3 to run; bootstrap installs it).
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)

# llama-cpp-python itself, for `python -m llama_cpp.server`: its wheel, built once from the same
# sdist and cached beside the binary. Portable like the binary (no -march=native); without the
# multimodal library (mtmd, loaded only by image chat handlers), tools, tests and examples.
WHEEL_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_OPENSSL=OFF",
)

_MISSING_TOOLCHAIN = (
    "cannot build llama-server: {missing} not found on PATH. Building needs cmake (>= 3.14) "
    "and a C++17 compiler; on Debian/Ubuntu run `apt-get install cmake g++` (on macOS "
    "`xcode-select --install && brew install cmake`), then rerun `s2s-build-llama-server`. "
    "Alternatively point S2S_LLAMA_SERVER at an existing llama-server binary, or put one "
    "on PATH."
)


_NO_OPENSSL = (
    "cannot build llama-server with HTTPS: cmake found no OpenSSL >= 3 development files, and "
    "without them the server cannot download the recipes' `-hf org/model` weights. On "
    "Debian/Ubuntu run `apt-get install libssl-dev` (on macOS `brew install openssl@3` and set "
    "OPENSSL_ROOT_DIR=$(brew --prefix openssl@3)), then rerun `s2s-build-llama-server`."
)


class BuildError(RuntimeError):
    """The toolchain is missing or a build step failed; the message says what to do."""


def install_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """One directory per sources version and build options: changing either builds anew."""
    options = hashlib.sha1(" ".join(CMAKE_ARGS).encode()).hexdigest()[:8]
    return cache_dir() / "llama-server" / f"{version}-{options}"


def cached_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return install_dir(version) / "bin" / "llama-server"


def find_llama_server() -> Path | None:
    """``$S2S_LLAMA_SERVER``, else the cached build, else ``llama-server`` on PATH."""
    env = os.environ.get("S2S_LLAMA_SERVER")
    if env:
        return Path(env).expanduser()
    cached = cached_binary()
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def build(
    force: bool = False,
    *,
    jobs: int | None = None,
    verbose: bool = False,
    log=print,
) -> Path:
    """Build llama-server into the cache and return its path; returns at once if cached.

    Concurrent callers wait for one build instead of racing, and a reader never sees a
    half-written binary (``s2s_flow.cache.make_once``).
    """
    target = cached_binary()
    if target.is_file() and not force:
        return target
    _check_toolchain()

    def make(staging: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="s2s-llama-build-") as tmp:
            _build_in(Path(tmp), staging, jobs or os.cpu_count() or 2, verbose, log)

    make_once(install_dir(), make, marker="bin/llama-server", force=force)
    return target


def wheel_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Beside the binary (a cache CI keeps), one directory per version and build options."""
    options = hashlib.sha1(" ".join(WHEEL_CMAKE_ARGS).encode()).hexdigest()[:8]
    return cache_dir() / "llama-server" / f"python-{version}-{options}"


def cached_wheel() -> Path | None:
    return next(iter(sorted(wheel_dir().glob("llama_cpp_python-*.whl"))), None)


def build_wheel(force: bool = False, *, jobs: int | None = None, verbose: bool = False, log=print) -> Path:
    """Build the llama-cpp-python wheel into the cache and return its path; at once if cached.

    Install it with ``pip install 'llama_cpp_python[server] @ file://PATH'``.
    """
    wheel = cached_wheel()
    if wheel is not None and not force:
        return wheel
    _check_toolchain()
    jobs = jobs or os.cpu_count() or 2

    def make(staging: Path) -> None:
        started = time.monotonic()
        sdist = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
               "--disable-pip-version-check", "-w", str(staging), sdist]
        env = {**os.environ, "CMAKE_ARGS": " ".join(WHEEL_CMAKE_ARGS), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
        log(f"building the {sdist} wheel with {jobs} jobs (minutes): {' '.join(cmd)}")
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.run(cmd, env=env, stdout=None if verbose else out,
                                  stderr=None if verbose else subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                out.seek(0)
                tail = "" if verbose else "\n".join(out.read().splitlines()[-40:])
                raise BuildError(f"building the {sdist} wheel failed (exit {proc.returncode}):\n{tail}")
        info = {"llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION, "cmake_args": list(WHEEL_CMAKE_ARGS),
                "jobs": jobs, "build_seconds": round(time.monotonic() - started, 1),
                "built_at": datetime.now(UTC).isoformat(timespec="seconds"), "platform": platform.platform()}
        (staging / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        log(f"built in {info['build_seconds']:.0f} s")

    make_once(wheel_dir(), make, marker="build-info.json", force=force)
    wheel = cached_wheel()
    if wheel is None:
        raise BuildError(f"the llama-cpp-python build finished but left no wheel in {wheel_dir()}")
    return wheel


def _check_toolchain() -> None:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise BuildError(_MISSING_TOOLCHAIN.format(missing=" and ".join(missing)))
    if importlib.util.find_spec("pip") is None:  # e.g. a venv made by uv
        raise BuildError(
            f"cannot build llama-server: pip is not installed in {sys.executable}, and it is "
            "what downloads the llama-cpp-python sources. Run `python -m ensurepip` (or "
            "`uv pip install pip`) and retry."
        )


def _build_in(tmp: Path, dest: Path, jobs: int, verbose: bool, log) -> None:
    """Download, configure and compile in ``tmp``; put the binary and its build info in ``dest``."""
    started = time.monotonic()
    log_path = tmp / "build.log"

    def step(msg: str) -> None:
        log(f"[{time.monotonic() - started:6.1f}s] {msg}")

    def run(cmd: list[str], what: str) -> None:
        step(f"{what}: {' '.join(cmd)}")
        with open(log_path, "a") as out:
            proc = subprocess.run(
                cmd,
                stdout=None if verbose else out,
                stderr=subprocess.STDOUT if not verbose else None,
                stdin=subprocess.DEVNULL,
            )
        if proc.returncode != 0:
            tail = "" if verbose else _tail(log_path, 40)
            raise BuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")

    sdist = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "-d",
            str(tmp / "sdist"),
            sdist,
        ],
        f"download {sdist} sources from PyPI",
    )
    archives = list((tmp / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise BuildError(f"pip download of {sdist} produced no .tar.gz in {tmp / 'sdist'}")
    step(f"extract {archives[0].name}")
    with tarfile.open(archives[0]) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse odd members
            tar.extractall(tmp / "src", filter="data")
        else:
            tar.extractall(tmp / "src")
    (src,) = (tmp / "src").iterdir()
    llama_cpp = src / "vendor" / "llama.cpp"

    build_dir = tmp / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(llama_cpp), "-B", str(build_dir), *generator, *CMAKE_ARGS], "configure")
    if "OPENSSL_VERSION_SUPPORTED:INTERNAL=1" not in (build_dir / "CMakeCache.txt").read_text(errors="replace"):
        raise BuildError(_NO_OPENSSL)  # cmake only warns, and the cached server could never fetch -hf models
    run(
        ["cmake", "--build", str(build_dir), "--target", "llama-server", "--parallel", str(jobs)],
        f"compile llama-server with {jobs} jobs (minutes)",
    )

    built = next((p for p in build_dir.rglob("llama-server") if p.is_file()), None)
    if built is None:
        raise BuildError(f"the build finished but no llama-server binary is in {build_dir}")
    version = subprocess.run([str(built), "--version"], capture_output=True, text=True, timeout=60)
    version_text = (version.stdout + version.stderr).strip()
    if version.returncode != 0:
        raise BuildError(f"the freshly built llama-server does not run:\n{version_text}")

    (dest / "bin").mkdir()
    shutil.copy2(built, dest / "bin" / "llama-server")
    info = {
        "llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION,
        "llama_server_version": version_text,
        "cmake_args": list(CMAKE_ARGS),
        "jobs": jobs,
        "build_seconds": round(time.monotonic() - started, 1),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    (dest / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    step(f"built {version_text.splitlines()[0]}; installing it as {cached_binary()}")


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """Console script ``s2s-build-llama-server``."""
    parser = argparse.ArgumentParser(
        prog="s2s-build-llama-server",
        description="Build llama.cpp's llama-server from the llama-cpp-python "
        f"{LLAMA_CPP_PYTHON_VERSION} sdist and cache it under {install_dir()}.",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--print-path",
        action="store_true",
        help="print the llama-server that would be used and exit (exit 1 if there is none); builds nothing",
    )
    parser.add_argument(
        "--python-wheel",
        action="store_true",
        help="build (once) llama-cpp-python's wheel, for `python -m llama_cpp.server`, and print its path",
    )
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--verbose", "-v", action="store_true", help="show the compiler output instead of logging it")
    args = parser.parse_args(argv)

    if args.print_path:
        found = find_llama_server()
        if found is None:
            print("no llama-server: run `s2s-build-llama-server`", file=sys.stderr)
            return 1
        print(found)
        return 0

    if args.python_wheel:
        try:
            wheel = build_wheel(force=args.force, jobs=args.jobs, verbose=args.verbose,
                                log=lambda msg: print(msg, file=sys.stderr))
        except BuildError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(wheel)  # the only line on stdout: scripts/bootstrap.sh installs it
        return 0

    if cached_binary().is_file() and not args.force:
        print(f"llama-server already built: {cached_binary()} (use --force to rebuild)")
        return 0
    try:
        path = build(force=args.force, jobs=args.jobs, verbose=args.verbose)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
