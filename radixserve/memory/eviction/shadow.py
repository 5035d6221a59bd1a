"""Regret of each eviction policy, measured on shadow caches; ``adaptive`` follows the least.

Every admitted request's prompt becomes a stream of page keys (a chained hash per whole
page, namespace first, so equal keys mean equal prefixes). Each candidate policy runs a
:class:`ShadowCache` over that stream: a flat cache of the real pool's size, ordered by the
policy's key, plus a bounded ghost list of the keys it evicted and when (ARC's idea, one
ghost list per candidate instead of ARC's two)::

    request: k1 k2 k3 k4 k5          shadow "lfu": k1 k2 resident, k3 k4 k5 missing
                                     k3 in its ghost list, evicted 4 s ago (< T)
                                     -> regret += 1 page: recomputed because lfu evicted it

Regret is tokens recomputed within ``horizon_s`` of their eviction. Over a sliding window
of the last ``window`` requests :class:`RegretTracker` picks the candidate with the least
regret; it switches only to a strictly better one (ties keep the current policy), so after
the stream changes it follows within at most ``window`` requests, usually far fewer. The
decision depends only on the key stream, the priorities and the clock: replaying the same
stream offline gives the same choices.

Pages of a request are touched suffix first, so within one request a prefix is always
"newer" than its continuation and a shadow never keeps a suffix whose prefix it dropped
(the tree's own constraint). Cost per request: O(pages x candidates x log pool).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixserve.memory.eviction.policies import CANDIDATES, item_key

__all__ = ["RegretTracker", "ShadowCache", "page_keys"]


def page_keys(tokens: Sequence[int], namespace: Hashable | None, page_size: int) -> list[int]:
    """A chained hash per whole page of ``tokens`` (stable within a process)."""
    h = hash(("radixserve-ns", namespace))
    out: list[int] = []
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hash((h, tuple(tokens[i : i + page_size])))
        out.append(h)
    return out


class ShadowCache:
    """A flat cache of ``capacity`` page keys ordered by ``policy``, with its ghost list."""

    def __init__(self, policy: str, capacity: int, ghosts: int, horizon_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"shadow capacity must be >= 1 page, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self.max_ghosts = ghosts
        self.horizon_s = horizon_s
        self.items: dict[int, list[int]] = {}  # key -> [last access, hits, priority]
        self.ghosts: OrderedDict[int, float] = OrderedDict()  # evicted key -> when
        self._heap: list[tuple[Any, int]] = []
        self._tick = 0

    def _key(self, k: int) -> Any:
        last, hits, prio = self.items[k]
        return item_key(self.policy, last, hits, prio)

    def access(self, keys: Sequence[int], priority: int, now: float) -> tuple[int, int]:
        """One request's pages. Returns (pages hit: the resident prefix, pages of regret)."""
        items = self.items
        hit = 0
        while hit < len(keys) and keys[hit] in items:
            hit += 1
        regret = 0
        for k in keys[hit:]:
            t = self.ghosts.get(k)
            if t is not None and now - t <= self.horizon_s:
                regret += 1
        for k in reversed(keys):  # suffix first: the prefix ends up the newest
            self._tick += 1
            st = items.get(k)
            if st is None:
                items[k] = [self._tick, 1, priority]
                self.ghosts.pop(k, None)
                heapq.heappush(self._heap, (self._key(k), k))
            else:
                st[0] = self._tick
                st[1] += 1
                st[2] = max(st[2], priority)
        self._evict(now)
        return hit, regret

    def flush(self) -> None:
        """Empty, with no ghosts: a flush evicts nothing by this policy's order."""
        self.items.clear()
        self.ghosts.clear()
        self._heap = []

    def _evict(self, now: float) -> None:
        items, heap = self.items, self._heap
        while len(items) > self.capacity:
            stored, k = heap[0]
            if k not in items:
                heapq.heappop(heap)
                continue
            cur = self._key(k)
            if stored != cur:
                heapq.heapreplace(heap, (cur, k))
                continue
            heapq.heappop(heap)
            del items[k]
            self.ghosts[k] = now
            self.ghosts.move_to_end(k)
            if len(self.ghosts) > self.max_ghosts:
                self.ghosts.popitem(last=False)
        if len(heap) > 2 * len(items) + 1024:
            self._heap = [(self._key(k), k) for k in items]
            heapq.heapify(self._heap)


class RegretTracker:
    """Shadow caches of ``candidates`` on one key stream; the least-regret choice."""

    def __init__(
        self,
        capacity: int,
        page_size: int,
        candidates: Sequence[str] = CANDIDATES,
        window: int = 32,
        horizon_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        initial: str = "lru",
    ) -> None:
        self.page_size = page_size
        self.window = window
        self.clock = clock
        self.shadows = {c: ShadowCache(c, capacity, capacity, horizon_s) for c in candidates}
        self.regret_tokens = dict.fromkeys(candidates, 0)  # monotonic, per policy
        self.hit_tokens = dict.fromkeys(candidates, 0)
        self._recent: dict[str, deque[int]] = {c: deque(maxlen=window) for c in candidates}
        self._sums = dict.fromkeys(candidates, 0)
        self.current = initial if initial in self.shadows else candidates[0]
        self.switches = 0
        self.requests = 0

    def flush(self) -> None:
        """The real cache was flushed: every shadow empties, its ghosts too, so nothing
        that returns afterwards counts as any policy's regret."""
        for shadow in self.shadows.values():
            shadow.flush()

    def window_regret(self) -> dict[str, int]:
        """Each policy's regret (tokens) over the last ``window`` requests."""
        return dict(self._sums)

    def observe(
        self, tokens: Sequence[int], namespace: Hashable | None = None, priority: int = 0
    ) -> str:
        """One admitted request's prompt; returns the policy to follow from now on."""
        keys = page_keys(tokens, namespace, self.page_size)
        now = self.clock()
        ps = self.page_size
        for name, shadow in self.shadows.items():
            hit, regret = shadow.access(keys, priority, now)
            self.hit_tokens[name] += hit * ps
            self.regret_tokens[name] += regret * ps
            recent = self._recent[name]
            if len(recent) == recent.maxlen:
                self._sums[name] -= recent[0]
            recent.append(regret * ps)
            self._sums[name] += regret * ps
        self.requests += 1
        best = min(self.shadows, key=lambda c: self._sums[c])  # first listed wins ties
        if self._sums[best] < self._sums[self.current]:
            self.current = best
            self.switches += 1
        return self.current


def replay(
    stream: Sequence[tuple[Sequence[int], Hashable | None, int, float]],
    capacity: int,
    page_size: int,
    window: int = 32,
    horizon_s: float = 120.0,
) -> list[str]:
    """Offline: the choice after each ``(tokens, namespace, priority, time)`` of a stream."""
    t = [0.0]
    tracker = RegretTracker(
        capacity, page_size, window=window, horizon_s=horizon_s, clock=lambda: t[0]
    )
    out = []
    for tokens, ns, prio, now in stream:
        t[0] = now
        out.append(tracker.observe(tokens, ns, prio))
    return out
