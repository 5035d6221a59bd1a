"""Publishing KV cache events on ZeroMQ, framed as vLLM's ``ZmqEventPublisher`` does.

Each message is three frames: ``topic`` | sequence number (8 bytes, big-endian, from 0) |
msgpack ``KVEventBatch`` (``radixserve.memory.kv_events``). A subscriber written for vLLM
(``examples/online_serving/kv_events_subscriber.py``) reads a radixserve worker unchanged;
a gap in the sequence numbers tells it that it missed batches (there is no replay socket:
resynchronize on the next ``AllBlocksCleared`` or by restarting the subscription).

The socket is an XPUB (a PUB that also sees subscriptions), so :meth:`wait_for_subscriber`
can tell when a subscriber is connected: ZeroMQ drops what is published before that.
"""

from __future__ import annotations

import msgspec
import zmq

from radixserve.memory.kv_events import KVEventBatch

DEFAULT_TOPIC = "kv-events"


class KVEventPublisher:
    """Binds ``endpoint`` (``tcp://127.0.0.1:5557``, ``ipc://...``) and publishes batches."""

    def __init__(
        self, endpoint: str, topic: str = DEFAULT_TOPIC, ctx: zmq.Context | None = None
    ) -> None:
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.sock = self._ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.bind(endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, batch: KVEventBatch | None) -> None:
        """Send one batch (nothing for None); never blocks (a slow subscriber loses batches)."""
        if batch is None:
            return
        frames = [self.topic, self.seq.to_bytes(8, "big"), self._encoder.encode(batch)]
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # over the high-water mark: dropped, the sequence gap says so
        self.seq += 1

    def wait_for_subscriber(self, timeout_ms: int) -> bool:
        """Block until a subscription arrives (True) or ``timeout_ms`` passes (False)."""
        if not self.sock.poll(timeout_ms):
            return False
        self.sock.recv()  # b"\x01" + topic
        return True

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
