"""Pages and tree locks given up while a step is in flight, released once it has finished.

With overlap scheduling a request can finish (or be aborted, or have its duplicate pages
swapped for the tree's) while a launched step still reads its pages. Those releases wait
here, tagged with the newest step launched at the time; when the scheduler resolves that
step, everything tagged with it (or earlier) is unlocked and freed.
"""

from __future__ import annotations

from radixserve.memory import PageAllocator, PrefixCache, TreeNode

__all__ = ["DeferredReleases"]


class DeferredReleases:
    """(step, pages to free, node to unlock) entries, released in step order."""

    def __init__(self, allocator: PageAllocator, cache: PrefixCache) -> None:
        self.allocator = allocator
        self.cache = cache
        self._entries: list[tuple[int, list[int], TreeNode | None]] = []

    def add(self, step: int, pages: list[int], node: TreeNode | None = None) -> None:
        """Release ``pages`` (and unlock ``node``) once step ``step`` has been resolved."""
        self._entries.append((step, list(pages), node))

    def release(self, resolved: int) -> None:
        """Release every entry whose step is at most ``resolved``."""
        keep = []
        for entry in self._entries:
            step, pages, node = entry
            if step > resolved:
                keep.append(entry)
                continue
            if node is not None:
                self.cache.unlock(node)
            if pages:
                self.allocator.free(pages)
        self._entries = keep

    def pages(self) -> list[int]:
        """Every page waiting (held, for the invariant checks)."""
        return [p for _, pages, _ in self._entries for p in pages]
