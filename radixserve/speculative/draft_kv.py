"""The draft model's KV pages: which request holds which, in the draft's own radix cache.

The draft model has its own layers, heads and head size, so its K and V cannot live in the
target's pool tensors (shaped by the target's dims): it gets a pool of its own, with its own
:class:`~radixserve.memory.allocator.PageAllocator` and
:class:`~radixserve.memory.radix_cache.RadixCache` keyed by the same namespaces (tenant
salts) as the target's, so one tenant's draft KV is never matched by another's prompt. The
page invariants are the target's: free + evictable + held = num_pages.

One request's draft sequence (host lists only; the drafter runs the forwards)::

    tokens:  | cached (tree pages, locked) | computed, private pages | (room for this step) |
             0                    cached_len                 len(tokens)
    pages:   one per page_size tokens of ``tokens``, exactly

``tokens`` are the tokens whose draft KV is computed: the request's real tokens, then the
drafts fed back to draft the next ones. At the next draft (:meth:`DraftKV.rollback`) the
drafts the target rejected are dropped (their pages freed; slots of a kept page are
overwritten before anything reads them). The tree receives only real tokens: the prompt
once the draft computed it, and the real tokens when the request leaves
(:meth:`DraftKV.release`), as the target's cache does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.radix_cache import RadixCache
from radixserve.memory.tree_node import TreeNode

__all__ = ["DraftKV", "DraftSeq"]


@dataclass
class DraftSeq:
    """One request's draft KV (see the module docstring)."""

    namespace: Hashable | None
    tokens: list[int]
    pages: list[int]
    node: TreeNode  # locked: protects the first ``cached_len`` tokens' tree pages
    cached_len: int
    real_len: int  # leading ``tokens`` known real (not drafts) at the last draft


class DraftKV:
    """Draft-model pages of the requests that draft, over their own allocator and tree."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size)
        self.seqs: dict[str, DraftSeq] = {}

    def open(self, request_id: str, namespace: Hashable | None, context: list[int]) -> DraftSeq:
        """The request's sequence, opened on the longest cached prefix of ``context`` (all but
        its last token: that one is always fed, its logits draft the first token)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            return seq
        match = self.cache.match_prefix(context[:-1], namespace)
        self.cache.lock(match.node)
        seq = DraftSeq(
            namespace,
            list(context[: match.matched_len]),
            list(match.pages),
            match.node,
            match.matched_len,
            match.matched_len,
        )
        self.seqs[request_id] = seq
        return seq

    def rollback(self, seq: DraftSeq, context: list[int]) -> None:
        """Drop the tokens of ``seq`` after its longest prefix that agrees with ``context``
        (the drafts the target rejected); free the pages they alone used."""
        # The tree's part stays (it holds real tokens only); the drafts after the real ones
        # are compared with what the target kept.
        n = max(seq.cached_len, min(seq.real_len, len(context)))
        top = min(len(seq.tokens), len(context))
        while n < top and seq.tokens[n] == context[n]:
            n += 1
        del seq.tokens[n:]
        seq.real_len = n
        self._trim(seq)

    def reserve(self, seq: DraftSeq, n: int) -> bool:
        """Pages for ``n`` more tokens of ``seq`` (evicting cached draft pages if short);
        False when the pool cannot give them (the request drafts nothing this step)."""
        need = -(-(len(seq.tokens) + n) // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if not self.allocator.can_alloc(need):
            return False
        seq.pages += self.allocator.alloc(need)
        return True

    def slots(self, seq: DraftSeq, start: int, n: int) -> list[int]:
        """KV slots of positions ``start .. start + n - 1`` (pages reserved)."""
        ps = self.page_size
        return [seq.pages[p // ps] * ps + p % ps for p in range(start, start + n)]

    def computed(self, seq: DraftSeq, tokens: list[int], real: bool) -> None:
        """``tokens`` were fed (their KV written at the next positions, in reserved pages);
        ``real``: they are the request's own tokens (their whole pages go into the tree at
        once, for other requests to share)."""
        seq.tokens += tokens
        if real:
            seq.real_len = len(seq.tokens)
            self.cache_prefix(seq)

    def cache_prefix(self, seq: DraftSeq) -> None:
        """Insert ``seq``'s real whole pages into the tree; re-point its lock."""
        real = seq.tokens[: seq.real_len]
        res = self.cache.cache_prefix(real, seq.pages, seq.node, seq.namespace)
        seq.pages, seq.node, seq.cached_len = res.pages, res.node, res.cached_len

    def release(self, request_id: str, context: list[int]) -> None:
        """The request left: its draft KV of real tokens (those of ``context``) is cached,
        everything else freed, its lock dropped."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        self.rollback(seq, context)
        self.cache_prefix(seq)
        self.cache.unlock(seq.node)
        self.allocator.free(seq.pages[seq.cached_len // self.page_size :])

    def _trim(self, seq: DraftSeq) -> None:
        keep = -(-len(seq.tokens) // self.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def private_pages(self) -> list[int]:
        ps = self.page_size
        return [p for s in self.seqs.values() for p in s.pages[s.cached_len // ps :]]

    def check_invariants(self, live: Iterable[str] | None = None) -> None:
        """Every draft page accounted for once; each sequence's pages cover its tokens
        exactly; with ``live``, only those requests hold draft KV."""
        ps = self.page_size
        for rid, s in self.seqs.items():
            assert len(s.pages) == -(-len(s.tokens) // ps), f"draft pages != tokens: {rid}"
            assert s.node.depth == s.cached_len <= s.real_len <= len(s.tokens), rid
            assert s.cached_len % ps == 0, rid
        if live is not None:
            stale = set(self.seqs) - set(live)
            assert not stale, f"draft KV held for requests that left: {sorted(stale)}"
        self.cache.check_invariants(self.private_pages())
