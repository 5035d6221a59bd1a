"""The engine's prefix cache: which one it runs, its L2/L3 tiers, KV events and persistence.

::

    disable_radix_cache        NoPrefixCache (same interface, caches nothing)
    default                    RadixCache over the device pool (L1)
    hierarchical_cache         HiRadixCache: L1 pages ⇄ L2 host pool ⇄ L3 (page files, or
                               a Mooncake Store: hicache_storage_backend)

KV page keys (L3 files, KV events) name the checkpoint by :func:`model_identity`, so pages
written for other weights are never read back as this model's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixserve.engine.config import EngineConfig
from radixserve.memory import NoPrefixCache, PageAllocator, PrefixCache, RadixCache
from radixserve.memory.kv_storage import KVStorage, StorageMetrics
from radixserve.memory.leases import LeaseConfig
from radixserve.memory.swa_cache import SWARadixCache
from radixserve.memory.window_pool import WindowedPageAllocator

if TYPE_CHECKING:
    from radixserve.memory.pool import KVPool

logger = logging.getLogger(__name__)


def model_identity(model_path: Path) -> str:
    """Names a checkpoint in KV page keys: its path, and the size and mtime of its files, so
    that pages stored for replaced weights are never read back for the new ones."""
    parts = [str(Path(model_path).resolve())]
    try:
        for f in sorted(Path(model_path).iterdir()):
            if f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    except OSError:
        pass
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def make_prefix_cache(
    cfg: EngineConfig, allocator: PageAllocator, pool: KVPool, model_path: Path
) -> PrefixCache:
    """The prefix cache: none, the radix cache, or the radix cache over L2/L3 tiers."""
    if cfg.disable_radix_cache:
        return NoPrefixCache(allocator, cfg.page_size)
    if not cfg.hierarchical_cache:
        if isinstance(allocator, WindowedPageAllocator):
            return SWARadixCache(allocator, cfg.page_size)
        return RadixCache(allocator, cfg.page_size)
    from radixkernels.kv_format import KVFormat
    from radixserve.memory.hi_radix_cache import HiRadixCache
    from radixserve.memory.hierarchy import KVHierarchy
    from radixserve.memory.kv_convert import host_format

    kv_dtype, act_dtype = host_format(pool, cfg.hicache_dtype)
    host_page_bytes = (
        KVFormat.create(kv_dtype, act_dtype, pool.head_dim).bytes_per_token(
            pool.num_layers, pool.kv_heads
        )
        * pool.page_size
    )
    if cfg.hicache_size is not None:
        host_pages = max(1, int(cfg.hicache_size * 2**30) // host_page_bytes)
    else:  # SGLang's default host/device ratio
        host_pages = 2 * allocator.num_pages
    hierarchy = KVHierarchy(
        pool,
        host_pages,
        cfg.hicache_storage_dir,
        model_identity(model_path),
        host_dtype=cfg.hicache_dtype,
        storage=l3_factory(cfg),
        # engine.window_setup: a window pool only with an L2 alone, in L1's format
        window=allocator.window if isinstance(allocator, WindowedPageAllocator) else None,
    )
    logger.info(
        "hierarchical cache: L2 %d pages (%.2f GiB, %s), L3 %s",
        host_pages,
        host_pages * host_page_bytes / 2**30,
        hierarchy.host.pool.fmt.kv_dtype.value
        if kv_dtype.is_quantized
        else str(act_dtype).removeprefix("torch."),
        cfg.hicache_storage_dir
        or ("mooncake" if cfg.hicache_storage_backend == "mooncake" else "off"),
    )
    if isinstance(allocator, WindowedPageAllocator):
        from radixserve.memory.swa_hi_cache import SWAHiRadixCache

        return SWAHiRadixCache(allocator, cfg.page_size, hierarchy)
    return HiRadixCache(allocator, cfg.page_size, hierarchy)


def l3_factory(cfg: EngineConfig) -> Callable[[str], KVStorage] | None:
    """The L3 builder for a non-file backend (None: page files in hicache_storage_dir, if any)."""
    if cfg.hicache_storage_backend != "mooncake":
        return None
    from radixserve.memory.mooncake_store import MooncakeKVStore, MooncakeStoreConfig

    extra = json.loads(cfg.hicache_storage_backend_extra_config or "{}")
    path = cfg.hicache_storage_backend_config
    mc = (
        MooncakeStoreConfig.from_file(path, **extra)
        if path
        else MooncakeStoreConfig.create(**extra)
    )
    return lambda identity: MooncakeKVStore(mc, identity)


def attach_kv_events(
    cache: PrefixCache, pool: KVPool, model_path: Path, device: torch.device
) -> None:
    """Record ``cache``'s KV events from now on (vLLM's format; drained by the caller)."""
    from radixserve.memory.kv_events import KVEventRecorder
    from radixserve.memory.page_hash import PrefixHasher

    hierarchy = getattr(cache, "hierarchy", None)
    hasher = (
        hierarchy.hasher
        if hierarchy is not None
        else PrefixHasher(f"{model_identity(model_path)}|{pool.layout()}", pool.page_size)
    )
    recorder = KVEventRecorder(hasher, "GPU" if device.type == "cuda" else "CPU")
    cache.listener = recorder
    if hierarchy is not None:  # L2/L3 report their pages too, under their own mediums
        hierarchy.set_listener(recorder)


def rename_cached_model(cache: PrefixCache, pool: KVPool, model_path: Path) -> None:
    """New weights are served (``Engine.update_weights_from_disk``): the page keys of the
    L2/L3 tiers and of the KV events name the checkpoint at ``model_path`` from now on."""
    hierarchy = getattr(cache, "hierarchy", None)
    listener = getattr(cache, "listener", None)
    hashers = {getattr(hierarchy, "hasher", None), getattr(listener, "hasher", None)}
    for hasher in hashers:
        if hasher is not None:  # the hierarchy's and the events' may be one
            hasher.rename(f"{model_identity(model_path)}|{pool.layout()}")


def hicache_stats(cache: PrefixCache) -> dict[str, Any]:
    """The L2/L3 tiers' counters, as :class:`~radixserve.engine.outputs.EngineStats` fields
    (none without a hierarchy)."""
    hierarchy = getattr(cache, "hierarchy", None)
    if hierarchy is None:
        return {}
    h = hierarchy.stats
    m = hierarchy.disk.metrics() if hierarchy.disk is not None else StorageMetrics()
    return {
        "storage_hits_total": m.hits,
        "storage_misses_total": m.misses,
        "storage_timeouts_total": m.timeouts,
        "storage_read_bytes_total": m.read_bytes,
        "storage_written_bytes_total": m.written_bytes,
        "storage_read_seconds_total": m.read_seconds,
        "host_cached_pages": hierarchy.host.num_cached,
        "demoted_pages_total": h.demoted_pages,
        "loaded_host_pages_total": h.loaded_l2_pages,
        "loaded_storage_pages_total": h.loaded_l3_pages,
        "storage_written_pages_total": h.l3_written_pages,
        "storage_corrupt_pages_total": h.l3_corrupt_pages,
    }


def persist_prefix_cache(cache: PrefixCache | None, storage_dir: str | None) -> None:
    """With an L3 directory, write the cached KV there (L1 and L2) so that a restart, or
    another worker on this host, starts warm; nothing for the other caches."""
    persist = getattr(cache, "persist", None)
    if persist is not None:
        n = persist()
        if n:
            logger.info("hierarchical cache: wrote %d KV pages to %s", n, storage_dir)
        cache.hierarchy.close()  # type: ignore[union-attr]


def lease_config(cfg: EngineConfig) -> LeaseConfig:
    """The session leases the engine's flags ask for (memory.leases)."""
    return LeaseConfig(
        enabled=cfg.session_leases == "on",
        default_s=cfg.session_lease_default_s,
        cap_s=cfg.session_lease_cap_s,
    )


def lease_stats(cache: PrefixCache) -> dict[str, Any]:
    """Session-lease gauges and counters, as :class:`~radixserve.engine.outputs.EngineStats`
    fields."""
    c = cache.leases.counters
    return {
        "leased_pages": cache.num_leased_pages,
        "leases_active": len(cache.leases),
        "leases_granted_total": c.granted,
        "lease_hits_total": c.hits,
        "lease_expired_total": c.expired,
        "lease_yielded_total": c.yielded,
        "lease_trimmed_pages_total": c.trimmed_pages,
        "sessions_adopted_total": c.adopted,
        "lease_lost_tokens_total": c.lost_tokens,
    }


def miss_stats(cache: PrefixCache) -> dict[str, Any]:
    """What the cache's miss reports add up to (memory.miss_report), as
    :class:`~radixserve.engine.outputs.EngineStats` fields (none without a radix cache)."""
    return {} if cache.misses is None else cache.misses.stats.as_dict()
