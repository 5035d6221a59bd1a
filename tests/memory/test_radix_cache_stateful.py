"""Hypothesis state machine: simulated requests drive the pool, allocator and radix cache.

Several requests at once match, lock, allocate, write KV, cache their prefixes after
"chunks", finish or abort, while raw inserts, bare matches and evictions happen between
them. Every request writes its token ids into the KV slots of its pages (a tiny KVPool with
one layer, one head, head_dim 1); after every step the machine checks the cache's full
invariants, that lock holders match, and that every page a request holds (and every page
in the tree) still contains the tokens it stands for.

With lower tiers (half the examples): an L2 host pool (a few pages, often smaller than L1)
and sometimes an L3 directory. Evictions demote, matches load back, and extra rules evict
L2, corrupt or truncate page files, and restart the whole cache over the same directory.
After every step the L2 accounting is checked and every L2 page must hold the tokens of the
prefix its key names; a rule reads every L3 file back the same way. A loaded page that held
anything else would fail the data checks of the requests and matches that use it.

Session leases ride along: a finished request leases its path to its session (or marks it
for adoption when it has none), the clock runs leases out, sessions close; eviction must
take every unleased page before any leased one, and pages still always add up. Each
example draws an eviction policy (lru, lfu, slru, priority, adaptive, which re-keys the
leaf indexes when it switches); the LRU-order check applies to lru.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.memory import (
    KVPool,
    NoPrefixCache,
    OutOfPagesError,
    PageAllocator,
    RadixCache,
    TreeNode,
)
from radixserve.memory.eviction.control import mark_priority
from radixserve.memory.eviction.shadow import page_keys
from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy
from radixserve.memory.leases import LeaseConfig

# Prompts share prefixes: three of them start alike, one is different.
BASES = [
    list(range(10, 30)),
    list(range(10, 18)) + list(range(40, 52)),
    list(range(10, 14)) + [60] * 16,
    list(range(70, 90)),
]
NAMESPACES = st.sampled_from([None, None, None, "t1"])
TAILS = st.lists(st.integers(0, 3), max_size=6)
MAX_REQUESTS = 5
SESSIONS = st.sampled_from([None, "s1", "s2", "s3"])


@dataclass
class Req:
    prompt: list[int]
    ns: str | None
    tokens: list[int]  # tokens whose KV is written, in order
    pages: list[int]  # one page per page_size tokens of `tokens`
    node: TreeNode  # the node this request holds locked
    session: str | None = None


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        num_pages=st.integers(8, 40),
        disabled=st.sampled_from([False, False, False, True]),
        tiers=st.sampled_from(["L1", "L1", "L2", "L3"]),
        host_pages=st.integers(1, 24),
        policy=st.sampled_from(["lru", "lru", "lfu", "slru", "priority", "adaptive"]),
    )
    def setup(
        self,
        page_size: int,
        num_pages: int,
        disabled: bool,
        tiers: str,
        host_pages: int,
        policy: str,
    ) -> None:
        self.policy = policy
        self.ps = page_size
        self.num_pages = num_pages
        self.host_pages = host_pages
        self.disabled = disabled
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.key_tokens: dict[bytes, list[int]] = {}  # every page key seen -> its page's tokens
        self.now = 0.0  # the pin table's clock
        self.storage: str | None = (
            tempfile.mkdtemp(prefix="rs-l3-") if tiers == "L3" and not disabled else None
        )
        self.tiered = tiers != "L1" and not disabled
        self._build(disabled)

    def _build(self, disabled: bool = False) -> None:
        """A fresh pool, allocator and cache (over the same L3 directory, if any)."""
        self.alloc = PageAllocator(self.num_pages)
        self.pool = KVPool(1, self.num_pages, self.ps, 1, 1)
        self.flat = self.pool.k_data[0].view(-1)
        self.cache: RadixCache | NoPrefixCache
        if self.tiered:
            self.hier = KVHierarchy(self.pool, self.host_pages, self.storage, "test-model")
            self.cache = HiRadixCache(self.alloc, self.ps, self.hier)
        elif disabled:
            self.cache = NoPrefixCache(self.alloc, self.ps)
        else:
            self.cache = RadixCache(self.alloc, self.ps)
        self.cache.pins.budget_pages = self.num_pages // 2
        self.cache.pins.clock = lambda: self.now
        self.cache.leases.clock = lambda: self.now
        self.cache.leases.config = LeaseConfig(default_s=2.0, min_s=0.5, cap_s=6.0)
        self.cache.eviction.clock = lambda: self.now
        self.cache.eviction.set_policy(self.policy, window=4)
        if self.cache.misses is not None:
            self.cache.misses.clock = lambda: self.now
            self.cache.misses.max_records = 16  # small: the bound is exercised

    def teardown(self) -> None:
        if getattr(self, "storage", None):
            shutil.rmtree(self.storage, ignore_errors=True)

    # ------------------------------------------------------------ helpers
    def _write(self, pages: list[int], start: int, tokens: list[int]) -> None:
        slots = [
            pages[i // self.ps] * self.ps + i % self.ps for i in range(start, start + len(tokens))
        ]
        self.flat[torch.tensor(slots, dtype=torch.long)] = torch.tensor(tokens, dtype=torch.float32)

    def _read(self, pages: list[int], n: int) -> list[int]:
        slots = [pages[i // self.ps] * self.ps + i % self.ps for i in range(n)]
        return [int(x) for x in self.flat[torch.tensor(slots, dtype=torch.long)].tolist()]

    def _register(self, tokens: list[int], ns: str | None) -> None:
        """Remember which tokens each page key stands for (to check L2/L3 contents)."""
        if self.tiered:
            for i, k in enumerate(self.hier.hasher.keys(tokens, ns)):
                self.key_tokens[k] = tokens[i * self.ps : (i + 1) * self.ps]

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    def _grow(self, req: Req, new_tokens: list[int]) -> bool:
        need = -(-(len(req.tokens) + len(new_tokens)) // self.ps) - len(req.pages)
        free, evictable, cached = (
            self.alloc.num_free,
            self.cache.num_evictable_pages,
            self.cache.num_cached_pages,
        )
        try:
            got = self.alloc.alloc(need)
        except OutOfPagesError as e:
            assert need > free + evictable and (e.needed, e.free, e.evictable) == (
                need,
                free,
                evictable,
            )
            assert (
                self.alloc.num_free == free and self.cache.num_cached_pages == cached
            )  # nothing evicted
            return False
        assert need <= free + evictable
        req.pages += got
        self._write(req.pages, len(req.tokens), new_tokens)
        req.tokens += new_tokens
        return True

    def _cache(self, req: Req) -> None:
        old_pages, held = list(req.pages), req.node.depth // self.ps
        n_full = len(req.tokens) // self.ps
        self._register(req.tokens, req.ns)
        c = self.cache.cache_prefix(req.tokens, req.pages, req.node, req.ns)
        assert c.pages[:held] == old_pages[:held]  # what it already held is unchanged
        assert c.pages[n_full:] == old_pages[n_full:]  # the partial page stays private
        if self.disabled:
            assert c.cached_len == 0 and c.pages == old_pages
        else:
            assert c.cached_len == n_full * self.ps == c.node.depth
        req.pages, req.node = c.pages, c.node

    # ------------------------------------------------------------ rules
    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(0, 20),
        tail=TAILS,
        ns=NAMESPACES,
        session=SESSIONS,
    )
    def new_request(
        self, base: int, cut: int, tail: list[int], ns: str | None, session: str | None
    ) -> None:
        prompt = BASES[base][:cut] + tail
        if not prompt:
            prompt = [1]
        m = self.cache.match_prefix(prompt[:-1], ns)
        assert m.matched_len % self.ps == 0 and len(m.pages) * self.ps == m.matched_len
        assert m.node.depth == m.matched_len
        self.cache.lock(m.node)
        if session is None:
            session = self.cache.leases.adopt(prompt, ns)
        if session is not None:
            self.cache.leases.turn_admitted(session, ns, len(prompt), m.matched_len)
        self.cache.eviction.observe(prompt, ns, base)  # adaptive may switch (re-key) here
        if base and not m.node.is_root:
            mark_priority(m.node, base)
        self.reqs[self.next_rid] = Req(
            prompt, ns, prompt[: m.matched_len], list(m.pages), m.node, session
        )
        self.next_rid += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(1, 9))
    def extend(self, data: st.DataObject, k: int) -> None:
        """A prefill chunk (rest of the prompt) or decode steps (generated tokens)."""
        req = self.reqs[self._pick(data)]
        rest = req.prompt[len(req.tokens) : len(req.tokens) + k]
        new = rest if rest else data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=k))
        self._grow(req, new)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_chunk(self, data: st.DataObject) -> None:
        self._cache(self.reqs[self._pick(data)])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data: st.DataObject, cache_it: bool) -> None:
        """Normal finish caches the sequence; abort/retract just lets go."""
        req = self.reqs.pop(self._pick(data))
        if cache_it:
            self._cache(req)
            self.cache.leases.turn_ended(req.session, req.ns, req.node)
        self.cache.unlock(req.node)
        self.alloc.free(req.pages[req.node.depth // self.ps :])

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 20), tail=TAILS, ns=NAMESPACES)
    def bare_match(self, base: int, cut: int, tail: list[int], ns: str | None) -> None:
        query = BASES[base][:cut] + tail
        m = self.cache.match_prefix(query, ns)
        assert m.matched_len == len(m.pages) * self.ps <= len(query)
        assert self._read(m.pages, m.matched_len) == query[: m.matched_len]

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 20), tail=TAILS, ns=NAMESPACES)
    def explain_miss(self, base: int, cut: int, tail: list[int], ns: str | None) -> None:
        """A miss report agrees with the tree: it matched what a peek matches, and the
        divergence lies in the first page the tree does not hold."""
        if self.cache.misses is None:
            return
        query = BASES[base][:cut] + tail
        d = self.cache.misses.explain(query, ns)
        assert d.cached_tokens == self.cache.peek_prefix_len(query, ns)
        if d.at is None:
            assert d.cached_tokens == len(query) // self.ps * self.ps
        else:
            assert d.cached_tokens <= d.at < d.cached_tokens + self.ps
            assert d.after == query[d.at : d.at + 4]
        assert len(self.cache.misses) <= 16

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 20), tail=TAILS, ns=NAMESPACES)
    def raw_insert(self, base: int, cut: int, tail: list[int], ns: str | None) -> None:
        tokens = BASES[base][:cut] + tail
        try:
            pages = self.alloc.alloc(-(-len(tokens) // self.ps))
        except OutOfPagesError:
            return
        self._write(pages, 0, tokens)
        self._register(tokens, ns)
        before = self.cache.peek_prefix_len(tokens, ns)
        cached = self.cache.insert(tokens, pages, ns)
        assert cached == (0 if self.disabled else before)
        self.alloc.free(pages[: cached // self.ps] + pages[len(tokens) // self.ps :])

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable = self.cache.num_evictable_pages
        nodes = self._nodes()
        sizes = {node: len(node.pages) for node in nodes}
        leaves_before = set() if self.disabled else set(self.cache._lru)
        unleased = sum(len(x.pages) for x in nodes if x.lock_ref == 0 and x.lease_ref == 0)
        yielded = self.cache.leases.counters.yielded
        assert self.cache.evict(n) == min(n, evictable)
        if (
            self.cache.leases.counters.yielded > yielded
        ):  # leases yield only once nothing else is left
            assert n > unleased
        if n <= unleased:  # and every leased page is still there
            assert all(x.alive for x in nodes if x.lease_ref > 0)
        # LRU: everything evicted (or trimmed) is older than every untouched evictable leaf.
        touched = [(x.last_access, x.id) for x in nodes if not x.alive or len(x.pages) != sizes[x]]
        kept = [
            (x.last_access, x.id) for x in leaves_before if x.alive and len(x.pages) == sizes[x]
        ]
        if touched and kept and self.policy == "lru":
            assert max(touched) < min(kept)

    @rule(
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(0, 20),
        ns=NAMESPACES,
        ttl=st.floats(0.5, 5.0),
    )
    def pin(self, base: int, cut: int, ns: str | None, ttl: float) -> None:
        tokens = BASES[base][:cut]
        pinned = self.cache.pins.pin(tokens, ns, ttl)
        assert pinned % self.ps == 0 and pinned <= len(tokens) and not (self.disabled and pinned)

    @rule(dt=st.floats(0.0, 3.0))
    def advance_clock(self, dt: float) -> None:
        self.now += dt
        self.cache.pins.expire()
        self.cache.leases.expire()
        for r in {"s1", "s2", "s3"}:
            for ns in (None, "t1"):
                lease = self.cache.leases.lease_of(r, ns)
                assert lease is None or lease.expires_at > self.now
        assert all(
            self.cache.pins.expiry(n) > self.now
            for n in self._nodes()
            if self.cache.pins.expiry(n) is not None
        )

    @rule(session=SESSIONS, ns=NAMESPACES)
    def close_session(self, session: str | None, ns: str | None) -> None:
        if session is not None:
            self.cache.leases.release(session, ns)
            assert self.cache.leases.lease_of(session, ns) is None

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll != 9:  # flushing the cache is rare in real runs; keep trees deep here too
            return
        if any(not r.node.is_root for r in self.reqs.values()):
            try:
                self.cache.reset()
            except RuntimeError:
                return
            raise AssertionError("reset() with locked pages did not raise")
        self.cache.reset()
        assert self.cache.num_cached_pages == 0

    # ------------------------------------------------------------ lower tiers
    @precondition(lambda self: self.tiered)
    @rule(n=st.integers(1, 8))
    def evict_l2(self, n: int) -> None:
        host = self.hier.host
        cached, writes = host.num_cached, self.hier.stats.l3_written_pages
        assert host.evict(n) == min(n, cached)
        if self.hier.l3_enabled:  # spilled pages land in L3 (unless a file was there already)
            assert self.hier.stats.l3_written_pages - writes <= min(n, cached)

    @precondition(lambda self: self.storage is not None)
    @rule(pick=st.integers(0, 1000), truncate=st.booleans())
    def corrupt_file(self, pick: int, truncate: bool) -> None:
        files = sorted(Path(self.storage).rglob("*.kv"))
        if not files:
            return
        f = files[pick % len(files)]
        data = bytearray(f.read_bytes())
        if not data:  # already truncated to nothing
            return
        if truncate:
            data = data[: pick % len(data)]
        else:
            data[pick % len(data)] ^= 0xFF
        f.write_bytes(bytes(data))

    @precondition(lambda self: self.storage is not None)
    @rule()
    def read_back_l3(self) -> None:
        disk = self.hier.disk
        assert disk is not None
        like = [t[:, 0] for t in self.hier.host.pool.page_tensors()]
        for f in sorted(Path(self.storage).rglob("*.kv")):
            key = bytes.fromhex(f.stem)
            rows = disk.read(key, like)
            if rows is not None:  # None: a corrupted file, rejected (and removed)
                assert [int(x) for x in rows[0].reshape(-1).tolist()] == self.key_tokens[key]

    @precondition(lambda self: self.storage is not None and not self.reqs)
    @rule(persist=st.booleans())
    def restart(self, persist: bool) -> None:
        """Shut down (writing L1 and L2 to disk, or crashing without) and start over the same L3."""
        assert isinstance(self.cache, HiRadixCache)
        if persist:
            self.cache.persist()
        self._build()
        assert self.cache.num_cached_pages == 0 and self.hier.host.num_cached == 0

    def _nodes(self) -> list[TreeNode]:
        if self.disabled:  # NoPrefixCache: no tree
            return []
        out, stack = [], list(self.cache._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                out.append(node)
        return out

    # ------------------------------------------------------------ invariants
    @invariant()
    def accounting_and_data(self) -> None:
        if not hasattr(self, "cache"):
            return
        private: list[int] = []
        holders: dict[int, int] = {}
        for req in self.reqs.values():
            assert len(req.pages) == -(-len(req.tokens) // self.ps)
            private += req.pages[req.node.depth // self.ps :]
            if not req.node.is_root:
                assert req.node.alive
                holders[id(req.node)] = holders.get(id(req.node), 0) + 1
            assert self._read(req.pages, len(req.tokens)) == req.tokens
        self.cache.check_invariants(private_pages=private)
        # Lock holders are exactly the simulated requests; tree pages hold their own tokens.
        for node in self._nodes():  # requests' locks, plus one per pin
            pinned = self.cache.pins.expiry(node) is not None
            assert node.holders == holders.pop(id(node), 0) + pinned
            assert self._read(node.pages, len(node.key)) == list(node.key)
        assert not holders
        for node in self._nodes():  # a kept path key names the path's tokens (splits, trims)
            if node.path_hash is not None:
                path, n = [], node
                while not n.is_root:
                    path[:0] = list(n.key)
                    n = n.parent
                assert node.path_hash == page_keys(path, n.namespace, self.ps)[-1]
        if self.tiered:  # every L2 page holds the tokens of the prefix its key names
            host = self.hier.host
            data = host.pool.k_data[0].view(-1)
            for key in host.keys():
                slot = host.slot(key)
                assert slot is not None
                got = [int(x) for x in data[slot * self.ps : (slot + 1) * self.ps].tolist()]
                assert got == self.key_tokens[key]


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheMachine = CacheMachine.TestCase
