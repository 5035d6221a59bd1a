"""Unit tests of the router's event-fed KV views and of routing on them (fake event streams)."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from radixserve.memory.page_hash import PrefixHasher
from radixserve.prefix import lora_namespace
from radixserve.sampling_params import SamplingParams
from radixserve.serving.router.dispatch import Dispatcher, Outstanding
from radixserve.serving.router.kv_index import WorkerKVView, decode_batch, tier_of_medium
from radixserve.serving.router.requests import RouterRequest

IDENTITY, PS = "model-x|layout-y", 4
HASHER = PrefixHasher(IDENTITY, PS)
SYSTEM = list(range(100, 164))  # 64 tokens: 16 pages
OTHER = list(range(500, 564))


def stored(tokens: list[int], namespace: str | None = None, medium: str = "CPU") -> BlockStored:
    keys = HASHER.keys(tokens, namespace)
    tokens_ids = tokens if medium == "CPU" else []
    return BlockStored(keys, None, tokens_ids[: len(keys) * PS], PS, None, medium)


def removed(tokens: list[int], namespace: str | None = None, medium: str = "CPU") -> BlockRemoved:
    return BlockRemoved(HASHER.keys(tokens, namespace), medium)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def synced_view() -> WorkerKVView:
    view = WorkerKVView()
    view.reset(IDENTITY, PS, "CPU")
    return view


def held(view: WorkerKVView, tokens: list[int], namespace: str | None = None) -> tuple[int, int]:
    m = view.match(view.page_keys(tokens, namespace))
    return m.l1_tokens, m.lower_tokens


def test_stored_removed_cleared() -> None:
    view = synced_view()
    assert view.apply(0, batch(stored(SYSTEM)))
    assert held(view, SYSTEM + [1, 2, 3]) == (64, 0)
    assert view.l1_tokens == 64
    # The last 8 pages evicted from L1: the match stops where the worker's would.
    assert view.apply(1, batch(BlockRemoved(HASHER.keys(SYSTEM)[8:], "CPU")))
    assert held(view, SYSTEM) == (32, 0)
    assert view.apply(2, batch(AllBlocksCleared()))
    assert held(view, SYSTEM) == (0, 0) and view.l1_tokens == 0 and not view.blocks


def test_vllm_decoder_roundtrip() -> None:
    """What the worker sends is vLLM's msgpack batch; the view decodes it."""
    data = msgspec.msgpack.encode(batch(stored(SYSTEM), removed(SYSTEM[:8])))
    view = synced_view()
    assert view.apply(0, decode_batch(data))
    assert held(view, SYSTEM) == (0, 0)  # the first page left L1: nothing is a prefix hit


def test_gap_desyncs_until_the_next_snapshot() -> None:
    view = synced_view()
    assert view.apply(0, batch(stored(SYSTEM)))
    assert not view.apply(2, batch(stored(OTHER)))  # batch 1 was lost
    assert not view.synced and not view.blocks and view.gaps == 1
    assert not view.apply(3, batch(stored(OTHER)))  # ignored until a snapshot
    view.reset(IDENTITY, PS, "CPU")
    assert view.apply(0, batch(AllBlocksCleared(), stored(OTHER)))
    assert held(view, OTHER) == (64, 0) and held(view, SYSTEM) == (0, 0)


def test_tenants_never_match_each_others_blocks() -> None:
    view = synced_view()
    assert view.apply(0, batch(stored(SYSTEM, "tenant-a")))
    assert held(view, SYSTEM, "tenant-a") == (64, 0)
    assert held(view, SYSTEM, "tenant-b") == (0, 0)
    assert held(view, SYSTEM) == (0, 0)


def test_lower_tiers_count_after_l1_and_below_it() -> None:
    """L1 on a CPU worker is "CPU"; its L2 is "CPU_L2" and L3 "DISK" (tier_mediums)."""
    assert tier_of_medium("CPU", "CPU") == "L1" and tier_of_medium("CPU_L2", "CPU") == "L2"
    assert tier_of_medium("CPU", "GPU") == "L2" and tier_of_medium("DISK", "GPU") == "L3"
    keys = HASHER.keys(SYSTEM)
    view = synced_view()
    # Pages 0-7 in L1, all 16 demoted to L2 earlier, pages 12-15 also on disk.
    view.apply(
        0,
        batch(
            BlockStored(keys, None, [], PS, None, "CPU_L2"),
            BlockStored(keys[12:], None, [], PS, None, "DISK"),
            BlockStored(keys[:8], None, SYSTEM[:32], PS, None, "CPU"),
        ),
    )
    m = view.match(keys)
    assert (m.l1_tokens, m.lower_tokens) == (32, 32)
    assert m.weighted == pytest.approx(32 + 32 * view.tier_weights["L2"])
    view.apply(1, batch(BlockRemoved(keys[8:], "CPU_L2")))  # only the disk copies stay
    m2 = view.match(keys)
    assert (m2.l1_tokens, m2.lower_tokens) == (32, 0)  # pages 8-11 nowhere: the match stops
    view.apply(2, batch(BlockStored(keys[8:12], None, [], PS, None, "DISK")))
    m3 = view.match(keys)
    assert m3.lower_tokens == 32 and m3.weighted == pytest.approx(32 + 32 * 0.5)
    # A page in both L1 and L2 leaves L1: still in L2.
    view.apply(3, batch(BlockStored(keys[:8], None, [], PS, None, "CPU_L2")))
    view.apply(4, batch(BlockRemoved(keys[:8], "CPU")))
    assert view.match(keys).l1_tokens == 0 and view.match(keys).lower_tokens == 64


