"""Helpers for tests that talk to the router over a raw DEALER socket."""

from __future__ import annotations

from typing import Any

from radixserve.serving.wire import protocol as p


def recv_reply(sock: Any) -> Any:
    """The next message for a raw DEALER socket, skipping the keep-alives a client ignores
    (sent while a request is in flight, e.g. while its prompt is being encoded)."""
    while True:
        msg = p.decode_server(sock.recv())
        if not isinstance(msg, p.KeepAlive):
            return msg
