"""Publishing KV cache events on ZeroMQ, framed as vLLM's ``ZmqEventPublisher`` does.

Each message is three frames: ``topic`` | sequence number (8 bytes, big-endian, from 0) |
msgpack ``KVEventBatch`` (``radixserve.memory.kv_events``). A subscriber written for vLLM
(``examples/online_serving/kv_events_subscriber.py``) reads a radixserve worker unchanged;
a gap in the sequence numbers tells it that it missed batches (there is no replay socket:
resynchronize on the next ``AllBlocksCleared`` or by restarting the subscription).

The socket is an XPUB (a PUB that also sees subscriptions), so :meth:`wait_for_subscriber`
can tell when a subscriber is connected: ZeroMQ drops what is published before that.

radixserve's own router gets the same batches over the worker's router connection instead
(:class:`RouterEventFeed`), starting from a snapshot, when it routes on events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixserve.memory.kv_events import KVEventBatch
from radixserve.serving.wire import protocol as p

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


class RouterEventFeed:
    """A worker's KV events for its own router, over the worker's router connection.

    Sent only once the router asked (:class:`~radixserve.serving.wire.protocol.WorkerKVSubscribe`,
    when it routes on events): :meth:`subscribe` turns event recording on in the engine if
    the worker was not publishing already, and sends a snapshot; then every drained batch
    goes to the router too, numbered, so the router can tell a gap. Over the CURVE-
    authenticated connection the router already has: no other listener is opened.
    """

    def __init__(self, engine: Any, send: Callable[[msgspec.Struct], None]) -> None:
        self.engine = engine
        self.send = send
        self.active = False
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    @staticmethod
    def supported(engine: Any) -> bool:
        """Whether ``engine`` can record KV events (the real engine; not the test fakes)."""
        return callable(getattr(engine, "enable_kv_events", None)) and hasattr(engine, "cache")

    def subscribe(self) -> bool:
        """Start (or restart, after a gap) the feed with a snapshot. Call it right after the
        engine's events were drained (and sent), so that later batches continue the snapshot
        exactly. False if the engine records no events (a fake, no radix cache)."""
        if not self.supported(self.engine):
            return False
        cache = self.engine.cache
        if not callable(getattr(cache, "nodes", None)):  # no radix tree: nothing is reused
            return False
        if getattr(cache, "listener", None) is None:
            self.engine.enable_kv_events()
        recorder = cache.listener
        hierarchy = getattr(cache, "hierarchy", None)
        l2 = hierarchy.host.keys() if hierarchy is not None else []
        snap = recorder.snapshot(cache.nodes(), l2)
        self.send(
            p.WorkerKVEvents(
                seq=0,
                batch=self._encoder.encode(snap),
                snapshot=True,
                hash_identity=recorder.hasher.identity,
                page_size=recorder.hasher.page_size,
                medium=recorder.medium,
            )
        )
        self.active, self.seq = True, 1
        return True

    def publish(self, batch: KVEventBatch | None) -> None:
        """Send one drained batch (nothing for None, or before a subscription)."""
        if batch is None or not self.active:
            return
        self.send(p.WorkerKVEvents(seq=self.seq, batch=self._encoder.encode(batch)))
        self.seq += 1
