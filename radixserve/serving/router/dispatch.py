"""Cache-aware choice of a worker for each request.

The router cannot see the workers' radix caches, so it keeps, per worker, an approximate
radix tree of the token prefixes it has sent there (:class:`PrefixTrie`). Cache-aware
routing keeps a prefix group (the requests that share a system prompt, a few-shot block, a
chat history) on the worker that holds it:

* a request goes to the worker whose tree holds its longest prefix, when that covers at
  least ``cache_threshold`` of the prompt;
* unless the imbalance is real: that worker's outstanding work exceeds the least loaded
  worker's by more than ``balance_abs_threshold`` *and* by a factor of
  ``balance_rel_threshold`` (SGLang's router rule). Work is measured in prompt tokens:
  the prompt tokens sent and not yet prefilled (less what the tree says is cached) plus
  ``running_request_tokens`` per request in flight, so a few extra short requests do not
  count as much as the recomputation of a 1,000-token prefix on the other worker;
* and a request whose prefix is still *in flight* on that worker (sent with an earlier
  request that has not been prefilled yet) follows it whatever the load, since anywhere
  else it would be computed a second time;
* a new prefix group (no good match anywhere) goes to the least loaded worker (ties: the
  smallest tree, i.e. the most room), and stays there.

``balance_load="requests"`` measures load in requests in flight instead (SGLang's router
does; with its small thresholds a hot group's followers spill onto the other worker).
A session id keeps one program's calls on one worker.

``prefix_source`` says where the held prefixes come from: ``"tries"`` (above: what was sent,
approximate), or ``"events"``: the workers' own KV events (:mod:`~radixserve.serving.router.kv_index`),
which know of evictions, restarts, demotions to L2/L3 and flushes. With events a match counts
its L1 pages in full and its L2/L3 pages at a discount (they cost a load), the tries still
track the prefixes in flight, and a worker whose view is not synced (no snapshot yet, a
sequence gap, a worker that sends no events) is judged by its tree as before.

Torch-free and process-free: unit-tested directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from radixserve.serving.router.kv_index import WorkerKVView
from radixserve.serving.router.prefix_trie import PrefixTrie, TrieMatch, namespace_token

__all__ = [
    "BALANCE_LOADS",
    "BalanceLoad",
    "Decision",
    "Dispatcher",
    "Outstanding",
    "PREFIX_SOURCES",
    "PrefixSource",
    "PrefixTrie",
    "ROUTING_POLICIES",
    "RoutingPolicy",
    "namespace_token",
]

RoutingPolicy = Literal["cache_aware", "round_robin", "least_loaded"]
ROUTING_POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "least_loaded")
BalanceLoad = Literal["work", "requests"]
BALANCE_LOADS: tuple[str, ...] = ("work", "requests")
PrefixSource = Literal["tries", "events"]
PREFIX_SOURCES: tuple[str, ...] = ("tries", "events")

# Default ``balance_abs_threshold`` per load measure: in prompt tokens of outstanding work
# (two 1,000-token prefixes' worth), or in requests (SGLang's router default is 64).
DEFAULT_ABS_THRESHOLD: dict[str, float] = {"work": 2048.0, "requests": 32.0}


class Outstanding(NamedTuple):
    """A worker's outstanding work as the router sees it: requests in flight, and the prompt
    tokens of those not yet prefilled that the worker must compute (estimated at dispatch)."""

    requests: int
    prefill_tokens: int = 0


class _Held(NamedTuple):
    """What one worker holds of a prompt: ``tokens`` (prompt tokens, for the work estimate),
    ``worth`` (tokens of recomputation saved: L2/L3 pages count less), ``in_flight``."""

    tokens: int
    worth: float
    in_flight: bool


class Decision(NamedTuple):
    """Where a request goes and why (``reason``: cache, in_flight, balance, session, round_robin,
    least_loaded)."""

    worker_id: int
    matched_tokens: int
    reason: str


class Dispatcher:
    """Chooses a worker per request under a routing policy (see the module doc).

    ``loads`` passed to :meth:`choose` are the live workers' :class:`Outstanding` work (a
    plain int counts as that many requests). Pass the request's ``rid`` so that the
    dispatcher can tell when its prefix stops being in flight: call :meth:`prefilled` at its
    first token and :meth:`ended` when it ends (either may come first; both are idempotent).
    """

    def __init__(
        self,
        policy: RoutingPolicy = "cache_aware",
        *,
        cache_threshold: float = 0.5,
        min_match_tokens: int = 8,
        balance_load: BalanceLoad = "work",
        balance_abs_threshold: float | None = None,
        balance_rel_threshold: float = 1.5,
        running_request_tokens: int = 32,
        follow_in_flight: bool = True,
        trie_max_tokens: int = 1 << 20,
        max_sessions: int = 100_000,
        prefix_source: PrefixSource = "tries",
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; expected one of {ROUTING_POLICIES}"
            )
        if balance_load not in BALANCE_LOADS:
            raise ValueError(
                f"unknown balance load {balance_load!r}; expected one of {BALANCE_LOADS}"
            )
        if prefix_source not in PREFIX_SOURCES:
            raise ValueError(
                f"unknown prefix source {prefix_source!r}; expected one of {PREFIX_SOURCES}"
            )
        self.policy = policy
        self.prefix_source = prefix_source
        self.cache_threshold = cache_threshold
        self.min_match_tokens = min_match_tokens
        self.balance_load = balance_load
        self.balance_abs_threshold = (
            DEFAULT_ABS_THRESHOLD[balance_load]
            if balance_abs_threshold is None
            else balance_abs_threshold
        )
        self.balance_rel_threshold = balance_rel_threshold
        self.running_request_tokens = running_request_tokens
        self.follow_in_flight = follow_in_flight
        self.trie_max_tokens = trie_max_tokens
        self.max_sessions = max_sessions
        self.tries: dict[int, PrefixTrie] = {}
        self.views: dict[int, WorkerKVView] = {}  # prefix_source="events": fed by the router
        # (cache namespace, session id) -> worker: a tenant's session ids never meet another's.
        self._sessions: OrderedDict[tuple[str | None, str], int] = OrderedDict()
        self._pending: dict[str, tuple[int, tuple[int, ...]]] = {}  # rid -> (worker, trie key)
        self._rr = 0

    def add_worker(self, worker_id: int) -> None:
        self.tries.setdefault(worker_id, PrefixTrie(self.trie_max_tokens))
        if self.prefix_source == "events":
            self.views.setdefault(worker_id, WorkerKVView())

    def remove_worker(self, worker_id: int) -> None:
        """Forget a dead worker: its tree and KV view, its requests' pending prefixes, its
        sessions (a restarted worker starts with an empty cache and view)."""
        self.tries.pop(worker_id, None)
        self.views.pop(worker_id, None)
        for rid in [r for r, (w, _) in self._pending.items() if w == worker_id]:
            del self._pending[rid]
        for sid in [s for s, w in self._sessions.items() if w == worker_id]:
            del self._sessions[sid]

    def forget_session(self, session_id: str, namespace: str | None = None) -> None:
        """The session closed (in ``namespace``, its tenant's): its next request (if any) is
        routed like a new one."""
        self._sessions.pop((namespace, session_id), None)

    def flush(self) -> None:
        """The workers' caches were flushed: forget every prefix."""
        for trie in self.tries.values():
            trie.clear()

    def load(self, outstanding: Outstanding | int) -> float:
        """One worker's load in the unit of ``balance_load``."""
        if isinstance(outstanding, int):
            outstanding = Outstanding(outstanding)
        if self.balance_load == "requests":
            return float(outstanding.requests)
        return float(
            outstanding.prefill_tokens + outstanding.requests * self.running_request_tokens
        )

    def imbalanced(self, load: float, min_load: float) -> bool:
        """Whether ``load`` is really beyond ``min_load``: by more than the absolute threshold
        *and* by more than the relative one (a request then goes to the least loaded)."""
        return (
            load - min_load > self.balance_abs_threshold
            and load > self.balance_rel_threshold * min_load
        )

    def choose(
        self,
        tokens: Sequence[int],
        loads: Mapping[int, Outstanding | int],
        session_id: str | None = None,
        namespace: str | None = None,
        rid: str | None = None,
    ) -> Decision:
        """Pick a worker among ``loads``' keys (must be non-empty) and record the prefix there
        (in flight until :meth:`prefilled` for ``rid``; recorded as computed without a rid).

        A cache ``namespace`` (a tenant's, with its cache salt) shares nothing with other
        namespaces, so its prefixes are recorded under a negative sentinel token (never a
        real token id) of their own: each worker's trie holds one subtree per namespace."""
        if not loads:
            raise ValueError("no live worker")
        key = tuple(tokens) if namespace is None else (namespace_token(namespace), *tokens)
        held = _Lookup(self, key, tokens, namespace)
        skey = None if session_id is None else (namespace, session_id)
        decision = self._choose(
            held, len(tokens), {w: self.load(o) for w, o in loads.items()}, skey
        )
        self.add_worker(decision.worker_id)
        if rid is not None:
            self.ended(rid)  # a retry: its earlier worker's record is void
            self._pending[rid] = (decision.worker_id, key)
        self.tries[decision.worker_id].insert(key, pending=rid is not None)
        if skey is not None:
            self._sessions[skey] = decision.worker_id
            self._sessions.move_to_end(skey)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return decision

    def prefilled(self, rid: str) -> None:
        """Request ``rid`` got its first token: its worker holds its prompt now."""
        entry = self._pending.pop(rid, None)
        if entry is not None and entry[0] in self.tries:
            self.tries[entry[0]].prefilled(entry[1])

    def ended(self, rid: str) -> None:
        """Request ``rid`` ended (a no-op once it was prefilled)."""
        entry = self._pending.pop(rid, None)
        if entry is not None and entry[0] in self.tries:
            self.tries[entry[0]].abandon(entry[1])

    def _choose(
        self,
        held: _Lookup,
        prompt_len: int,
        loads: Mapping[int, float],
        session: tuple[str | None, str] | None,
    ) -> Decision:
        ids = sorted(loads)
        if session is not None and self._sessions.get(session) in loads:
            wid = self._sessions[session]
            # A session stays with the worker that holds its KV (its lease) unless that worker
            # is overloaded beyond the balance thresholds; then it moves like any request.
            if not self.imbalanced(loads[wid], min(loads.values())):
                return Decision(wid, held(wid).tokens, "session")
        if self.policy == "round_robin":
            wid = ids[self._rr % len(ids)]
            self._rr += 1
            return Decision(wid, held(wid).tokens, "round_robin")
        min_load = min(loads.values())
        reason = "least_loaded"
        if self.policy == "cache_aware":
            matches = {wid: held(wid) for wid in ids}
            best = max(ids, key=lambda w: (matches[w].worth, -loads[w]))
            m = matches[best]
            if m.tokens >= self.min_match_tokens and m.worth >= self.cache_threshold * prompt_len:
                if self.follow_in_flight and m.in_flight:
                    return Decision(best, m.tokens, "in_flight")
                if not self.imbalanced(loads[best], min_load):
                    return Decision(best, m.tokens, "cache")
                reason = "balance"
        least = [w for w in ids if loads[w] == min_load]
        # Ties: the emptiest cache has the most room; then rotate so equal workers share work.
        self._rr += 1
        wid = min(least, key=lambda w: (self._size(w), (w - self._rr) % (max(ids) + 1)))
        return Decision(wid, held(wid).tokens, reason)

    def synced_view(self, wid: int) -> WorkerKVView | None:
        """Worker ``wid``'s KV view when routing on events and it is in sync, else None."""
        view = self.views.get(wid)
        return view if view is not None and view.synced else None

    def _size(self, wid: int) -> int:
        view = self.synced_view(wid)
        if view is not None:
            return view.l1_tokens
        trie = self.tries.get(wid)
        return trie.num_tokens if trie is not None else 0


class _Lookup:
    """What each worker holds of one prompt, computed on first ask: from its KV view when
    routing on events and the view is synced (page keys hashed once per distinct hasher),
    else from its tree. Counts are in prompt tokens (a namespace's sentinel excluded)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        key: tuple[int, ...],
        tokens: Sequence[int],
        namespace: str | None,
    ) -> None:
        self.d, self.key, self.tokens, self.namespace = dispatcher, key, tokens, namespace
        self.skip = 0 if namespace is None else 1  # the sentinel heading ``key``
        self._memo: dict[int, _Held] = {}
        self._keys: dict[tuple[str, int], list[bytes]] = {}

    def __call__(self, wid: int) -> _Held:
        got = self._memo.get(wid)
        if got is None:
            got = self._memo[wid] = self._held(wid)
        return got

    def _held(self, wid: int) -> _Held:
        trie = self.d.tries.get(wid)
        view = self.d.synced_view(wid)
        if view is None:
            m = trie.lookup(self.key) if trie is not None else TrieMatch(0, False)
            n = max(0, m.tokens - self.skip)
            return _Held(n, float(n), m.in_flight)
        assert view.hasher is not None
        hk = (view.hasher.identity, view.hasher.page_size)
        keys = self._keys.get(hk)
        if keys is None:
            keys = self._keys[hk] = view.page_keys(self.tokens, self.namespace)
        km = view.match(keys)
        pending = max(0, trie.pending_len(self.key) - self.skip) if trie is not None else 0
        if pending > km.tokens:  # being computed there now: held once its prefill is done
            return _Held(pending, float(pending), True)
        return _Held(km.tokens, km.weighted, False)
