"""KV events: a subscriber written against vLLM's event types reads what the engine publishes.

The event structs below are declared here the way vLLM's own subscriber example declares
them (not imported from radixserve), so the test checks wire compatibility.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import msgspec
import zmq
from msgspec.msgpack import Decoder

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams
from radixserve.serving.kv_events import KVEventPublisher

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _recv(sub: zmq.Socket, decoder: Decoder) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(10_000), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decoder.decode(payload)


def test_a_subscriber_sees_stored_removed_and_cleared_blocks(tiny_llama_dir: Path) -> None:
    ps = 4
    engine = Engine(str(tiny_llama_dir), page_size=ps, num_pages=16, kv_events_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    pub = KVEventPublisher("tcp://127.0.0.1:*", ctx=ctx)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(pub.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        assert pub.wait_for_subscriber(10_000)
        decoder = Decoder(type=KVEventBatch)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

        prompt = list(range(10, 30))  # 5 pages; 22 tokens with KV at the end
        engine.generate([prompt], params)
        pub.publish(engine.drain_kv_events())
        topic, seq, batch = _recv(sub, decoder)
        assert (topic, seq) == (b"kv-events", 0)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored and not [e for e in batch.events if not isinstance(e, BlockStored)]
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens == prompt[: len(tokens)] and len(tokens) >= 16
        assert stored[0].parent_block_hash is None and all(e.block_size == ps and e.medium == "CPU" for e in stored)
        for a, b in zip(stored, stored[1:]):  # a chain: each leaf hangs under the last block of the one before
            assert b.parent_block_hash == a.block_hashes[-1]
        hashes = [h for e in stored for h in e.block_hashes]
        assert len(set(hashes)) == len(hashes) == len(tokens) // ps

        engine.generate([list(range(100, 161))], params)  # all 16 pages: the first prompt is evicted
        pub.publish(engine.drain_kv_events())
        _, seq, batch = _recv(sub, decoder)
        assert seq == 1
        removed = [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert set(hashes) <= set(removed)

        assert engine.flush_cache()
        pub.publish(engine.drain_kv_events())
        _, seq, batch = _recv(sub, decoder)
        assert seq == 2 and isinstance(batch.events[-1], AllBlocksCleared)
        pub.publish(engine.drain_kv_events())  # nothing happened: nothing is sent
        assert not sub.poll(50)
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()
