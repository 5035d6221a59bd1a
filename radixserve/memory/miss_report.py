"""Every miss explained: where a prompt left the longest cached path, and why the rest of it
was not there.

A prompt is matched page by page; where it stops matching is its *divergence point*. The
report names that token (token-level, even inside a page), a few prompt tokens on each side,
what the cached path holds there instead (when one goes on with other tokens), and why the
prompt's own continuation is missing::

    prompt:  [sys prompt ........ "date: 12:04" ...... history ......]
    tree:    [sys prompt ........ "date: 12:03" ......]              <- cached path goes on
                                         ^ diverged_at: the first token that differs
    reason:  never_cached    this content was never in this namespace's tree
             evicted         it was, and the eviction policy (named) took it, s ago
             lease_expired   it was on this session's leased path; the lease ran out first
             lease_yielded   ... the lease yielded to memory pressure first
             other_namespace another namespace (tenant, cache salt) holds it
             flushed         it was, and a cache flush (``/flush_cache``, a reset) dropped it
             fully_cached    every whole page of the prompt is cached (only the tail computes)

Two costs, two scopes. The divergence *position* of every admitted prompt is counted
(:meth:`MissLog.locate`: the walk goes on from the node its match ended at, so it costs a
dict step and a look at that node's children, not a second match), so ``/metrics`` and
``radixserve cache-report`` show template drift server-wide. The *reason* (hashing the
prompt's pages, looking up eviction records and other namespaces) and the decoded context
go only to the requests that ask (:meth:`MissLog.explain`).

What makes this cheap and bounded:

- Evictions are recorded as the chained page key (:func:`~radixserve.memory.eviction.shadow.
  page_keys`, namespace first) of each page that leaves, with the policy and the time, in
  an LRU dict of at most ``max_records`` entries. A node's path key is kept on the node
  (``TreeNode.path_hash``), so a record costs O(pages evicted), never a walk to the root.
- A report walks the prompt once (the same dict steps as a match, nothing refreshed) and
  hashes its pages up to the divergence: O(prompt). Other namespaces are looked at only
  when nothing was evicted there, at most ``max_namespaces`` of them.
- A flush records every page it drops as ``flushed`` (no policy): a later miss on them
  says so, and no policy's regret is charged for them (the shadow caches flush too).
- The aggregate (:class:`MissStats`: reasons, a histogram of divergence positions, the top
  positions with their context) is bounded: fixed buckets, and top positions by
  Space-Saving over ``max_positions`` counters.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from itertools import islice
from typing import Any, NamedTuple, Protocol

from radixserve.memory.eviction.control import EvictionControl
from radixserve.memory.eviction.shadow import page_keys
from radixserve.memory.tree_node import TreeNode
from radixserve.prefix import common_prefix_len

__all__ = [
    "FLUSHED",
    "POSITION_BUCKETS",
    "REASONS",
    "Divergence",
    "MissLog",
    "MissStats",
    "Position",
]

REASONS = (
    "fully_cached",
    "never_cached",
    "evicted",
    "lease_expired",
    "lease_yielded",
    "other_namespace",
    "flushed",
)
FLUSHED = "flushed"  # the "policy" of a record left by a flush: no policy evicted it
# Upper bounds (tokens) of the divergence-position histogram's buckets; then +Inf.
POSITION_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class ExplainedCache(Protocol):
    """What the miss log reads of the radix cache: its tree roots, page size, the policy
    that evicts, and a peek that touches nothing."""

    page_size: int
    eviction: EvictionControl
    _roots: dict[Hashable | None, TreeNode]

    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int: ...


class Position(NamedTuple):
    """Where one prompt left the longest cached path, without the why (every request)."""

    cached_tokens: int  # page-aligned prompt tokens on the longest cached path
    at: int | None  # the first prompt token on no cached path (None: every whole page cached)
    before: list[int]
    after: list[int]
    cached_after: list[int]


class Divergence(NamedTuple):
    """Where one prompt left the longest cached path (``at`` None: it did not, every
    whole page is cached) and why (:data:`REASONS`)."""

    cached_tokens: int  # page-aligned prompt tokens on the longest cached path
    at: int | None  # the first prompt token on no cached path
    reason: str
    before: list[int]  # up to ``context`` prompt tokens before ``at``
    after: list[int]  # up to ``context`` prompt tokens from ``at`` on
    cached_after: list[int]  # what the cached path holds from ``at`` on, when it goes on
    policy: str | None = None  # evicted: the policy that took it
    evicted_s_ago: float | None = None


class _Top:
    __slots__ = ("count", "before", "after", "cached_after")

    def __init__(self, count: int, d: Position | Divergence) -> None:
        self.count = count
        self.before, self.after, self.cached_after = d.before, d.after, d.cached_after


class MissStats:
    """What the reports of one cache add up to (bounded; /metrics and ``cache-report``)."""

    def __init__(self, max_positions: int = 128) -> None:
        self.max_positions = max_positions
        self.reports = 0  # prompts explained (asked, or --cache-report)
        self.located = 0  # prompts whose divergence position was counted (every one)
        self.flushes = 0
        self.flushed_pages = 0
        self.reasons: Counter[str] = Counter()
        # Tokens the live cache recomputed within the horizon of evicting them, by the policy
        # that evicted them (every policy, not only adaptive's shadows): :meth:`MissLog.regret`.
        self.regret: Counter[str] = Counter()
        self.buckets = [0] * (len(POSITION_BUCKETS) + 1)
        self.position_sum = 0
        self._top: dict[int, _Top] = {}

    def add(self, d: Divergence) -> None:
        """One explained prompt: its reason (its position is counted by :meth:`position`)."""
        self.reports += 1
        self.reasons[d.reason] += 1

    def position(self, d: Position | Divergence) -> None:
        """One admitted prompt's divergence position (histogram and top positions)."""
        self.located += 1
        if d.at is None:
            return
        i = 0
        while i < len(POSITION_BUCKETS) and d.at > POSITION_BUCKETS[i]:
            i += 1
        self.buckets[i] += 1
        self.position_sum += d.at
        top = self._top
        entry = top.get(d.at)
        if entry is not None:
            entry.count += 1
            entry.before, entry.after, entry.cached_after = d.before, d.after, d.cached_after
        elif len(top) < self.max_positions:
            top[d.at] = _Top(1, d)
        else:  # Space-Saving: the newcomer takes the smallest counter's place and count + 1
            low = min(top, key=lambda k: top[k].count)
            top[d.at] = _Top(top.pop(low).count + 1, d)

    def top(self, n: int = 16) -> list[dict[str, Any]]:
        """The ``n`` most frequent divergence positions, with the latest context of each."""
        best = sorted(self._top.items(), key=lambda kv: (-kv[1].count, kv[0]))[:n]
        return [
            {
                "index": index,
                "count": e.count,
                "before": e.before,
                "after": e.after,
                "cached_after": e.cached_after,
            }
            for index, e in best
        ]

    def as_dict(self, n_top: int = 16) -> dict[str, Any]:
        """Engine-stats fields: counters, cumulative buckets (Prometheus ``le``), top positions."""
        cumulative, running = {}, 0
        for bound, count in zip([*map(str, POSITION_BUCKETS), "+Inf"], self.buckets):
            running += count
            cumulative[bound] = running
        return {
            "cache_reports_total": self.reports,
            "cache_divergence_prompts_total": self.located,
            "cache_flushes_total": self.flushes,
            "cache_flushed_pages_total": self.flushed_pages,
            "cache_miss_reasons": {r: self.reasons.get(r, 0) for r in REASONS},
            "cache_regret_tokens": dict(self.regret),
            "cache_divergence_buckets": cumulative,
            "cache_divergence_position_sum": self.position_sum,
            "cache_divergence_top": self.top(n_top),
        }


