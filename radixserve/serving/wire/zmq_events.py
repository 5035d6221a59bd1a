"""A ZeroMQ socket's readiness, and the flags to read it with, as plain ints.

The router and the asyncio client check ``zmq.EVENTS`` once or twice per streamed token.
pyzmq's flags are ``enum.IntFlag`` members, and every ``&`` or ``|`` on one builds a new
enum member through ``enum``'s Python code; with plain ints it is one machine operation.
"""

from __future__ import annotations

from typing import cast

import zmq

POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)


def events(sock: zmq.Socket) -> int:
    """``sock``'s ``zmq.EVENTS`` (``POLLIN``: a message can be read; ``POLLOUT``: one can be sent)."""
    return cast(int, sock.getsockopt(_EVENTS))
