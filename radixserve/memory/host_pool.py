"""L2: a host-memory KV pool with an LRU index of page keys, and the page copier.

::

    L1 (device pool)                  L2 (this pool, host RAM; pinned on CUDA)
    page id ──copy_pages──────────►   slot ◄── index: PageKey -> slot, least recently used first
            ◄─────────copy_pages──    slot
                                      evicting the LRU slot first hands it to ``spill``
                                      (the L3 disk store writes it out), then reuses it

Every slot is in exactly one state: free (its allocator) or holding one key (the index).
The pool has the L1 pool's format (dtype, layout) by default, so a page moves by a plain
copy of its rows of every page-indexed tensor (``KVPool.page_tensors``); in a smaller KV
dtype (``kv_dtype``/``act_dtype``) a page is converted on the way (``kv_convert``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from radixkernels.kv_format import KVCacheDtype
from radixserve.memory.allocator import PageAllocator
from radixserve.memory.kv_convert import convert_pages, same_geometry
from radixserve.memory.page_hash import PageKey
from radixserve.memory.pool import KVPool

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener


class PageCopier:
    """Copies pages between two pools of the same format.

    On CUDA the copies run on a copy stream of their own that first waits for the compute
    stream (whose kernels wrote the pages), and the compute stream then waits for the copy,
    so a load-back is ordered before the extend that reads it and a demoted page is read
    before anything overwrites it; host-side readers (the L3 writer) synchronize. On the CPU
    the copies are plain synchronous ``index_copy_``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(
        self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
    ) -> None:
        """Copy ``src`` pages ``src_pages[i]`` into ``dst`` pages ``dst_pages[i]`` (one batched copy per tensor)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(
                f"{len(src_pages)} source pages for {len(dst_pages)} destination pages"
            )
        if not src_pages:
            return
        if not same_geometry(src, dst):
            raise ValueError(
                f"page copy between different layouts: {src.layout()} -> {dst.layout()}"
            )
        move = self._copy if src.layout() == dst.layout() else convert_pages
        if self.stream is None:
            move(src, src_pages, dst, dst_pages)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            move(src, src_pages, dst, dst_pages)
        compute.wait_stream(self.stream)
        if dst.device.type == "cpu":
            self.stream.synchronize()  # the host reads (or spills) these slots next

    @staticmethod
    def _copy(src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]) -> None:
        si = torch.tensor(list(src_pages), dtype=torch.long, device=src.device)
        di = torch.tensor(list(dst_pages), dtype=torch.long, device=dst.device)
        for s, d in zip(src.page_tensors(), dst.page_tensors()):
            rows = s.index_select(1, si)
            if rows.device != d.device:
                rows = rows.to(d.device, non_blocking=d.device.type == "cuda")
            d.index_copy_(1, di, rows)


class HostKVCache:
    """The L2 tier: ``num_pages`` host pages like ``device_pool``'s (or in ``kv_dtype`` /
    ``act_dtype``: a smaller format, converted on every copy), indexed by page key, LRU.

    ``spill(key, slot)`` is called for the least recently used page before its slot is
    reused (the hierarchy writes it to L3 there); without it the page is dropped.
    """

    def __init__(
        self,
        device_pool: KVPool,
        num_pages: int,
        copier: PageCopier,
        spill: Callable[[PageKey, int], None] | None = None,
        kv_dtype: KVCacheDtype | None = None,
        act_dtype: torch.dtype | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.pool = KVPool(
            device_pool.num_layers,
            num_pages,
            device_pool.page_size,
            device_pool.kv_heads,
            device_pool.head_dim,
            kv_dtype=device_pool.fmt.kv_dtype if kv_dtype is None else kv_dtype,
            act_dtype=device_pool.fmt.act_dtype if act_dtype is None else act_dtype,
            device="cpu",
            pin_memory=True,
        )
        self.allocator = PageAllocator(num_pages)
        self.copier = copier
        self.spill = spill
        self._index: OrderedDict[PageKey, int] = OrderedDict()  # least recently used first
        # Keys a load-back in progress needs: eviction passes over them (see ``hold``).
        self._held: frozenset[PageKey] = frozenset()
        self.evicted = 0
        self.listener: TierListener | None = None  # KV events (the hierarchy sets it)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def __contains__(self, key: PageKey) -> bool:
        return key in self._index

    def keys(self) -> list[PageKey]:
        """Cached keys, least recently used first."""
        return list(self._index)

    def slot(self, key: PageKey) -> int | None:
        """The slot holding ``key`` (no LRU refresh), or None."""
        return self._index.get(key)

    def touch(self, keys: Iterable[PageKey]) -> None:
        """Mark ``keys`` (those cached) most recently used, in order."""
        for k in keys:
            if k in self._index:
                self._index.move_to_end(k)

    @contextmanager
    def hold(self, keys: Iterable[PageKey]) -> Iterator[None]:
        """While open, eviction never takes ``keys`` (a load-back allocates L1 pages, which
        demotes other pages into L2, before it copies these out)."""
        before = self._held
        self._held = before | frozenset(keys)
        try:
            yield
        finally:
            self._held = before

    def reserve(self, keys: Sequence[PageKey]) -> list[int]:
        """Give the leading ``keys`` (none cached yet) a slot each, evicting LRU pages (through
        ``spill``) as needed; the caller fills the slots right away. Returns fewer slots than
        keys when L2 runs out of pages it may evict."""
        keys = list(keys)[: self.num_pages]
        short = len(keys) - self.allocator.num_free
        if short > 0:
            self.evict(short)
        slots = self.allocator.alloc(min(len(keys), self.allocator.num_free))
        for k, s in zip(keys, slots):
            self._index[k] = s
        if self.listener is not None:
            self.listener.tier_stored("L2", keys[: len(slots)])
        return slots

    def store(self, pages: Sequence[int], keys: Sequence[PageKey]) -> int:
        """Copy L1 ``pages`` (keyed ``keys``) into L2 unless already there; returns pages copied.

        When more pages come than L2 holds, the first ones (closest to the root, most
        shared) are kept.
        """
        self.touch(keys)
        new = [(p, k) for p, k in zip(pages, keys) if k not in self._index][: self.num_pages]
        if not new:
            return 0
        slots = self.reserve([k for _, k in new])
        self.copier.copy(self.device_pool, [p for p, _ in new[: len(slots)]], self.pool, slots)
        return len(slots)

    def load(self, keys: Sequence[PageKey], pages: Sequence[int]) -> None:
        """Copy the cached ``keys`` into L1 ``pages`` (every key must be cached)."""
        slots = [self._index[k] for k in keys]
        self.touch(keys)
        self.copier.copy(self.pool, slots, self.device_pool, pages)

    def evict(self, n: int) -> int:
        """Free ``n`` slots, least recently used first, spilling each; returns slots freed."""
        freed: list[int] = []
        gone: list[PageKey] = []
        skipped = 0  # held keys passed over (moved to the MRU end)
        while len(freed) < n and len(self._index) > skipped:
            key, slot = self._index.popitem(last=False)
            if key in self._held:
                self._index[key] = slot
                skipped += 1
                continue
            if self.spill is not None:
                self.spill(key, slot)
            freed.append(slot)
            gone.append(key)
        self.allocator.free(freed)
        if self.listener is not None:
            self.listener.tier_removed("L2", gone)
        self.evicted += len(freed)
        return len(freed)

    def clear(self) -> None:
        """Drop every page (no spilling)."""
        if self.listener is not None:
            self.listener.tier_removed("L2", list(self._index))
        self._index.clear()
        self.allocator.reset()

    def check_invariants(self) -> None:
        """Each slot is free or holds exactly one key."""
        self.allocator.check_invariants()
        slots = list(self._index.values())
        if len(set(slots)) != len(slots):
            raise AssertionError("L2 invariant broken: a slot holds two keys")
        free = self.allocator.free_pages()
        if not free.isdisjoint(slots):
            raise AssertionError(
                f"L2 invariant broken: slots both free and cached: {sorted(free & set(slots))[:8]}"
            )
        if len(free) + len(slots) != self.num_pages:
            raise AssertionError(
                f"L2 invariant broken: free {len(free)} + cached {len(slots)} != {self.num_pages}"
            )
