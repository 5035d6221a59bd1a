"""Session leases: an agent's context stays cached through its pauses between turns.

An agent sends a turn, waits for a tool (seconds), then sends the same history plus the
tool's result. Under plain LRU the traffic that passes during the pause pushes its pages
out and the next turn recomputes the whole history. A lease keeps the path of a session's
last turn (prompt + answer) cached across the pause::

    turn ends ──> grant(session, node) ──> path root..node leased (lease_ref > 0)
                                              │  evicted only after every unleased page
    next turn admitted <───── pause ──────────┤  (a leased leaf sits in a second index)
      (gap observed)                          ├─ expiry: now > granted + ttl(session)
                                              ├─ yield: memory pressure, oldest lease first,
                                              │  then the largest: its tail pages go, only
                                              │  as many as needed, and the lease holds the
                                              │  rest (with L2, the pages are demoted there)
                                              └─ release: the session closes

A lease is not a lock: leased pages stay evictable, so a running request never fails to
allocate because of one; the cache's evictor takes every unleased leaf first and only then
takes pages from the tail of the oldest lease's path (:meth:`LeaseTable.oldest`), only as
many as it needs, the lease keeping what is left. Releasing the whole lease instead would
doom it: its pages would be the oldest unleased ones, so the traffic that caused the pressure
would take all of them before the session returned. A lease whose last node another request
holds (locked, extended, or leased too) is released whole (:meth:`LeaseTable.yield_one`).

The lease's length is learned per session: a high quantile of that session's own observed
pauses (gap between the end of one turn and the admission of the next), times a margin,
within ``[min_s, cap_s]``. A session that has not paused yet (its first lease) gets the same
quantile of every session's recent pauses (the server's agents tend to call the same tools),
or ``default_s`` while no session has returned; such a lease is re-judged when it runs out,
so one granted before any pause was seen lasts as long as the pauses seen since say.

A request without a session key joins one when its prompt extends an earlier request's
prompt + answer: every finished unkeyed turn marks the chained page hash of its path's end
(its pages may be evicted since: the mark is a hash, not a node), and a later prompt whose
page hashes pass through a mark adopts that turn's session (a chat re-sending its history).

Sessions are keyed by ``(namespace, session_id)``: a tenant's sessions lease only its own
namespace's paths and never collide with another tenant's ids.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from radixserve.memory.eviction.shadow import page_keys
from radixserve.memory.interfaces import LeasableCache
from radixserve.memory.tree_node import TreeNode

__all__ = ["Lease", "LeaseConfig", "LeaseCounters", "LeaseTable", "SessionKey"]

SessionKey = tuple[Hashable | None, str]  # (namespace, session id)


@dataclass(frozen=True)
class LeaseConfig:
    """How long leases last. ``enabled`` False: no leases (the cache is plain LRU)."""

    enabled: bool = True
    default_s: float = 60.0  # a first lease while no session has paused yet
    min_s: float = 1.0
    cap_s: float = 600.0
    quantile: float = 0.9  # of the session's observed pauses
    margin: float = 1.5  # the lease outlasts that quantile by this factor
    history: int = 32  # pauses remembered per session
    prior_history: int = 256  # every session's latest pauses: a first lease's length
    prior_min: int = 1  # pauses seen before they replace default_s for first leases
    max_sessions: int = 65536  # sessions remembered (least recently active forgotten)
    max_turn_marks: int = 4096  # finished unkeyed turns remembered for adoption


@dataclass
class LeaseCounters:
    """Monotonic counters (/metrics)."""

    granted: int = 0
    hits: int = 0  # a session's turn admitted while its lease held
    expired: int = 0
    yielded: int = 0  # released early under memory pressure
    trimmed_pages: int = 0  # leased pages taken from a lease's tail under memory pressure
    released: int = 0  # the session closed
    adopted: int = 0  # unkeyed turns found to continue an earlier request (auto sessions)
    lost_tokens: int = 0  # tokens a returning turn recomputed that its lost lease had held


class Lease:
    """One session's hold on the path root..``node``."""

    __slots__ = ("session", "node", "granted_at", "expires_at", "pages", "seq", "alive")

    def __init__(
        self, session: SessionKey, node: TreeNode, now: float, ttl: float, pages: int, seq: int
    ) -> None:
        self.session = session
        self.node = node
        self.granted_at = now
        self.expires_at = now + ttl
        self.pages = pages
        self.seq = seq
        self.alive = True

    @property
    def tokens(self) -> int:
        return self.node.depth

    def __repr__(self) -> str:
        return (
            f"Lease({self.session!r}, tokens={self.node.depth}, granted={self.granted_at:.3f}, "
            f"expires={self.expires_at:.3f}, alive={self.alive})"
        )


