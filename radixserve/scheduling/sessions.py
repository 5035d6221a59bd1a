"""The scheduler's side of session leases (memory.leases) and eviction policies
(memory.eviction): where a session's turn begins and ends.

::

    admitted (first time)   the eviction policy sees the prompt (adaptive's key stream) and
                            the request's priority is marked on its matched path;
                            no session id? adopt one from the tree (a chat re-sending an
                            earlier request's prompt + answer); learn the pause since the
                            session's last turn; count a lease hit or what a lost lease cost;
                            count where its prompt left the cached path, and when asked
                            explain why (memory.miss_report: before the turn resets a
                            lost lease)
    finished (stop/length)  its computed KV goes into the tree, then the path it holds
                            (prompt + answer) gets its priority and is leased to its session before it unlocks;
                            an unkeyed request only marks its path for adoption
    every step              leases whose time is up are dropped

Aborts, errors and retractions end no turn: a session's lease stays as it was.
"""

from __future__ import annotations

from radixserve.memory import PrefixCache
from radixserve.memory.eviction.control import mark_priority
from radixserve.scheduling.references import KVReferences
from radixserve.scheduling.request import Request

# Finish reasons that end a turn (a tool call finishes with "stop" at this level).
TURN_ENDS = frozenset({"stop", "length"})


def turn_admitted(cache: PrefixCache, req: Request) -> None:
    """``req`` was admitted for the first time, holding its matched prefix locked."""
    cache.eviction.observe(req.token_ids[: req.prompt_len], req.namespace, req.priority)
    if req.priority and req.lock_node is not None:
        mark_priority(req.lock_node, req.priority)
    leases = cache.leases
    if leases.enabled and req.session_id is None:
        req.session_id = leases.adopt(req.token_ids[: req.prompt_len], req.namespace)
    explain_miss(cache, req)  # before the turn is counted: it still knows a lost lease
    if not leases.enabled:
        return
    if req.session_id is not None:
        leases.turn_admitted(req.session_id, req.namespace, req.prompt_len, req.cached_len)


def explain_miss(cache: PrefixCache, req: Request) -> None:
    """Where ``req``'s prompt left the longest cached path (memory.miss_report): counted
    for every request (server-wide divergence positions, cheap: from its matched node on;
    and the live policy's regret: the pages right after its match that it evicted lately);
    when asked (the request, or ``--cache-report``), also why, sent once with its next
    output."""
    misses = cache.misses
    asked = req.params.return_cache_report or (misses is not None and misses.report_all)
    if misses is None:
        if asked:
            req.cache_report = "no_cache"
        return
    misses.regret(req.token_ids[: req.prompt_len], req.namespace, req.lock_node)
    if not asked:
        misses.locate(req.token_ids[: req.prompt_len], req.namespace, req.lock_node)
        return
    lost = None
    if req.session_id is not None and cache.leases.enabled:
        lost = cache.leases.lost(req.session_id, req.namespace)
    req.cache_report = misses.explain(req.token_ids[: req.prompt_len], req.namespace, lost)


def turn_ended(cache: PrefixCache, kv: KVReferences, req: Request, reason: str) -> None:
    """Running ``req`` finishes with ``reason``: lease its path (before its references go)."""
    if reason not in TURN_ENDS or not (cache.leases.enabled or req.priority):
        return
    kv.cache_computed(req)
    assert req.lock_node is not None
    if req.priority:
        mark_priority(req.lock_node, req.priority)
    cache.leases.turn_ended(req.session_id, req.namespace, req.lock_node)