class MissLog:
    """The eviction records of one radix cache and the reports built on them.

    ``report_all``: every admitted request gets a report (``--cache-report``); otherwise only
    those that ask. ``max_records`` 0 records no evictions (reports then never say evicted).
    """

    def __init__(
        self,
        cache: ExplainedCache,
        max_records: int = 32768,
        context: int = 4,
        max_namespaces: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.max_records = max_records
        self.context = context
        self.max_namespaces = max_namespaces
        self.clock = clock
        self.report_all = False
        self.stats = MissStats()
        self._records: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    # ------------------------------------------------------------------ page keys
    def _end_key(self, node: TreeNode) -> int:
        """The chained page key at the end of ``node``'s edge (kept on the nodes it computes)."""
        ps = self.cache.page_size
        pending = []
        n = node
        while n.parent is not None and n.path_hash is None:
            pending.append(n)
            n = n.parent
        h = hash(("radixserve-ns", n.namespace)) if n.parent is None else n.path_hash
        assert h is not None
        for x in reversed(pending):
            key = x.key
            for i in range(0, len(key), ps):
                h = hash((h, key[i : i + ps]))
            x.path_hash = h
        return h

    def evicted(self, node: TreeNode, keep: int) -> None:
        """``node.pages[keep:]`` are about to leave the tree: remember each page's key."""
        if self.max_records <= 0 or node.parent is None:
            return
        ps = self.cache.page_size
        h = self._end_key(node.parent)
        key = node.key
        record = (self.cache.eviction.active, self.clock())
        records = self._records
        for i in range(0, len(key), ps):
            h = hash((h, key[i : i + ps]))
            if i // ps >= keep:
                records[h] = record
                records.move_to_end(h)
        while len(records) > self.max_records:
            records.popitem(last=False)

    def regret(
        self, tokens: Sequence[int], namespace: Hashable | None, node: TreeNode | None
    ) -> int:
        """The whole pages of ``tokens`` (a prompt) right after its match, which ended at
        ``node``, that this cache's policy evicted less than ``eviction.horizon_s`` ago:
        the request recomputes them, and they count as that policy's regret
        (``stats.regret``), whatever the policy (``adaptive``'s shadows measure the
        candidates; this measures the cache as it runs). A flush is no policy's regret.
        O(pages recomputed because evicted) hashes, one when the rest was not evicted."""
        if not self._records:
            return 0
        ps = self.cache.page_size
        if node is None or node.parent is None or not node.alive:
            start, h = 0, hash(("radixserve-ns", namespace))
        else:
            start, h = node.depth, self._end_key(node)
        now, horizon = self.clock(), self.cache.eviction.horizon_s
        total = 0
        for i in range(start, len(tokens) // ps * ps, ps):
            h = hash((h, tuple(tokens[i : i + ps])))
            record = self._records.get(h)
            if record is None or record[0] == FLUSHED or now - record[1] > horizon:
                break
            self.stats.regret[record[0]] += ps
            total += ps
        return total

    # ------------------------------------------------------------------ reports
    def _walk(
        self, key: tuple[int, ...], namespace: Hashable | None, start: TreeNode | None = None
    ) -> tuple[int, int | None, list[int]]:
        """(page-aligned tokens matched, first token on no cached path, what the cached path
        holds there). Touches nothing. ``start``: a live node known to be on ``key``'s path
        (the node its match ended at), where the walk goes on instead of at the root."""
        cache, ps, ctx = self.cache, self.cache.page_size, self.context
        pos, n = 0, len(key)
        node: TreeNode | None
        if start is not None and start.parent is not None and start.alive and start.depth <= n:
            node, pos = start, start.depth
        else:
            node = cache._roots.get(namespace)
        while node is not None and pos < n:
            child = node.children.get(key[pos] if ps == 1 else key[pos : pos + ps])
            if child is None:  # the nearest sibling: the one sharing most tokens, then newest
                best, best_m = None, -1
                for c in islice(node.children.values(), 64):
                    m = common_prefix_len(c.key, key, pos)
                    if (m, c.last_access) > (best_m, best.last_access if best else -1):
                        best, best_m = c, m
                if best is None:
                    return pos, pos, []
                return pos, pos + best_m, list(best.key[best_m : best_m + ctx])
            m = common_prefix_len(child.key, key, pos)
            if m >= len(child.key):
                pos += m
                node = child
                continue
            return pos + m - m % ps, pos + m, list(child.key[m : m + ctx])
        return pos, (None if pos >= n else pos), []

    def explain(
        self,
        tokens: Sequence[int],
        namespace: Hashable | None = None,
        lost_lease: tuple[str, int] | None = None,
    ) -> Divergence:
        """Where ``tokens`` (a prompt) leave the longest cached path of ``namespace`` and why.

        ``lost_lease``: (``"expired"`` | ``"yielded"``, tokens it covered) when the request's
        session lost its last lease early. O(len(tokens)); counts into :attr:`stats`."""
        ps = self.cache.page_size
        key = tuple(tokens[: len(tokens) // ps * ps])
        where = self._locate(tokens, key, namespace, None)
        cached, index = where.cached_tokens, where.at
        policy: str | None = None
        ago: float | None = None
        if index is None:
            reason = "fully_cached"
        else:
            page = page_keys(key[: cached + ps], namespace, ps)[-1]
            record = self._records.get(page)
            if record is not None and record[0] == FLUSHED:
                reason = FLUSHED
            elif record is not None:  # this very content was cached, then evicted
                lease = lost_lease is not None and cached < lost_lease[1]
                reason = f"lease_{lost_lease[0]}" if lost_lease and lease else "evicted"
            elif self._elsewhere(tokens, namespace, cached):
                reason = "other_namespace"
            else:
                reason = "never_cached"
            if record is not None:
                policy = None if record[0] == FLUSHED else record[0]
                ago = max(0.0, self.clock() - record[1])
        d = Divergence(*where[:2], reason, *where[2:], policy=policy, evicted_s_ago=ago)
        self.stats.add(d)
        return d

    def locate(
        self, tokens: Sequence[int], namespace: Hashable | None = None, node: TreeNode | None = None
    ) -> Position:
        """Where ``tokens`` leave the longest cached path, without the why: counted for every
        admitted prompt. ``node``: the node the prompt's match ended at (locked), so the walk
        starts there; O(page size x that node's children, at most 64) then, not O(prompt)."""
        ps = self.cache.page_size
        return self._locate(tokens, tuple(tokens[: len(tokens) // ps * ps]), namespace, node)

    def _locate(
        self,
        tokens: Sequence[int],
        key: tuple[int, ...],
        namespace: Hashable | None,
        node: TreeNode | None,
    ) -> Position:
        cached, index, cached_after = self._walk(key, namespace, node)
        ctx = self.context
        i = cached if index is None else index
        where = Position(
            cached,
            index,
            list(tokens[max(0, i - ctx) : i]),
            list(tokens[i : i + ctx]),
            cached_after,
        )
        self.stats.position(where)
        return where

    def _elsewhere(self, tokens: Sequence[int], namespace: Hashable | None, cached: int) -> bool:
        """Whether another namespace caches more of ``tokens`` than ``namespace`` does."""
        roots = self.cache._roots
        others = (ns for ns in roots if ns != namespace)
        return any(
            self.cache.peek_prefix_len(tokens, ns) > cached
            for ns in islice(others, self.max_namespaces)
        )

    def flushed(self) -> None:
        """The whole tree is about to be dropped (a flush): record each of its pages as
        ``flushed``, so a later miss on them says so rather than blaming a policy. O(pages),
        as the flush itself; the newest ``max_records`` records stay."""
        self.stats.flushes += 1
        ps = self.cache.page_size
        record = (FLUSHED, self.clock())
        records = self._records
        stack = [
            (child, hash(("radixserve-ns", ns)))
            for ns, root in self.cache._roots.items()
            for child in root.children.values()
        ]
        while stack:
            node, h = stack.pop()
            key = node.key
            for i in range(0, len(key), ps):
                h = hash((h, key[i : i + ps]))
                if self.max_records > 0:
                    records[h] = record
                    records.move_to_end(h)
            self.stats.flushed_pages += len(node.pages)
            stack.extend((c, h) for c in node.children.values())
        while len(records) > self.max_records:
            records.popitem(last=False)
