"""The router's approximate radix tree of what each worker caches (one per worker).

A :class:`PrefixTrie` records the token prefixes the router *sent* to a worker, LRU-capped
like the worker's own evictor, and which of them the worker has already computed: a prefix
is *in flight* from the moment its first request is sent until that request's first token
comes back (its prefill is done, so the worker's radix cache holds it). A request whose
prefix is in flight on a worker should follow it there: anywhere else it is computed twice.

Torch-free and process-free: unit-tested directly.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from radixserve.prefix import common_prefix_len


def namespace_token(namespace: str) -> int:
    """The sentinel that roots ``namespace``'s prefixes in a :class:`PrefixTrie`: negative
    (no token id is), and 63 bits of a digest, so that tenants' subtrees never merge."""
    digest = hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


class TrieMatch(NamedTuple):
    """The longest stored prefix of a prompt: ``tokens`` long; ``in_flight`` when the worker
    has not computed it yet (every request that carries it there is still before its first
    token)."""

    tokens: int
    in_flight: bool


class _Node:
    __slots__ = ("key", "children", "parent", "last_access", "pending", "ready")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, now: int) -> None:
        self.key = key  # the edge label from the parent
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = now
        self.pending = 0  # requests through this node sent and not yet prefilled
        self.ready = False  # some request through this node was prefilled: the worker has it


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
        self.root.ready = True
        self.num_tokens = 0

    def match(self, tokens: Sequence[int], touch: bool = True) -> int:
        """Length of the longest stored prefix of ``tokens``; ``touch`` refreshes its access time."""
        return self.lookup(tokens, touch).tokens

    def lookup(self, tokens: Sequence[int], touch: bool = False) -> TrieMatch:
        """The longest stored prefix of ``tokens`` and whether it is still in flight."""
        tokens = tuple(tokens)
        now = next(self._clock)
        node, pos, last = self.root, 0, self.root
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens, pos)
            if touch:
                child.last_access = now
            pos, last = pos + k, child
            if k < len(child.key):
                break
            node = child
        # ``last`` holds the match's last token; its ancestors were prefilled whenever it was.
        return TrieMatch(pos, pos > 0 and not last.ready and last.pending > 0)

    def pending_len(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of ``tokens`` that some request not yet prefilled
        carries to this worker (whether or not the tree thinks it was computed before: with
        KV events the router knows better what the worker still holds)."""
        tokens = tuple(tokens)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or not child.pending:
                break
            k = common_prefix_len(child.key, tokens, pos)
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], pending: bool = False) -> None:
        """Record ``tokens`` as sent; ``pending``: as the prefix of a request not yet prefilled
        (until :meth:`prefilled` or :meth:`abandon`), else as computed. Evicts least recently
        used leaves beyond the cap."""
        tokens = tuple(tokens[: self.max_tokens])
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = _Node(tokens[pos:], node, now)
                node.children[tokens[pos]] = child
                self.num_tokens += len(child.key)
            k = common_prefix_len(child.key, tokens, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            if pending:
                child.pending += 1
            else:
                child.ready = True
            node, pos = child, pos + k
        if self.num_tokens > self.max_tokens:
            self._evict(self.max_tokens * 9 // 10)

    def prefilled(self, tokens: Sequence[int]) -> None:
        """A request inserted as pending with ``tokens`` was prefilled: the worker has them."""
        for node in self._path(tokens):
            node.pending = max(0, node.pending - 1)
            node.ready = True

    def abandon(self, tokens: Sequence[int]) -> None:
        """A request inserted as pending with ``tokens`` ended before it was prefilled."""
        for node in self._path(tokens):
            node.pending = max(0, node.pending - 1)

    def _path(self, tokens: Sequence[int]) -> list[_Node]:
        """The nodes that spell a prefix of ``tokens`` edge by edge (insert split them so)."""
        tokens = tuple(tokens[: self.max_tokens])
        out: list[_Node] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or tokens[pos : pos + len(child.key)] != child.key:
                break  # evicted or flushed meanwhile
            out.append(child)
            node, pos = child, pos + len(child.key)
        return out

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after ``k`` tokens; return the new middle node."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[:k], parent, child.last_access)
        mid.pending, mid.ready = child.pending, child.ready  # every path through child crosses mid
        parent.children[child.key[0]] = mid
        child.key = child.key[k:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def _evict(self, target: int) -> None:
        """Drop LRU leaves until at most ``target`` tokens remain (amortized: runs rarely).
        Prefixes in flight stay: their requests will report them prefilled."""
        leaves = [
            (n.last_access, id(n), n)
            for n in self._nodes()
            if not n.children and n is not self.root and not n.pending
        ]
        heapq.heapify(leaves)
        while self.num_tokens > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and not parent.pending:
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
        self.root.ready = True
        self.num_tokens = 0
