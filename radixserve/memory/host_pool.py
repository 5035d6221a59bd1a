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

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from radixkernels.kv_format import KVCacheDtype
from radixserve.memory.allocator import PageAllocator
from radixserve.memory.kv_convert import convert_pages, same_geometry
from radixserve.memory.page_hash import PageKey
from radixserve.memory.pinned_staging import PendingScatter, PinnedStaging, record_event
from radixserve.memory.pool import KVPool

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener


class PageCopier:
    """Copies pages between two pools of the same format.

    On CUDA the copies run on a copy stream of their own that first waits for the compute
    stream (whose kernels wrote the pages), and the compute stream then waits for the copy,
    so a load-back is ordered before the extend that reads it and a demoted page is read
    before anything overwrites it. Host memory is reached through pinned staging buffers
    (:mod:`~radixserve.memory.pinned_staging`) with ``non_blocking`` copies, so neither the
    host nor the compute stream waits for a copy: a demotion's host scatter into the L2
    slots is deferred until something reads or reuses L2 (:meth:`finish`, which the host
    cache calls first). On the CPU the copies are plain synchronous ``index_copy_`` unless
    ``staged`` asks for the staging path (tests: the same logic with events complete at once).
    """

    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged = self.stream is not None if staged is None else staged
        self.staging = PinnedStaging(pin=self.stream is not None)
        self.pending: list[PendingScatter] = []  # demotions whose host scatter is deferred

    def copy(
        self,
        src: KVPool,
        src_pages: Sequence[int],
        dst: KVPool,
        dst_pages: Sequence[int],
        to_host: bool | None = None,
        part: bool | None = None,
    ) -> None:
        """Copy ``src`` pages ``src_pages[i]`` into ``dst`` pages ``dst_pages[i]`` (one batched
        copy per tensor). ``to_host``: whether ``dst`` is the host pool (None: ``dst`` is on
        the CPU and ``src`` is not); a staged demotion's host scatter waits for :meth:`finish`.
        ``part``: pools with window layers copy one part at a time (``KVPool.part_tensors``:
        False the global layers', True the window layers', the page ids of that part)."""
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
        if to_host is None:
            to_host = dst.device.type == "cpu" and src.device.type != "cpu"
        if not to_host:
            self.finish()  # earlier demotions land first: this copy may read their slots
        same = src.layout() == dst.layout()
        if part is not None and not same:
            raise ValueError("window-pool pages move only between pools of one format")
        staged = self.staged and same
        move: Callable[[KVPool, Sequence[int], KVPool, Sequence[int]], None]
        if staged:
            move = functools.partial(self._staged_copy, to_host=to_host, part=part)
        else:
            move = functools.partial(self._copy, part=part) if same else convert_pages
        if self.stream is None:
            move(src, src_pages, dst, dst_pages)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            move(src, src_pages, dst, dst_pages)
        compute.wait_stream(self.stream)
        if dst.device.type == "cpu" and not staged:
            self.stream.synchronize()  # the host reads (or spills) these slots next

    def finish(self) -> None:
        """Complete every deferred demotion: wait for its copy, scatter into the L2 slots."""
        pending, self.pending = self.pending, []
        for p in pending:
            p.finish(self.staging)

    def _staged_copy(
        self,
        src: KVPool,
        src_pages: Sequence[int],
        dst: KVPool,
        dst_pages: Sequence[int],
        to_host: bool,
        part: bool | None,
    ) -> None:
        """Through pinned staging: host memory is only ever copied from or to a pinned buffer."""
        si = torch.tensor(list(src_pages), dtype=torch.long, device=src.device)
        di = torch.tensor(list(dst_pages), dtype=torch.long, device=dst.device)
        if to_host:  # demotion: device gather, async D2H, host scatter at finish()
            staged = []
            for s in _tensors(src, part):
                rows = s.index_select(1, si)
                buf = self.staging.take(tuple(rows.shape), rows.dtype)
                buf.copy_(rows, non_blocking=True)
                staged.append(buf)
            event = record_event(self.stream)
            self.pending.append(PendingScatter(event, staged, _tensors(dst, part), di))
            return
        bufs = []  # load-back: host gather into staging, async H2D, device scatter
        for s, d in zip(_tensors(src, part), _tensors(dst, part)):
            shape = (s.shape[0], len(src_pages), *s.shape[2:])
            buf = self.staging.take(shape, s.dtype)
            torch.index_select(s, 1, si, out=buf)
            d.index_copy_(1, di, buf.to(d.device, non_blocking=True))
            bufs.append(buf)
        event = record_event(self.stream)
        for buf in bufs:
            self.staging.release(buf, event)

    @staticmethod
    def _copy(
        src: KVPool,
        src_pages: Sequence[int],
        dst: KVPool,
        dst_pages: Sequence[int],
        part: bool | None = None,
    ) -> None:
        si = torch.tensor(list(src_pages), dtype=torch.long, device=src.device)
        di = torch.tensor(list(dst_pages), dtype=torch.long, device=dst.device)
        for s, d in zip(_tensors(src, part), _tensors(dst, part)):
            rows = s.index_select(1, si)
            if rows.device != d.device:
                rows = rows.to(d.device, non_blocking=d.device.type == "cuda")
            d.index_copy_(1, di, rows)


def _tensors(pool: KVPool, part: bool | None) -> list[torch.Tensor]:
    return pool.page_tensors() if part is None else pool.part_tensors(part)


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
            # Behind a window pool (memory.window_host): slot s's window layers at window page s.
            window_layers=device_pool.window_layers,
            num_window_pages=num_pages if device_pool.window_layers else 0,
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
        self._copy_in([p for p, _ in new[: len(slots)]], slots)
        return len(slots)

    def _copy_in(self, pages: list[int], slots: list[int]) -> None:
        """L1 ``pages`` into L2 ``slots``."""
        self.copier.copy(self.device_pool, pages, self.pool, slots, to_host=True)

    def _copy_out(self, slots: list[int], pages: Sequence[int]) -> None:
        """L2 ``slots`` into L1 ``pages``."""
        self.copier.copy(self.pool, slots, self.device_pool, pages, to_host=False)

    def load(self, keys: Sequence[PageKey], pages: Sequence[int]) -> None:
        """Copy the cached ``keys`` into L1 ``pages`` (every key must be cached)."""
        slots = [self._index[k] for k in keys]
        self.touch(keys)
        self._copy_out(slots, pages)

    def evict(self, n: int) -> int:
        """Free ``n`` slots, least recently used first, spilling each; returns slots freed."""
        self.copier.finish()  # deferred demotions land before a slot is spilled or reused
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
        self.copier.finish()
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
