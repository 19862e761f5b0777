"""A server's C heap: what the busiest moment took goes back to the machine (glibc's malloc).

By default glibc keeps what a process frees. A block of 128 KiB or more (a second of audio, a
mel spectrogram, a synthesized sentence) is mapped on its own and unmapped when freed, until one
such block is freed: then the threshold rises to that block's size (up to 32 MiB) and later ones
come from the heap, which keeps them. And each thread that allocates while another does gets an
arena of its own, up to 8 per core, each keeping its high-water mark. In a server whose sessions'
turns come and go on a dozen threads, both make each new session cost what its busiest turn took.

``small()`` fixes the threshold at 128 KiB (large blocks are always mapped, so freed at once) and
allows 2 arenas. Call it before the threads start: glibc fixes its arena limit once 8 arenas exist.
Elsewhere than glibc on Linux it does nothing and says so (False). The price: every large block
is a fresh mapping, its pages faulted in and unmapped again; on 2 cores voice-to-voice was later
with it (io.small_heap in conf/io/realtime.yaml has the figures), so it is asked for, not default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["small"]

M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
M_ARENA_MAX = -8


def small(mmap_threshold: int = 128 * 1024, arenas: int = 2) -> bool:
    """Large blocks mapped on their own, at most ``arenas`` arenas; True where glibc took both."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_ARENA_MAX, arenas))
