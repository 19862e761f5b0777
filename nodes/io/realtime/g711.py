"""G.711 (ITU-T, 8 kHz telephone audio): the ``audio/pcmu`` (mu-law) and ``audio/pcma`` (A-law)
formats of the Realtime protocol, to and from 16-bit PCM.

Lookup tables in numpy, built once from the reference algorithm (Sun Microsystems' g711.c, the
one CPython's ``audioop`` implements; the tests check these tables against it code for code):
a 256-entry table per law to decode, a 65,536-entry one to encode. No C of our own, and nothing
that leaves with ``audioop`` in Python 3.13.
"""

from __future__ import annotations

import base64
import binascii
from functools import cache
from typing import Any

import numpy as np

__all__ = ["FORMATS", "G711_RATE", "decode", "to_pcm16", "from_pcm16"]

G711_RATE = 8000  # the only rate G.711 has
#: the Realtime audio formats: PCM16 at the session's rate, G.711 at 8 kHz
FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")


@cache
def _decode_table(law: str) -> np.ndarray:
    code = np.arange(256, dtype=np.int32)
    if law == "audio/pcmu":
        u = ~code & 0xFF
        t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
        pcm = np.where(u & 0x80, 0x84 - t, t - 0x84)
    else:
        a = code ^ 0x55
        t, seg = (a & 0x0F) << 4, (a & 0x70) >> 4
        t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
        pcm = np.where(a & 0x80, t, -t)
    return pcm.astype("<i2")


@cache
def _encode_table(law: str) -> np.ndarray:
    """Indexed by a 16-bit sample's bits (``pcm.view(uint16)``)."""
    pcm = np.arange(65536, dtype=np.int32)
    pcm = np.where(pcm >= 32768, pcm - 65536, pcm)
    if law == "audio/pcmu":  # 14-bit magnitude, biased; segment = position of the top bit
        val = pcm >> 2
        mask = np.where(val < 0, 0x7F, 0xFF)
        mag = np.minimum(np.abs(val), 8159) + (0x84 >> 2)
        seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), mag)
        code = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (seg + 1)) & 0x0F)) ^ mask
    else:  # 13-bit, one's complement for negatives
        val = pcm >> 3
        mask = np.where(val >= 0, 0xD5, 0x55)
        mag = np.where(val >= 0, val, -val - 1)
        seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), mag)
        quant = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0x0F
        code = np.where(seg >= 8, 0x7F, (seg << 4) | quant) ^ mask
    return code.astype(np.uint8)


def decode(raw: bytes, fmt: str) -> bytes:
    """Bytes in ``fmt`` (one of FORMATS) as 16-bit little-endian PCM."""
    return raw if fmt == "audio/pcm" else _decode_table(fmt)[np.frombuffer(raw, np.uint8)].tobytes()


def to_pcm16(audio: Any, fmt: str) -> bytes:
    """An ``input_audio_buffer.append``'s ``audio`` (base64 in the session's input format) as
    16-bit little-endian PCM; ValueError with the reason if it is not that."""
    if not isinstance(audio, str) or not audio:
        raise ValueError(f"input_audio_buffer.append needs 'audio': base64 of {_what(fmt)}")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("'audio' is not valid base64") from None
    if fmt == "audio/pcm" and len(raw) % 2:
        raise ValueError(f"'audio' decodes to {len(raw)} bytes: 16-bit PCM has an even number of bytes (is the "
                         "session's input format audio/pcmu or audio/pcma?)")
    return decode(raw, fmt)


def from_pcm16(pcm16: bytes, fmt: str) -> bytes:
    """16-bit little-endian PCM in the session's output format (the bytes an audio delta carries)."""
    if fmt == "audio/pcm":
        return pcm16
    return _encode_table(fmt)[np.frombuffer(pcm16, "<u2")].tobytes()


def _what(fmt: str) -> str:
    return {"audio/pcmu": "G.711 mu-law bytes (8 kHz)", "audio/pcma": "G.711 A-law bytes (8 kHz)"}.get(
        fmt, "16-bit little-endian PCM samples")
