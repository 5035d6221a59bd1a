"""Cache-aware choice of a worker for each request.

The router cannot see the workers' radix caches, so it keeps, per worker, an approximate
radix tree of the token prefixes it has sent there (:class:`PrefixTrie`, capped in size by
LRU). A request goes to the worker whose tree holds its longest prefix, unless that worker
is loaded beyond a threshold compared to the least loaded one (then the least loaded wins);
a request whose best match is short goes to the least loaded worker (ties: the smallest
tree, i.e. the most room). A session id keeps one program's calls on one worker.

Torch-free and process-free: unit-tested directly.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from radixserve.prefix import common_prefix_len

RoutingPolicy = Literal["cache_aware", "round_robin", "least_loaded"]
ROUTING_POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "least_loaded")


def namespace_token(namespace: str) -> int:
    """The sentinel that roots ``namespace``'s prefixes in a :class:`PrefixTrie`: negative
    (no token id is), and 63 bits of a digest, so that tenants' subtrees never merge."""
    digest = hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, now: int) -> None:
        self.key = key  # the edge label from the parent
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = now


class PrefixTrie:
    """Radix tree over token ids with an LRU cap on the number of stored tokens.

    Approximate by design: it records what was *sent* to a worker, not what the worker
    still caches; the cap ages out old prefixes roughly like the worker's own evictor.
    """

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.root = _Node((), None, 0)
        self.num_tokens = 0

    def match(self, tokens: Sequence[int], touch: bool = True) -> int:
        """Length of the longest stored prefix of ``tokens``; ``touch`` refreshes its access time."""
        tokens = tuple(tokens)
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens, pos)
            if touch:
                child.last_access = now
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int]) -> None:
        """Record ``tokens`` as sent; evicts least recently used leaves beyond the cap."""
        tokens = tuple(tokens[: self.max_tokens])
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tokens[pos:], node, now)
                node.children[tokens[pos]] = leaf
                self.num_tokens += len(leaf.key)
                break
            k = common_prefix_len(child.key, tokens, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node, pos = child, pos + k
        if self.num_tokens > self.max_tokens:
            self._evict(self.max_tokens * 9 // 10)

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after ``k`` tokens; return the new middle node."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[:k], parent, child.last_access)
        parent.children[child.key[0]] = mid
        child.key = child.key[k:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def _evict(self, target: int) -> None:
        """Drop LRU leaves until at most ``target`` tokens remain (amortized: runs rarely)."""
        leaves = [
            (n.last_access, id(n), n)
            for n in self._nodes()
            if not n.children and n is not self.root
        ]
        heapq.heapify(leaves)
        while self.num_tokens > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def clear(self) -> None:
        """Forget everything (after a cache flush)."""
        self.root = _Node((), None, 0)
        self.num_tokens = 0


class Decision(NamedTuple):
    """Where a request goes and why (``reason``: cache, balance, session, round_robin, least_loaded)."""

    worker_id: int
    matched_tokens: int
    reason: str


class Dispatcher:
    """Chooses a worker per request under a routing policy.

    ``loads`` passed to :meth:`choose` are the router's in-flight counts per live worker.
    Cache-aware: the best-matching worker wins when its match covers at least
    ``cache_threshold`` of the prompt and ``min_match_tokens`` tokens, unless its load
    exceeds the minimum load by more than ``balance_abs_threshold`` and by a factor of
    ``balance_rel_threshold`` (then the least loaded wins).
    """

    def __init__(
        self,
        policy: RoutingPolicy = "cache_aware",
        *,
        cache_threshold: float = 0.5,
        min_match_tokens: int = 8,
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.5,
        trie_max_tokens: int = 1 << 20,
        max_sessions: int = 100_000,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; expected one of {ROUTING_POLICIES}"
            )
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.min_match_tokens = min_match_tokens
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trie_max_tokens = trie_max_tokens
        self.max_sessions = max_sessions
        self.tries: dict[int, PrefixTrie] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._rr = 0

    def add_worker(self, worker_id: int) -> None:
        self.tries.setdefault(worker_id, PrefixTrie(self.trie_max_tokens))

    def remove_worker(self, worker_id: int) -> None:
        """Forget a dead worker: its tree and the sessions pinned to it."""
        self.tries.pop(worker_id, None)
        for sid in [s for s, w in self._sessions.items() if w == worker_id]:
            del self._sessions[sid]

    def flush(self) -> None:
        """The workers' caches were flushed: forget every prefix."""
        for trie in self.tries.values():
            trie.clear()

    def choose(
        self,
        tokens: Sequence[int],
        loads: Mapping[int, int],
        session_id: str | None = None,
        namespace: str | None = None,
    ) -> Decision:
        """Pick a worker among ``loads``' keys (must be non-empty) and record the prefix there.

        A cache ``namespace`` (a tenant's, with its cache salt) shares nothing with other
        namespaces, so its prefixes are recorded under a negative sentinel token (never a
        real token id) of their own: each worker's trie holds one subtree per namespace."""
        if not loads:
            raise ValueError("no live worker")
        if namespace is not None:
            tokens = [namespace_token(namespace), *tokens]
        decision = self._choose(tokens, loads, session_id)
        self.add_worker(decision.worker_id)
        self.tries[decision.worker_id].insert(tokens)
        if namespace is not None:  # report prompt tokens only, not the sentinel
            decision = decision._replace(matched_tokens=max(0, decision.matched_tokens - 1))
        if session_id is not None:
            self._sessions[session_id] = decision.worker_id
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return decision

    def _choose(
        self, tokens: Sequence[int], loads: Mapping[int, int], session_id: str | None
    ) -> Decision:
        ids = sorted(loads)
        if session_id is not None and self._sessions.get(session_id) in loads:
            wid = self._sessions[session_id]
            return Decision(wid, self._match(wid, tokens), "session")
        if self.policy == "round_robin":
            wid = ids[self._rr % len(ids)]
            self._rr += 1
            return Decision(wid, self._match(wid, tokens), "round_robin")
        min_load = min(loads.values())
        if self.policy == "cache_aware":
            matches = {wid: self._match(wid, tokens) for wid in ids}
            best = max(ids, key=lambda w: (matches[w], -loads[w]))
            m = matches[best]
            if m >= self.min_match_tokens and m >= self.cache_threshold * len(tokens):
                load = loads[best]
                if (
                    load - min_load <= self.balance_abs_threshold
                    or load <= self.balance_rel_threshold * min_load
                ):
                    return Decision(best, m, "cache")
                reason = "balance"
            else:
                reason = "least_loaded"
        else:
            reason = "least_loaded"
        least = [w for w in ids if loads[w] == min_load]
        # Ties: the smallest tree has the most room; then rotate so equal workers share work.
        self._rr += 1
        wid = min(least, key=lambda w: (self._size(w), (w - self._rr) % (max(ids) + 1)))
        return Decision(wid, self._match(wid, tokens), reason)

    def _match(self, wid: int, tokens: Sequence[int]) -> int:
        trie = self.tries.get(wid)
        return trie.match(tokens, touch=False) if trie is not None else 0

    def _size(self, wid: int) -> int:
        trie = self.tries.get(wid)
        return trie.num_tokens if trie is not None else 0
