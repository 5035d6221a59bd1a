"""KV events: a subscriber written against vLLM's event types reads what the engine publishes.

The event structs below are declared here the way vLLM's own subscriber example declares
them (not imported from radixserve), so the test checks wire compatibility.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams
from radixserve.serving.worker.kv_events import KVEventPublisher

ExternalBlockHash = bytes | int


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
    engine = Engine(
        str(tiny_llama_dir), page_size=ps, num_pages=16, kv_events_endpoint="tcp://127.0.0.1:*"
    )
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
        assert stored[0].parent_block_hash is None and all(
            e.block_size == ps and e.medium == "CPU" for e in stored
        )
        for a, b in zip(
            stored, stored[1:]
        ):  # a chain: each leaf hangs under the last block of the one before
            assert b.parent_block_hash == a.block_hashes[-1]
        hashes = [h for e in stored for h in e.block_hashes]
        assert len(set(hashes)) == len(hashes) == len(tokens) // ps

        engine.generate(
            [list(range(100, 161))], params
        )  # all 16 pages: the first prompt is evicted
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_served_worker_publishes_its_cache_events(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from radixserve.serving.client import Client
    from radixserve.serving.router.launcher import LocalServer
    from radixserve.serving.router.router import RouterConfig

    engine = dict(
        num_pages=256,
        page_size=4,
        num_threads=1,
        kv_events_endpoint=f"ipc://{tmp_path}/kv-{{worker}}",
    )
    cfg = RouterConfig(endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    decoder = Decoder(type=KVEventBatch)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        with (
            LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=engine) as srv,
            # It flushes the cache below: a client in the server's process (inproc) may.
            Client(srv.router.inproc_endpoint, context=srv.router.context) as client,
        ):
            sub.connect(f"ipc://{tmp_path}/kv-0")  # worker 0's socket ("{worker}" -> its id)
            sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
            # ZeroMQ drops what is published before the subscription reaches the worker: send
            # new prompts until events arrive, then check one request's events exactly.
            for i in range(50):
                client.generate(input_ids=list(range(100 + i, 120 + i)), params=params)
                if sub.poll(200):
                    break
            else:
                raise AssertionError("no KV events from the worker")
            while sub.poll(200):
                sub.recv_multipart()
            ids = list(range(300, 330))
            client.generate(input_ids=ids, params=params)
            assert sub.poll(10_000)
            topic, seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            assert topic == b"kv-events" and int.from_bytes(seq, "big") > 0
            tokens = [t for e in batch.events if isinstance(e, BlockStored) for t in e.token_ids]
            assert tokens and tokens == ids[: len(tokens)]
            assert client.flush_cache()
            assert sub.poll(10_000)
            assert isinstance(decoder.decode(sub.recv_multipart()[2]).events[-1], AllBlocksCleared)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_l2_and_l3_publish_their_blocks_under_their_mediums(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """With L2 and L3 on, a subscriber that applies every event in order ends with exactly
    the blocks each tier holds (L1 "CPU", L2 "CPU_L2", L3 "DISK" on a CPU engine): demotion,
    L2 eviction (spilled to disk), load-back, a corrupt page file, a flush."""
    import random

    ps = 4
    engine = Engine(
        str(tiny_llama_dir),
        page_size=ps,
        num_pages=12,
        hicache_size=10 * 2048 / 2**30,  # 10 pages of this model (2 KiB each in fp32)
        hicache_storage_dir=str(tmp_path / "l3"),
        kv_events_endpoint="tcp://127.0.0.1:*",
    )
    hierarchy = engine.cache.hierarchy
    assert hierarchy.host.num_pages == 10
    decoder = Decoder(type=KVEventBatch)
    view: dict[str | None, set[ExternalBlockHash]] = {}

    def apply() -> list[Any]:
        raw = engine.drain_kv_events()
        events = decoder.decode(msgspec.msgpack.encode(raw)).events if raw is not None else []
        for e in events:
            if isinstance(e, BlockStored):
                view.setdefault(e.medium, set()).update(e.block_hashes)
                assert e.block_size == ps
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= view.get(e.medium, set())
                view[e.medium].difference_update(e.block_hashes)
            else:
                view.clear()
        return events

    def truth() -> dict[str, set[bytes]]:
        cache = engine.cache
        return {
            "CPU": {k for n in cache.nodes() for k in cache.page_keys(n)},
            "CPU_L2": set(hierarchy.host.keys()),
            "DISK": {bytes.fromhex(f.stem) for f in hierarchy.disk.dir.glob("*/*.kv")},
        }

    rng = random.Random(3)
    systems = [[rng.randrange(5, 200) for _ in range(24)] for _ in range(4)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    mediums: set[str | None] = set()
    for i in range(12):
        engine.generate([systems[i % 4] + [rng.randrange(5, 200) for _ in range(3)]], params)
        mediums |= {e.medium for e in apply() if not isinstance(e, AllBlocksCleared)}
        want = truth()
        assert {m: view.get(m, set()) for m in want} == want, i
    assert mediums == {"CPU", "CPU_L2", "DISK"}
    s = engine.stats()
    assert s.demoted_pages_total and s.loaded_host_pages_total and s.storage_written_pages_total

    # A corrupt page file is removed when read: a BlockRemoved on "DISK".
    engine.flush_cache()  # L1 and L2 go (AllBlocksCleared); L3 stays, unannounced
    assert isinstance(apply()[-1], AllBlocksCleared) and not view
    bad = sorted(hierarchy.disk.dir.glob("*/*.kv"))
    for f in bad:
        f.write_bytes(f.read_bytes()[:-1])
    view["DISK"] = {bytes.fromhex(f.stem) for f in bad}  # as if the subscriber knew them
    engine.generate([systems[0] + [7, 7, 7]], params)
    removed = [e for e in apply() if isinstance(e, BlockRemoved) and e.medium == "DISK"]
    assert removed and all(
        not hierarchy.disk.path(h).exists() for e in removed for h in e.block_hashes
    )
    want = truth()
    assert {m: view.get(m, set()) for m in want} == want


def test_router_feed_snapshot_then_batches_keep_a_view_exact(tiny_llama_dir: Path) -> None:
    """The router's feed on an engine that recorded no events before: the snapshot lists
    what the cache (L1 and L2) already holds, later batches continue it, and a view fed with
    them matches every prompt exactly as far as the engine's own cache does, per namespace."""
    from radixserve.serving.router.kv_index import WorkerKVView, decode_batch
    from radixserve.serving.wire import protocol as p
    from radixserve.serving.worker.kv_events import RouterEventFeed

    ps = 4
    engine = Engine(
        str(tiny_llama_dir),
        page_size=ps,
        num_pages=12,
        enable_hierarchical_cache=True,
        hicache_size=10 * 2048 / 2**30,  # 10 pages
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [list(range(10 + 40 * i, 34 + 40 * i)) for i in range(4)]
    engine.generate([prompts[0]], params)
    engine.generate([prompts[2]], params)  # 12 pages: some of prompt 0's go to L2
    engine.add_request(prompts[1], params, namespace="tenant")
    while engine.has_unfinished():
        engine.step()
    assert engine.drain_kv_events() is None  # not recording yet

    sent: list[p.WorkerKVEvents] = []
    feed = RouterEventFeed(engine, sent.append)
    assert feed.subscribe()
    view = WorkerKVView()

    def fold() -> None:
        for msg in sent:
            if msg.snapshot:
                view.reset(msg.hash_identity, msg.page_size, msg.medium)
            assert view.apply(msg.seq, decode_batch(msg.batch))
        sent.clear()

    host = engine.cache.hierarchy.host

    def check() -> None:
        for prompt in prompts:
            for ns in (None, "tenant"):
                m = view.match(view.page_keys(prompt, ns))
                assert m.l1_tokens == engine.cache.peek_prefix_len(prompt, ns), (prompt[0], ns)
        assert {h for h, bits in view.blocks.items() if bits & 2} == set(host.keys())

    assert sent[0].snapshot and sent[0].page_size == ps and sent[0].medium == "CPU"
    fold()
    check()
    assert view.match(view.page_keys(prompts[1], "tenant")).l1_tokens > 0
    assert host.keys()  # the snapshot listed L2 pages demoted before it
    for prompt in prompts[3:] + prompts[:1]:  # evicts (demotes to L2) and loads back
        engine.generate([prompt], params)
        feed.publish(engine.drain_kv_events())
        fold()
        check()
    assert view.match(view.page_keys(prompts[0], None)).tokens >= 16
    assert feed.seq == view.batches  # the snapshot and one batch per generate, none lost


def test_router_feed_without_a_radix_cache_declines(tiny_llama_dir: Path) -> None:
    """No radix cache, nothing to route on: the feed says so and sends nothing (the router
    then judges the worker by its tree)."""
    from radixserve.serving.worker.kv_events import RouterEventFeed

    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=16, disable_radix_cache=True)
    sent: list[object] = []
    feed = RouterEventFeed(engine, sent.append)
    assert not feed.subscribe() and not feed.active and not sent
    feed.publish(engine.drain_kv_events())
    assert not sent
