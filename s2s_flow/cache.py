"""s2s-flow's on-disk cache: where it lives, and making one entry of it exactly once.

An entry (a llama-server build, a benchmark corpus) is a directory named after what shapes
it. It is made in a staging directory beside it and renamed into place under a file lock,
so processes that start together (sweep jobs) wait for one maker, and no reader ever sees
half an entry. Standard library only, so importing this module costs nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["cache_dir", "file_lock", "make_once"]


def cache_dir() -> Path:
    """Root of the cache: ``$S2S_FLOW_CACHE`` or ``~/.cache/s2s-flow``."""
    env = os.environ.get("S2S_FLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "s2s-flow"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) across processes."""
    import fcntl  # POSIX only; imported here so that cache_dir() works everywhere

    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def make_once(target: Path, make: Callable[[Path], None], *, marker: str, force: bool = False) -> Path:
    """``target``, first made by ``make(staging_dir)`` unless ``target/marker`` already exists.

    ``force`` makes it anew and swaps it in; readers of the old one keep their open files.
    """
    if (target / marker).exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(f".{target.name}.lock")):
        if (target / marker).exists() and not force:  # another process made it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
        try:
            make(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by others
            old = target.with_name(f".{target.name}.old-{os.getpid()}") if target.exists() else None
            if old is not None:
                target.rename(old)
            staging.rename(target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # what a failed make() left; gone after the rename
    return target
