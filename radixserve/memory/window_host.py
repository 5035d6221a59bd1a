"""L2 behind a sliding-window model's two pools: a demoted page carries its window KV.

The device pool keeps the global layers' KV under global page ids and the window layers'
under window page ids (:mod:`~radixserve.memory.window_pool`); a tree page may have lost its
window page (a tombstone). L2 keeps both parts of a page in one slot::

    L1 global page g  ──global layers──>  L2 slot s  (global part, slot s)
    L1 window page table[g] ─window layers─>  (window part, slot s)   whole[s] = 1
    no window page (a tombstone)              nothing                  whole[s] = 0

A load-back copies the global part into the fresh L1 page and, where ``whole``, the window
part into the window page the allocator gave it; a page that came without its window KV
gives that window page back at once and enters the tree as a tombstone. The sliding-window
cache then cuts the hit back to where the last window is whole, as for any L1 match, so a
hit from L2 is never wrong, and one whose windows were whole when demoted is served whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.memory.host_pool import HostKVCache, PageCopier
from radixserve.memory.pool import KVPool
from radixserve.memory.window_pool import WindowPages

__all__ = ["WindowHostKVCache"]


class WindowHostKVCache(HostKVCache):
    """:class:`HostKVCache` for a device pool with window layers (module docstring)."""

    def __init__(
        self, device_pool: KVPool, num_pages: int, copier: PageCopier, window: WindowPages
    ) -> None:
        super().__init__(device_pool, num_pages, copier)
        self.window = window
        self.whole = bytearray(num_pages)  # slot -> its window layers' KV is there

    def _copy_in(self, pages: list[int], slots: list[int]) -> None:
        dev, table = self.device_pool, self.window.table
        self.copier.copy(dev, pages, self.pool, slots, to_host=True, part=False)
        have_w, have_s = [], []
        for g, s in zip(pages, slots):
            self.whole[s] = table[g] >= 0
            if table[g] >= 0:
                have_w.append(table[g])
                have_s.append(s)
        if have_w:
            self.copier.copy(dev, have_w, self.pool, have_s, to_host=True, part=True)

    def _copy_out(self, slots: list[int], pages: Sequence[int]) -> None:
        dev, w = self.device_pool, self.window
        self.copier.copy(self.pool, slots, dev, pages, to_host=False, part=False)
        have_s, have_w, dropped = [], [], []
        for s, g in zip(slots, pages):
            if self.whole[s] and w.table[g] >= 0:
                have_s.append(s)
                have_w.append(w.table[g])
            elif w.table[g] >= 0:  # a fresh, private page: no lock or tree counts it yet
                dropped.append(w.unmap(g))
        if have_s:
            self.copier.copy(self.pool, have_s, dev, have_w, to_host=False, part=True)
        if dropped:
            w.allocator.free(dropped)
