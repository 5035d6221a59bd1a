"""The window layers' pages of a sliding-window model: a second page pool behind the first.

A model whose layers mix sliding-window attention (each row sees the last ``window``
positions) with global attention keeps two kinds of KV. Global layers need every token's;
window layers only the last window's. So the window layers get their own, smaller pool,
and every *global* page id (what the scheduler, the page tables and the radix tree deal
in, unchanged) may carry one *window* page id::

    global page g  ──table[g]──>  window page w   (or -1: the window layers' KV of g's
                                                   tokens was released: a tombstone)

    window pool states:   free            on the window allocator's free list
                          in use          mapped from a request's private global page, or
                                          from a tree page inside the last window of a
                                          locked node (wref[g] > 0)
                          evictable       mapped from a tree page no lock's window reaches
    free + evictable + in use == num_window_pages           (check_invariants)

The runner patches a device copy of ``table`` with the entries that changed (``take_writes``)
and derives the window layers' page table and KV slots from the global ones through it, so
nothing above the memory layer keeps a second page list. Unmapped entries point at the
window pool's scratch page; no attention path reads them (each reads only the pages some
row's window reaches).

:class:`WindowedPageAllocator` is the global allocator of such a model: every page it hands
out comes with a fresh window page (a new page is written by the step that gets it), and
every page it takes back gives its window page back too, so no path that frees global
pages (finish, eviction, reset, duplicates) can leak a window page.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.memory.allocator import OutOfPagesError, PageAllocator

__all__ = ["WindowPages", "WindowedPageAllocator", "first_window_page"]


def first_window_page(next_pos: int, window: int, page_size: int) -> int:
    """The first page a row at ``next_pos`` (or later) can still see through its window:
    pages before it hold only keys at positions ``< next_pos - window + 1``."""
    return max(0, next_pos - window + 1) // page_size


class WindowPages:
    """The global-page -> window-page map, the window allocator and the window references.

    ``wref[g]``: locked nodes whose last window reaches global page ``g`` (kept by the
    sliding-window cache's ``lock``/``unlock``); ``in_tree[g]``: ``g`` is a tree page.
    ``num_evictable``: mapped tree pages with ``wref == 0`` (exact, O(1)).
    """

    def __init__(self, num_pages: int, num_window_pages: int, window: int, page_size: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.page_size = page_size
        self.allocator = PageAllocator(num_window_pages)
        self.num_global_pages = num_pages
        self.table = [-1] * num_pages
        self.wref = [0] * num_pages
        self.in_tree = bytearray(num_pages)
        self.num_evictable = 0
        # Window pages released by running requests whose window passed them (monotonic).
        self.released_pages = 0
        # Device map entries changed since the last take_writes (global page -> window page).
        self._writes: dict[int, int] = {}
        # Window pages released while a step in flight may still read them, tagged with the
        # newest step launched then (KVReferences frees them once that step is resolved).
        self.deferred: list[tuple[int, list[int]]] = []

    @property
    def num_window_pages(self) -> int:
        return self.allocator.num_pages

    def window_span(self, depth: int) -> tuple[int, int]:
        """Page indices ``[lo, hi)`` of a path of ``depth`` tokens (page-aligned) that its next
        row sees: the window a lock on that path's node keeps."""
        return first_window_page(depth, self.window, self.page_size), depth // self.page_size

    def can_alloc(self, n: int) -> bool:
        return n <= self.allocator.num_free + self.num_evictable

    def map_new(self, pages: list[int]) -> None:
        """Give each of ``pages`` (fresh global pages) a window page, evicting tombstones first
        if the window pool is short. Raises OutOfPagesError (mapping nothing) if it cannot."""
        n = len(pages)
        if n > self.allocator.num_free + self.num_evictable:
            raise OutOfPagesError(n, self.allocator.num_free, self.num_evictable)
        wins = self.allocator.alloc(n)
        table, writes = self.table, self._writes
        for g, w in zip(pages, wins):
            table[g] = w
            writes[g] = w

    def unmap(self, g: int) -> int:
        """Forget ``g``'s window page (the caller frees it); returns it (-1: none)."""
        w = self.table[g]
        if w >= 0:
            self.table[g] = -1
            self._writes[g] = -1
        return w

    def move(self, src: int, dst: int) -> None:
        """Hand ``src``'s window page to ``dst`` (which has none)."""
        w = self.unmap(src)
        self.table[dst] = w
        self._writes[dst] = w

    def on_global_free(self, pages: Iterable[int]) -> None:
        """Global ``pages`` go back to the free list: their window pages go too."""
        freed = []
        for g in pages:
            if self.wref[g]:
                raise AssertionError(f"global page {g} freed while a lock's window reaches it")
            tree = self.in_tree[g]
            self.in_tree[g] = 0
            w = self.unmap(g)
            if w >= 0:
                freed.append(w)
                if tree:
                    self.num_evictable -= 1
        if freed:
            self.allocator.free(freed)

    def release_private(self, pages: Iterable[int], in_flight_step: int | None) -> int:
        """Release the window pages of a request's private ``pages`` that its window has
        passed (their global pages stay). ``in_flight_step``: the newest step launched while
        one is in flight (it may still read them: they wait until it is resolved); None: free
        now. Returns how many were released."""
        out = []
        for g in pages:
            w = self.unmap(g)
            if w >= 0:
                out.append(w)
        if not out:
            return 0
        self.released_pages += len(out)
        if in_flight_step is not None:
            self.deferred.append((in_flight_step, out))
        else:
            self.allocator.free(out)
        return len(out)

    def free_deferred(self, resolved: int) -> None:
        """Free what waited for steps up to ``resolved``."""
        keep = []
        for step, pages in self.deferred:
            if step > resolved:
                keep.append((step, pages))
            else:
                self.allocator.free(pages)
        self.deferred = keep

    def deferred_pages(self) -> list[int]:
        return [w for _, pages in self.deferred for w in pages]

    def take_writes(self) -> tuple[list[int], list[int]]:
        """The map entries changed since the last call, as (global pages, window pages or -1)."""
        if not self._writes:
            return [], []
        g, w = list(self._writes), list(self._writes.values())
        self._writes = {}
        return g, w

    def reset(self) -> None:
        """Every window page free (the caller guarantees nothing holds a global page)."""
        self.allocator.reset()
        n = self.num_global_pages
        self._writes.update({g: -1 for g in range(n) if self.table[g] >= 0})
        self.table = [-1] * n
        self.wref = [0] * n
        self.in_tree = bytearray(n)
        self.num_evictable = 0
        self.deferred = []

    def __repr__(self) -> str:
        return (
            f"WindowPages(window={self.window}, pages={self.num_window_pages}, "
            f"free={self.allocator.num_free}, evictable={self.num_evictable})"
        )


class WindowedPageAllocator(PageAllocator):
    """The global page allocator of a sliding-window model (see the module docstring)."""

    def __init__(self, num_pages: int, window: WindowPages) -> None:
        super().__init__(num_pages)
        self.window = window

    def can_alloc(self, n: int) -> bool:
        return super().can_alloc(n) and self.window.can_alloc(n)

    def alloc(self, n: int) -> list[int]:
        pages = super().alloc(n)  # may evict global pages, which frees their window pages too
        try:
            self.window.map_new(pages)
        except OutOfPagesError:
            super().free(pages)
            raise
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        super().free(pages)  # validates first: a double free raises before any window change
        self.window.on_global_free(pages)

    def reset(self) -> None:
        super().reset()
        self.window.reset()
