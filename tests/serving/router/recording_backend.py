"""The router's worker socket for tests that drive the router's parts without a process:
it records what was sent, to whom, in order."""

from __future__ import annotations

import radixserve.serving.wire.protocol as p


class RecordingBackend:
    """Stands in for the router's ROUTER socket to its workers (``send_multipart``)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append((frames[0], p.decode_to_worker(frames[1])))

    def take(self) -> list[tuple[bytes, object]]:
        """What was sent since the last take: ``(worker identity, message)``."""
        sent, self.sent = self.sent, []
        return sent
