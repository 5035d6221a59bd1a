"""The KV hierarchy under the radix cache: L2 host pages and L3 page files, keyed by prefix hash.

::

    L1 device pool (the radix tree's pages)
        │  demote: an L1 eviction copies the pages to L2 unless L2 has them already
        ▼  load:   a match that continues past L1 copies L2/L3 pages into fresh L1 pages
    L2 HostKVCache   LRU; evicting a slot spills it to L3
        │
        ▼
    L3 KVStorage     DiskKVStore: files, survive restarts, shared by workers of one host;
                     MooncakeKVStore: a Mooncake Store cluster, shared by every host. A
                     shared store is also written through: pages entering the tree go to
                     L3 at once, so other workers find them while they are still hot here

L2 and L3 are indexed by page key (``page_hash``): a chained hash of the whole token
prefix a page ends, seeded with the model, the KV layout and the namespace. So a page found
under a key holds exactly that prefix's KV for this model, and tenants never share one. The
radix tree decides what leaves L1 and when (:class:`~radixserve.memory.hi_radix_cache.HiRadixCache`);
this class only moves pages and keeps the tiers' own accounting.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

from radixserve.memory.disk_store import DiskKVStore
from radixserve.memory.host_pool import HostKVCache, PageCopier
from radixserve.memory.kv_convert import host_format
from radixserve.memory.kv_storage import KVStorage
from radixserve.memory.page_hash import PageKey, PrefixHasher
from radixserve.memory.pool import KVPool
from radixserve.memory.window_host import WindowHostKVCache
from radixserve.memory.window_pool import WindowPages

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener


class HierarchyStats(NamedTuple):
    """Monotonic page counters of the lower tiers."""

    demoted_pages: int  # L1 -> L2 copies
    loaded_l2_pages: int  # L2 -> L1 loads
    loaded_l3_pages: int  # L3 -> (L2 ->) L1 loads
    l2_evicted_pages: int  # L2 slots reused (spilled to L3 when it is on)
    l3_written_pages: int
    l3_corrupt_pages: int  # page files rejected by the checksum/size check


class KVHierarchy:
    """L2 (and optionally L3) behind one device pool.

    Args:
        device_pool: the L1 pool.
        host_pages: L2 capacity in pages (>= 1).
        storage_dir: the L3 directory, or None for no L3.
        model_id: names the model in page keys (its path or name; pages of another model
            never match).
        host_dtype: L2's KV format (``kv_convert.HICACHE_DTYPES``; "auto": L1's). L3 files
            hold L2's format, and their directory is named by it.
        storage: builds another L3 (``KVStorage``) from the identity of L2's layout, instead
            of the page files of ``storage_dir``.
        window: the window pool of a sliding-window model's L1 (``memory.window_host``: L2
            carries a page's window-layer KV when it still has it; no L3, L2 in L1's format).
    """

    def __init__(
        self,
        device_pool: KVPool,
        host_pages: int,
        storage_dir: str | os.PathLike[str] | None = None,
        model_id: str = "",
        host_dtype: str = "auto",
        storage: Callable[[str], KVStorage] | None = None,
        window: WindowPages | None = None,
    ) -> None:
        if host_pages < 1:
            raise ValueError(f"the hierarchical cache needs >= 1 host page, got {host_pages}")
        if window is not None and (storage or storage_dir or host_dtype != "auto"):
            raise ValueError("a window pool's L2 has no L3 and keeps L1's KV format")
        self.device_pool = device_pool
        identity = f"{model_id}|{device_pool.layout()}"
        self.hasher = PrefixHasher(identity, device_pool.page_size)
        self.copier = PageCopier(device_pool.device)
        kv_dtype, act_dtype = host_format(device_pool, host_dtype)
        self.host = (
            HostKVCache(
                device_pool, host_pages, self.copier, kv_dtype=kv_dtype, act_dtype=act_dtype
            )
            if window is None
            else WindowHostKVCache(device_pool, host_pages, self.copier, window)
        )
        # L3 records hold L2's bytes: named per (model, L2 layout).
        l3_identity = f"{model_id}|{self.host.pool.layout()}"
        self.disk: KVStorage | None = (
            storage(l3_identity)
            if storage is not None
            else DiskKVStore(storage_dir, l3_identity)
            if storage_dir is not None
            else None
        )
        if self.disk is not None:
            self.host.spill = self._spill
        self._demoted = self._loaded_l2 = self._loaded_l3 = 0

    @property
    def stats(self) -> HierarchyStats:
        d = self.disk
        return HierarchyStats(
            self._demoted,
            self._loaded_l2,
            self._loaded_l3,
            self.host.evicted,
            d.writes if d else 0,
            d.corrupt if d else 0,
        )

    def set_listener(self, listener: TierListener | None) -> None:
        """Report pages entering and leaving L2 and L3 to ``listener`` (KV events)."""
        self.host.listener = listener
        if self.disk is not None:
            self.disk.listener = listener

    @property
    def l3_enabled(self) -> bool:
        return self.disk is not None and self.disk.enabled

    def where(self, key: PageKey) -> frozenset[str]:
        """The lower tiers holding ``key``: a subset of {"L2", "L3"}."""
        tiers = {"L2"} if key in self.host else set()
        if self.disk is not None and self.disk.contains(key):
            tiers.add("L3")
        return frozenset(tiers)

    # ------------------------------------------------------------------ moves
    def demote(self, pages: Sequence[int], keys: Sequence[PageKey]) -> int:
        """L1 ``pages`` (keyed ``keys``) are about to be freed: keep them in L2. Returns pages copied."""
        n = self.host.store(pages, keys)
        self._demoted += n
        return n

    def available(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` L2 or L3 holds (capped at L2's size: loads pass through it)."""
        n = 0
        for k in keys[: self.host.num_pages]:
            if k not in self.host and not (self.disk is not None and self.disk.contains(k)):
                break
            n += 1
        return n

    def load(self, keys: Sequence[PageKey], pages: Sequence[int]) -> int:
        """Copy the pages keyed ``keys`` into L1 ``pages``, in order, stopping at the first key
        neither L2 nor L3 can serve (absent, evicted, corrupt). Returns the pages loaded.

        L3 pages pass through L2 (they stay there, most recently used). At most L2's size
        per call, so an L3 read can never evict a page this same load needs: the keys
        already in L2 are refreshed first and every slot taken lands behind them.
        """
        keys = list(keys[: min(len(pages), self.host.num_pages)])
        self.host.touch(keys)
        like = [t[:, 0] for t in self.host.pool.page_tensors()] if self.disk is not None else []
        n = from_disk = 0
        for k in keys:
            if k not in self.host:
                rows = self.disk.read(k, like) if self.disk is not None else None
                if rows is None:
                    break
                slots = self.host.reserve([k])
                if not slots:  # every L2 page is held by this load
                    break
                slot = slots[0]
                for t, r in zip(self.host.pool.page_tensors(), rows):
                    t[:, slot] = r
                from_disk += 1
            n += 1
        self.host.load(keys[:n], pages[:n])
        self._loaded_l2 += n - from_disk
        self._loaded_l3 += from_disk
        return n

    @contextmanager
    def hold(self, keys: Sequence[PageKey]) -> Iterator[None]:
        """Keep ``keys`` in L2 while open (see :meth:`HostKVCache.hold`)."""
        with self.host.hold(keys):
            yield

    def write_through(self, pages: Sequence[int], keys: Sequence[PageKey]) -> int:
        """With a shared L3 (``KVStorage.write_through``): copy L1 ``pages`` to L2 and hand
        them to L3 now, so other workers can use them. Returns pages handed over."""
        store = self.disk
        if store is None or not store.write_through or not store.enabled:
            return 0
        self.host.store(pages, keys)
        n = 0
        for k in keys:
            slot = self.host.slot(k)
            if slot is not None and store.write(
                k, [t[:, slot] for t in self.host.pool.page_tensors()]
            ):
                n += 1
        return n

    def _spill(self, key: PageKey, slot: int) -> None:
        assert self.disk is not None
        self.disk.write(key, [t[:, slot] for t in self.host.pool.page_tensors()])

    def persist(self, pages: Sequence[int], keys: Sequence[PageKey]) -> int:
        """Write L1 ``pages`` and every L2 page to L3 (for a restart or another worker);
        returns the files written. A no-op without L3."""
        disk = self.disk
        if disk is None:
            return 0
        if disk.write_through:  # a shared store has every page once its writes land
            disk.flush(None)
            return 0
        before = disk.writes
        todo = [(p, k) for p, k in zip(pages, keys) if not disk.contains(k)]
        # Through L2, in L2's format: storing a chunk spills what it pushes out to L3.
        step = self.host.num_pages
        for i in range(0, len(todo), step):
            chunk = todo[i : i + step]
            self.host.store([p for p, _ in chunk], [k for _, k in chunk])
            if not disk.enabled:
                return disk.writes - before
        self.copier.finish()  # deferred demotions land in their L2 slots before they are read
        for k in self.host.keys():
            slot = self.host.slot(k)
            assert slot is not None
            if not disk.contains(k):
                self._spill(k, slot)
        disk.flush(None)
        return disk.writes - before

    def close(self) -> None:
        """Release L3's connections (after :meth:`persist`, at shutdown)."""
        if self.disk is not None:
            self.disk.close()

    def clear_host(self) -> None:
        """Drop L2 (L3 is storage shared with other processes: it stays)."""
        self.host.clear()

    def check_invariants(self) -> None:
        self.host.check_invariants()
