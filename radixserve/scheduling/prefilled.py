"""The decode side of prefill/decode disaggregation: pages reserved for a prompt another engine
computes, and the request admitted as already prefilled once its KV has landed.

::

    reserve(req)     match the prompt in this cache (the held prefix, page-aligned), lock it,
                     allocate pages for the rest of the prompt, take a page-table row
                         pages: | held (tree, locked) | to fill (private) ...... |
                                0              held_len                   prompt_len
    (the prefill engine writes the KV of [held_len, prompt_len) into "to fill")
    admit(rid, tok)  the request joins the running set with its whole prompt computed
                     (``computed_len = prompt_len``: no prompt token runs here) and ``tok``,
                     the prefill engine's first token, as its first output
    cancel(rid)      unlock and free everything: only once the prefill side said it will not
                     write (it answered, or it is gone), since a write may still be landing

A reservation holds what a running request holds (one lock, private pages, one row), so
the page accounting (:meth:`Scheduler.check_invariants`) counts its pages as private.
"""

from __future__ import annotations

from typing import NamedTuple

from radixserve.memory import PageAllocator, PrefixCache
from radixserve.scheduling.plan import PageTableRows
from radixserve.scheduling.request import FUTURE_TOKEN, Request, RequestStatus

__all__ = ["Reservation", "Reservations"]


class Reservation(NamedTuple):
    """A request waiting for its prompt's KV: the pages to fill and how much it already held."""

    request: Request
    fill_pages: list[int]  # pages for tokens [held_len, prompt_len), in order
    held_len: int  # leading prompt tokens this cache already held (page-aligned)


class Reservations:
    """Requests whose prompt another engine is computing, by request id."""

    def __init__(
        self, cache: PrefixCache, allocator: PageAllocator, rows: PageTableRows, page_size: int
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.rows = rows
        self.page_size = page_size
        self._held: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def get(self, request_id: str) -> Reservation:
        """``request_id``'s reservation (``KeyError`` when it holds none)."""
        return self._held[request_id]

    def reserve(self, req: Request) -> Reservation | None:
        """Lock ``req``'s cached prefix and allocate the rest of its prompt's pages; None when
        there is no free row or not enough pages (the caller tries later or elsewhere).

        With the hierarchical cache the match itself copies the prefix's L2/L3 part into fresh
        L1 pages before it returns, so ``held_len`` counts only pages in L1, locked here before
        the allocation that may evict; what could not be loaded is left to the prefill side."""
        if req.request_id in self._held:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if self.rows.num_free_rows == 0:
            return None
        ps = self.page_size
        match = self.cache.match_prefix(req.token_ids[: req.prompt_len], req.namespace)
        self.cache.lock(match.node)  # before allocating: allocation may evict
        need = -(-req.prompt_len // ps) - len(match.pages)
        if need > self.allocator.num_free + self.cache.num_evictable_pages:
            self.cache.unlock(match.node)
            return None
        fill = self.allocator.alloc(need)
        req.lock_node, req.pages = match.node, match.pages + fill
        req.cached_len = req.computed_len = match.matched_len
        req.loaded_pages, req.page_size_hint = self.cache.take_loaded(match.node), ps
        req.slot = self.rows.acquire()
        res = Reservation(req, fill, match.matched_len)
        self._held[req.request_id] = res
        return res

    def admit(self, request_id: str) -> Request:
        """The prompt's KV is in place: ``request_id`` leaves the reservations RUNNING, its
        prompt computed, with a placeholder for its first token (the scheduler fills it with
        the prefill engine's, through its stop checks). ``KeyError`` for an unknown id."""
        res = self._held.pop(request_id)
        req = res.request
        req.computed_len = req.prompt_len
        req.cached_tokens = res.held_len
        req.status = RequestStatus.RUNNING
        self.rows.set_row(req.slot, req.pages)
        req.token_ids.append(FUTURE_TOKEN)
        return req

    def cancel(self, request_id: str) -> bool:
        """Give back what ``request_id`` reserved; False when it holds nothing."""
        res = self._held.pop(request_id, None)
        if res is None:
            return False
        req = res.request
        assert req.lock_node is not None
        self.cache.unlock(req.lock_node)
        self.allocator.free(res.fill_pages)
        self.rows.release(req.slot)
        req.pages, req.lock_node, req.slot = [], None, -1
        req.cached_len = req.computed_len = 0
        return True

    def pages(self) -> list[int]:
        """Pages reserved outside the tree (the accounting counts them as private)."""
        return [p for res in self._held.values() for p in res.fill_pages]
