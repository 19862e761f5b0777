"""What waits for a client, told apart from what the server itself is late with.

A session's events go out through its connection's queue (server.py), bounded by
``io.max_queued_bytes``. Bytes past the bound mean a client that does not read only when its socket
takes no more: the transport then holds what the kernel would not. An empty transport buffer means
the client takes all it is given and the backlog is the server's own (a reply's audio produced in a
burst, the loop held up by another client's frames or a slow callback): no reason to close it, up to
``BACKLOG_FACTOR`` times the bound, so that what waits stays bounded either way. The kernel's share
is bounded too (``SEND_BUFFER_BYTES``), so a client that stops reading is seen soon, in user space.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

__all__ = ["BACKLOG_FACTOR", "SEND_BUFFER_BYTES", "abort_unless_sent", "bound_send_buffer", "not_reading",
           "transport_of"]

# A client's socket takes at most this much unsent data (Linux doubles it for its bookkeeping) instead
# of the kernel's autotuned 4 MiB: ~4 s of 24 kHz audio events, ample for any round trip, and a client
# that stops reading costs no 4 MiB of kernel memory each.
SEND_BUFFER_BYTES = 128 << 10
BACKLOG_FACTOR = 4  # a reading client's events may wait up to this many times io.max_queued_bytes


def transport_of(send: Any) -> Any:
    """The connection's transport, through the ASGI server's ``send``: uvicorn's protocols are what
    ``send`` is bound to and keep it as ``transport`` (the only handle on a client's socket)."""
    return getattr(getattr(send, "__self__", None), "transport", None)


def not_reading(transport: Any, queued: int, bound: int) -> bool:
    """``queued`` bytes wait, past ``bound``: is it the client's doing (see the module's docstring)?
    Without a transport to ask, the bound alone judges."""
    if transport is None or queued > BACKLOG_FACTOR * bound:
        return True
    return transport.get_write_buffer_size() > 0


def bound_send_buffer(transport: Any) -> None:
    """SEND_BUFFER_BYTES for the client's socket (a transport without one, or a refusal: as it is)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def abort_unless_sent(transport: Any) -> None:
    """Data still waits in user space for a client that does not read: drop the connection."""
    if not transport.is_closing() or transport.get_write_buffer_size():
        transport.abort()