class _Session:
    __slots__ = ("gaps", "last_end", "lease", "last_tokens", "lost")

    def __init__(self, history: int) -> None:
        self.gaps: deque[float] = deque(maxlen=history)
        self.last_end: float | None = None
        self.lease: Lease | None = None
        self.last_tokens = 0  # tokens of the path its last lease covered
        self.lost: str | None = None  # "expired" / "yielded" when its last lease went early


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (nearest rank, rounding up) of a non-empty sequence."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class LeaseTable:
    """The session leases of one cache (``cache`` None: a cache that caches nothing; every
    call is a no-op). ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(
        self,
        cache: LeasableCache | None,
        config: LeaseConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.config = config or LeaseConfig()
        self.clock = clock
        self.counters = LeaseCounters()
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self._by_expiry: list[tuple[float, int, Lease]] = []
        self._by_age: list[tuple[float, int, int, Lease]] = []  # yield order
        self._live = 0
        self._seq = 0
        self._turn_marks: OrderedDict[int, str] = OrderedDict()  # path-end page hash -> session
        self._auto = 0
        self._prior: deque[float] = deque(maxlen=self.config.prior_history)  # all sessions'

    @property
    def enabled(self) -> bool:
        return self.cache is not None and self.config.enabled

    def __len__(self) -> int:
        return self._live

    # ------------------------------------------------------------------ sessions
    def _session(self, key: SessionKey) -> _Session:
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = _Session(self.config.history)
            while len(self._sessions) > self.config.max_sessions:
                _, old = self._sessions.popitem(last=False)
                if old.lease is not None:
                    self._drop(old.lease)
        else:
            self._sessions.move_to_end(key)
        return s

    def ttl(self, session: str, namespace: Hashable | None = None) -> float:
        """How long ``session``'s next lease lasts, learned from its own pauses."""
        cfg = self.config
        s = self._sessions.get((namespace, session))
        gaps: Iterable[float] | None = s.gaps if s is not None and s.gaps else None
        if gaps is None and len(self._prior) >= cfg.prior_min:
            gaps = self._prior  # a first lease: what every session's pauses say
        if gaps is None:
            return min(cfg.cap_s, max(cfg.min_s, cfg.default_s))
        return min(cfg.cap_s, max(cfg.min_s, quantile(gaps, cfg.quantile) * cfg.margin))

    def lease_of(self, session: str, namespace: Hashable | None = None) -> Lease | None:
        s = self._sessions.get((namespace, session))
        return None if s is None else s.lease

    def lost(self, session: str, namespace: Hashable | None = None) -> tuple[str, int] | None:
        """How ``session``'s last lease ended early (``"expired"`` / ``"yielded"``) and the
        tokens it covered, until its next turn is admitted; None when it did not."""
        s = self._sessions.get((namespace, session))
        if s is None or s.lost is None:
            return None
        return s.lost, s.last_tokens

    def adopt(self, prompt: Sequence[int], namespace: Hashable | None = None) -> str | None:
        """The session of the latest earlier turn whose whole-page path (prompt + answer)
        ``prompt`` extends, if any: a chat re-sending its history. O(len(prompt))."""
        if not self.enabled or not self._turn_marks:
            return None
        assert self.cache is not None
        for key in reversed(page_keys(prompt, namespace, self.cache.page_size)):
            sid = self._turn_marks.get(key)
            if sid is not None:
                self.counters.adopted += 1
                return sid
        return None

    def turn_admitted(
        self,
        session: str,
        namespace: Hashable | None,
        prompt_len: int,
        cached_tokens: int,
    ) -> None:
        """A session's turn was admitted with ``cached_tokens`` of its prompt cached: learn
        the pause since its last turn; count a lease hit, or what its lost lease would have
        saved."""
        if not self.enabled:
            return
        now = self.clock()
        s = self._session((namespace, session))
        if s.last_end is not None:
            s.gaps.append(max(0.0, now - s.last_end))
            self._prior.append(s.gaps[-1])
        if s.lease is not None:
            self.counters.hits += 1
        elif s.lost is not None:
            self.counters.lost_tokens += max(0, min(s.last_tokens, prompt_len) - cached_tokens)
        s.lost = None

    def turn_ended(self, session: str | None, namespace: Hashable | None, node: TreeNode) -> None:
        """A turn finished (stop / tool call / length) with its prompt + answer cached up to
        ``node`` (locked by it still): lease that path to ``session`` (replacing its last
        lease), or, without a session, remember ``node`` so that a continuation adopts it."""
        if not self.enabled or node.parent is None:
            return
        assert self.cache is not None
        if session is None:
            self._auto += 1
            path: list[tuple[int, ...]] = []
            n: TreeNode | None = node
            while n is not None and n.parent is not None:
                path.append(n.key)
                n = n.parent
            tokens = [t for key in reversed(path) for t in key]
            mark = page_keys(tokens, namespace, self.cache.page_size)[-1]
            marks = self._turn_marks
            marks[mark] = f"auto-{self._auto}"
            marks.move_to_end(mark)
            while len(marks) > self.config.max_turn_marks:
                marks.popitem(last=False)
            return
        key = (namespace, session)
        ttl = self.ttl(session, namespace)
        s = self._session(key)
        if s.lease is not None:
            self._drop(s.lease)
        self.cache.add_lease(node)
        self._seq += 1
        lease = Lease(key, node, self.clock(), ttl, node.depth // self.cache.page_size, self._seq)
        s.lease, s.last_end, s.last_tokens, s.lost = lease, lease.granted_at, node.depth, None
        self._live += 1
        self.counters.granted += 1
        heapq.heappush(self._by_expiry, (lease.expires_at, lease.seq, lease))
        heapq.heappush(self._by_age, (lease.granted_at, -lease.pages, lease.seq, lease))

    def release(self, session: str, namespace: Hashable | None = None) -> bool:
        """The session closed: drop its lease and forget it. Returns whether it held one."""
        s = self._sessions.pop((namespace, session), None)
        if s is None or s.lease is None:
            return False
        self._drop(s.lease)
        self.counters.released += 1
        return True

    # ------------------------------------------------------------------ ending leases
    def expire(self, now: float | None = None) -> int:
        """Drop the leases whose time is up (their pages stay cached, unleased). O(log n) each."""
        if not self._live:
            return 0
        now = self.clock() if now is None else now
        heap, n = self._by_expiry, 0
        while heap and (not heap[0][2].alive or heap[0][0] <= now):
            _, _, lease = heapq.heappop(heap)
            if lease.alive and not self._extended(lease, now):
                self._lose(lease, "expired")
                self.counters.expired += 1
                n += 1
        return n

    def _extended(self, lease: Lease, now: float) -> bool:
        """A first lease (its session has not paused yet) whose time is up is re-judged by
        the pauses seen since it was granted: kept, with its new expiry, if they say longer."""
        s = self._sessions.get(lease.session)
        if s is None or s.gaps:
            return False
        expires = lease.granted_at + self.ttl(lease.session[1], lease.session[0])
        if expires <= now:
            return False
        lease.expires_at = expires
        heapq.heappush(self._by_expiry, (expires, lease.seq, lease))
        return True

    def oldest(self) -> Lease | None:
        """The lease that yields first (the oldest; ties: the largest), left in place."""
        heap = self._by_age
        while heap and not heap[0][3].alive:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def trimmed(self, lease: Lease, pages: int, node: TreeNode | None) -> None:
        """Memory pressure took ``pages`` pages from ``lease``'s tail; ``node``: the last node
        of what it still holds (its old one, shorter, or that one's parent), None when nothing
        is left, which ends it as a yield."""
        self.counters.trimmed_pages += pages
        if node is not None and node.parent is not None:
            lease.node = node
            return
        lease.alive = False  # no path left: nothing to drop in the cache
        self._live -= 1
        self.counters.yielded += 1
        s = self._sessions.get(lease.session)
        if s is not None and s.lease is lease:
            s.lease, s.lost = None, "yielded"

    def yield_one(self) -> bool:
        """Memory pressure and nothing unleased is left to evict: release the oldest lease
        (ties: the largest). Returns False when no lease is left."""
        heap = self._by_age
        while heap:
            lease = heapq.heappop(heap)[3]
            if lease.alive:
                self._lose(lease, "yielded")
                self.counters.yielded += 1
                return True
        return False

    def clear(self) -> None:
        """Drop every lease (a cache reset); sessions keep their learned pauses."""
        for s in self._sessions.values():
            if s.lease is not None:
                self._drop(s.lease)
        self._by_expiry.clear()
        self._by_age.clear()
        self._turn_marks.clear()

    def _lose(self, lease: Lease, why: str) -> None:
        s = self._sessions.get(lease.session)
        self._drop(lease)
        if s is not None:
            s.lost = why

    def _drop(self, lease: Lease) -> None:
        lease.alive = False
        self._live -= 1
        s = self._sessions.get(lease.session)
        if s is not None and s.lease is lease:
            s.lease = None
        assert self.cache is not None
        self.cache.drop_lease(lease.node)
        if len(self._by_expiry) > 2 * self._live + 1024:  # stale entries: rebuild (amortized)
            self._by_expiry = [e for e in self._by_expiry if e[2].alive]
            heapq.heapify(self._by_expiry)
        if len(self._by_age) > 2 * self._live + 1024:
            self._by_age = [e for e in self._by_age if e[3].alive]
            heapq.heapify(self._by_age)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, nodes: Iterable[TreeNode]) -> None:
        """Every live lease is on a live node and every node's ``lease_ref`` counts exactly
        the live leases through it (O(tree + leases x depth); tests call it often)."""
        want: dict[TreeNode, int] = {}
        live = 0
        for s in self._sessions.values():
            lease = s.lease
            if lease is None:
                continue
            live += 1
            if not lease.alive or not lease.node.alive:
                raise AssertionError(f"lease invariant broken: dead lease or node {lease!r}")
            n: TreeNode | None = lease.node
            while n is not None and n.parent is not None:
                want[n] = want.get(n, 0) + 1
                n = n.parent
        if live != self._live:
            raise AssertionError(f"lease invariant broken: {self._live} counted, {live} live")
        for node in nodes:
            if node.lease_ref != want.get(node, 0):
                raise AssertionError(
                    f"lease invariant broken: lease_ref {node.lease_ref} != "
                    f"{want.get(node, 0)} leases through {node!r}"
                )
