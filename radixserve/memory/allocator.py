"""Page allocator: a free list over the KV pool's page ids.

Pages are plain ``int`` ids in ``[0, num_pages)``; the engine turns page lists into tensors
(page tables, slot indices) once per batch, so the allocator never touches torch.

When an allocation does not fit, the allocator asks its *evictor* (the radix cache registers
itself) to free the shortfall first, and raises :class:`OutOfPagesError` only when free plus
evictable pages are truly not enough. If it can tell up front that eviction cannot help
(the evictor reports how many pages are evictable), it raises without evicting anything, so
a failed allocation never throws away cached prefixes for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class OutOfPagesError(RuntimeError):
    """Not enough KV pages, even after evicting every unreferenced cached page.

    Attributes:
        needed: pages the allocation asked for.
        free: free pages when the allocation started.
        evictable: pages the cache could evict (or did evict) at that time.
    """

    def __init__(self, needed: int, free: int, evictable: int) -> None:
        self.needed = needed
        self.free = free
        self.evictable = evictable
        super().__init__(
            f"out of KV pages: needed {needed}, free {free}, evictable {evictable} "
            f"(short by {needed - free - evictable})"
        )

    def __reduce__(self):  # keep the typed fields across pickling (worker -> router)
        return (type(self), (self.needed, self.free, self.evictable))


class PageAllocator:
    """Free-list allocator of KV page ids.

    ``alloc`` hands out the most recently freed pages first (LIFO), which keeps the working
    set of pages small and warm in caches. Double frees and foreign page ids raise
    ``ValueError`` at once: a page in two places would corrupt another request's KV silently.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self._num_pages = num_pages
        # Kept reversed so that the end of the list (cheap to slice off) holds page 0 first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # One flag per page. (A set of free ids looks natural but never shrinks its table:
        # with the pool full, set operations against it scan a huge empty table.)
        self._is_free = bytearray(b"\x01") * num_pages
        self._evictor: Callable[[int], int] | None = None
        self._num_evictable: Callable[[], int] | None = None

    @property
    def num_pages(self) -> int:
        """Total pages in the pool."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list right now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages not on the free list (cached in the tree or held privately by requests)."""
        return self._num_pages - len(self._free)

    def set_evictor(
        self, fn: Callable[[int], int] | None, num_evictable: Callable[[], int] | None = None
    ) -> None:
        """Register ``fn(n_pages) -> freed`` to call when an allocation is short.

        ``num_evictable() -> int``, when given, lets ``alloc`` refuse up front (without
        evicting) an allocation that eviction could not satisfy anyway.
        """
        self._evictor = fn
        self._num_evictable = num_evictable

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed (counting evictable pages)."""
        evictable = self._num_evictable() if self._num_evictable is not None else 0
        return n <= len(self._free) + evictable

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages off the free list, evicting cached pages first if short.

        Raises:
            OutOfPagesError: free + evictable < n. Nothing is allocated then.
        """
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate {n} pages")
            return []
        free = len(self._free)
        if n > free:
            short = n - free
            if self._num_evictable is not None:
                evictable = self._num_evictable()
                if evictable < short:
                    raise OutOfPagesError(n, free, evictable)
            evicted = self._evictor(short) if self._evictor is not None else 0
            if len(self._free) < n:
                raise OutOfPagesError(n, free, evicted)
        pages = self._free[-n:]
        del self._free[-n:]
        flags = self._is_free
        for p in pages:
            flags[p] = 0
        pages.reverse()
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list.

        Raises:
            ValueError: a page is out of range, listed twice, or already free.
        """
        pages = list(pages)
        if not pages:
            return
        if min(pages) < 0 or max(pages) >= self._num_pages:
            raise ValueError(f"page id out of range [0, {self._num_pages}): {pages[:8]}")
        flags = self._is_free
        for i, p in enumerate(pages):
            if flags[p]:  # already free, or listed twice in `pages`
                for q in pages[:i]:
                    flags[q] = 0
                raise ValueError(f"double free of KV page {p}")
            flags[p] = 1
        self._free.extend(reversed(pages))

    def free_pages(self) -> frozenset[int]:
        """A snapshot of the free pages (for invariant checks and tests, O(num_free))."""
        return frozenset(self._free)

    def reset(self) -> None:
        """Mark every page free (the caller guarantees nothing holds a page any more)."""
        self._free = list(range(self._num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self._num_pages

    def check_invariants(self) -> None:
        """Free list and free flags agree, no duplicates, all ids in range."""
        if self._free and (min(self._free) < 0 or max(self._free) >= self._num_pages):
            raise AssertionError("allocator free list holds an out-of-range page id")
        flagged = [p for p, f in enumerate(self._is_free) if f]
        if len(set(self._free)) != len(self._free) or sorted(self._free) != flagged:
            raise AssertionError("allocator free list has duplicates or disagrees with its flags")

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, free={len(self._free)})"