def events_dispatcher(*workers: int) -> Dispatcher:
    d = Dispatcher("cache_aware", prefix_source="events", min_match_tokens=4)
    for w in workers:
        d.add_worker(w)
        d.views[w].reset(IDENTITY, PS, "CPU")
    return d


IDLE = {0: Outstanding(0), 1: Outstanding(0)}


def test_routes_to_the_worker_that_still_holds_the_prefix() -> None:
    """The tries believe worker 0 holds SYSTEM (it was sent there); its events say it was
    evicted, and worker 1 holds it: events route to 1, tries to 0."""
    for source in ("tries", "events"):
        d = events_dispatcher(0, 1) if source == "events" else Dispatcher(min_match_tokens=4)
        assert d.choose(SYSTEM + [1], {0: Outstanding(0)}).worker_id == 0
        if source == "events":
            d.views[0].apply(0, batch(stored(SYSTEM), removed(SYSTEM)))
            d.views[1].apply(0, batch(stored(SYSTEM)))
        got = d.choose(SYSTEM + [2], IDLE)
        assert got.worker_id == (1 if source == "events" else 0), source
        assert got.reason == "cache" and got.matched_tokens == 64


def test_l1_outranks_a_lower_tier_copy() -> None:
    d = events_dispatcher(0, 1)
    keys = HASHER.keys(SYSTEM)
    d.views[0].apply(0, batch(BlockStored(keys, None, [], PS, None, "CPU_L2")))
    d.views[1].apply(0, batch(stored(SYSTEM)))
    assert d.choose(SYSTEM + [3], IDLE).worker_id == 1
    # A lower-tier hit still beats recomputing: with 1 holding nothing, 0 wins on cache.
    d.views[1].apply(1, batch(AllBlocksCleared()))
    got = d.choose(SYSTEM + [4], IDLE)
    assert (got.worker_id, got.reason, got.matched_tokens) == (0, "cache", 64)


def test_in_flight_prefix_is_followed_before_its_events_arrive() -> None:
    d = events_dispatcher(0, 1)
    first = d.choose(SYSTEM + [5], IDLE, rid="r1")
    # No event yet (its prefill has not run): the follower goes where it is being computed,
    # even though that worker is busier.
    busy = {first.worker_id: Outstanding(1, 4000), 1 - first.worker_id: Outstanding(0)}
    follow = d.choose(SYSTEM + [6], busy, rid="r2")
    assert (follow.worker_id, follow.reason) == (first.worker_id, "in_flight")
    d.prefilled("r1")
    d.prefilled("r2")
    # Prefilled, yet the worker's events never said it holds it (evicted at once): no match.
    assert d.choose(SYSTEM + [7], IDLE).reason != "cache"


def test_unsynced_view_falls_back_to_the_tries() -> None:
    """A worker that sends no events (or lost some) is judged by what was sent to it."""
    d = Dispatcher("cache_aware", prefix_source="events", min_match_tokens=4)
    d.add_worker(0)
    d.add_worker(1)
    d.views[1].reset(IDENTITY, PS, "CPU")
    d.choose(SYSTEM + [1], {0: Outstanding(0)})  # recorded in worker 0's tree
    got = d.choose(SYSTEM + [2], IDLE)
    assert (got.worker_id, got.reason) == (0, "cache")
    d.views[0].reset(IDENTITY, PS, "CPU")  # synced now, and empty: the tree no longer counts
    assert d.choose(SYSTEM + [3], IDLE).reason != "cache"


def test_restart_forgets_the_view() -> None:
    d = events_dispatcher(0, 1)
    d.views[0].apply(0, batch(stored(SYSTEM)))
    d.remove_worker(0)
    d.add_worker(0)
    assert not d.views[0].synced and not d.views[0].blocks


def test_tenant_prompt_matches_only_its_namespace() -> None:
    d = events_dispatcher(0, 1)
    d.views[0].apply(0, batch(stored(SYSTEM, "a")))
    d.views[1].apply(0, batch(stored(SYSTEM, "b")))
    assert d.choose(SYSTEM + [1], IDLE, namespace="b").worker_id == 1
    assert d.choose(SYSTEM + [1], IDLE, namespace="a").worker_id == 0
    assert d.choose(SYSTEM + [1], IDLE).reason != "cache"


def test_unknown_prefix_source_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix source"):
        Dispatcher(prefix_source="guess")  # type: ignore[arg-type]


def test_an_adapters_prompt_routes_by_its_own_namespace() -> None:
    """A LoRA adapter's pages are hashed under its own namespace on a worker (the engine's
    intake splits the tenant's by the adapter); the router routes the adapter's prompts by
    that key (RouterRequest.cache_namespace), not toward the base model's pages of the same
    tokens, and the tenant's namespace still goes to the worker as it was."""
    d = events_dispatcher(0, 1)
    d.views[0].apply(0, batch(stored(SYSTEM)))  # the base model's pages
    d.views[1].apply(0, batch(stored(SYSTEM, lora_namespace(None, "sql@0123"))))
    st = RouterRequest("r", b"c", "c", SYSTEM + [1], SamplingParams(), False, None, None, None, 0.0)
    assert d.choose(st.prompt_ids, IDLE, namespace=st.cache_namespace).worker_id == 0
    st.lora, st.lora_key = "sql", "sql@0123"  # the name, and its key in the workers' hellos
    assert st.namespace is None and st.cache_namespace == lora_namespace(None, "sql@0123")
    assert d.choose(st.prompt_ids, IDLE, namespace=st.cache_namespace).worker_id == 1
