"""The router's event-fed view of what each worker's KV cache holds.

The cache-aware router can learn where a prefix is cached in two ways: from what it *sent*
(:class:`~radixserve.serving.router.prefix_trie.PrefixTrie`, approximate: it never hears of an
eviction, a restart, a demotion to host memory or a flush by another client), or from the
workers' own KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
:mod:`radixserve.memory.kv_events`), which say exactly which pages each worker holds and in
which tier. This module is the second: a :class:`WorkerKVView` per worker, fed with that
worker's event batches, answering "how much of this prompt do you hold, and where".

A view knows a page by its block hash, the worker's page key (:mod:`~radixserve.memory.page_hash`):
a hash chained from a seed that folds in the model, the KV layout and the request's cache
namespace, so one tenant's pages never match another tenant's prompt. The router hashes a
prompt's pages the same way with the hasher the worker announced in its snapshot (identity
and page size), once per distinct hasher.

Synchronisation (the worker's messages arrive in order over its router connection):

* a view is *synced* from the worker's snapshot (sequence 0: ``AllBlocksCleared`` then what
  the cache holds now) until a sequence gap; a gap clears it and asks for a new snapshot;
* ``AllBlocksCleared`` empties it (a flush); a restarted worker gets a fresh, empty view;
* while a view is not synced, the dispatcher falls back to its tries for that worker.

Torch-free and process-free: unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import msgspec

from radixserve.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from radixserve.memory.page_hash import PageKey, PrefixHasher

__all__ = ["DEFAULT_TIER_WEIGHTS", "KVMatch", "WorkerKVView", "decode_batch", "tier_of_medium"]

# What a held page saves, as a fraction of recomputing it: an L1 hit is free; an L2 page costs
# a host-to-device copy; an L3 page a file read and a copy. The exact values matter only to
# rank equal matches (L1 > L2 > L3) and to weigh a long lower-tier match against a shorter
# L1 one.
DEFAULT_TIER_WEIGHTS: dict[str, float] = {"L1": 1.0, "L2": 0.8, "L3": 0.5}

_L1, _L2, _L3 = 1, 2, 4  # tier bits of a page
_BITS = {"L1": _L1, "L2": _L2, "L3": _L3}

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(data: bytes) -> KVEventBatch:
    """A vLLM-format msgpack ``KVEventBatch`` (raises ``msgspec.DecodeError`` when malformed)."""
    return _decoder.decode(data)


def tier_of_medium(medium: str | None, l1_medium: str) -> str:
    """The tier ("L1", "L2", "L3") an event's ``medium`` names on a worker whose L1 is
    ``l1_medium`` (see :func:`radixserve.memory.kv_events.tier_mediums`)."""
    if medium is None or medium == l1_medium:
        return "L1"
    return "L3" if medium == "DISK" else "L2"


class KVMatch(NamedTuple):
    """How much of a prompt a worker holds: ``l1_tokens`` from the start in L1, then
    ``lower_tokens`` more in L2/L3 (loaded back on a hit); ``weighted`` is their worth in
    tokens of recomputation saved (the dispatcher compares it)."""

    l1_tokens: int
    lower_tokens: int
    weighted: float

    @property
    def tokens(self) -> int:
        return self.l1_tokens + self.lower_tokens


class WorkerKVView:
    """The pages one worker holds, by tier, as its KV events say (see the module doc)."""

    def __init__(self, tier_weights: dict[str, float] | None = None) -> None:
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        self.blocks: dict[PageKey | int, int] = {}  # block hash -> tier bits
        self.hasher: PrefixHasher | None = None
        self.l1_medium = "CPU"
        self.synced = False
        self.next_seq = 0
        self.l1_pages = 0
        self.gaps = 0  # sequence gaps seen (each cost a resync)
        self.batches = 0

    def clear(self) -> None:
        """Forget every page (a flush, or a resync about to come)."""
        self.blocks.clear()
        self.l1_pages = 0

    def reset(self, identity: str, page_size: int, l1_medium: str) -> None:
        """A snapshot begins: the worker's hasher and L1 medium; nothing held yet."""
        self.clear()
        if (
            self.hasher is None
            or self.hasher.identity != identity
            or self.hasher.page_size != page_size
        ):
            self.hasher = PrefixHasher(identity, page_size)
        self.l1_medium = l1_medium
        self.synced = True
        self.next_seq = 0

    def desync(self) -> None:
        """Stop trusting the view (a gap): cleared, unused until the next snapshot."""
        self.clear()
        self.synced = False

    def apply(self, seq: int, batch: KVEventBatch) -> bool:
        """Fold in batch ``seq``; False (and the view desynced) if batches were missed."""
        if not self.synced:
            return False
        if seq != self.next_seq:
            self.gaps += 1
            self.desync()
            return False
        self.next_seq = seq + 1
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._add(event.block_hashes, _BITS[tier_of_medium(event.medium, self.l1_medium)])
            elif isinstance(event, BlockRemoved):
                self._remove(
                    event.block_hashes, _BITS[tier_of_medium(event.medium, self.l1_medium)]
                )
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        return True

    def _add(self, hashes: Sequence[PageKey | int], bit: int) -> None:
        blocks = self.blocks
        for h in hashes:
            old = blocks.get(h, 0)
            if bit == _L1 and not old & _L1:
                self.l1_pages += 1
            blocks[h] = old | bit

    def _remove(self, hashes: Sequence[PageKey | int], bit: int) -> None:
        blocks = self.blocks
        for h in hashes:
            old = blocks.get(h, 0)
            if not old & bit:
                continue
            if bit == _L1:
                self.l1_pages -= 1
            if old == bit:
                del blocks[h]
            else:
                blocks[h] = old & ~bit

    def page_keys(self, tokens: Sequence[int], namespace: Hashable | None) -> list[PageKey]:
        """The worker's keys of the whole pages of ``tokens`` under ``namespace``."""
        assert self.hasher is not None, "no snapshot yet"
        return self.hasher.keys(tokens, namespace)

    def match(self, keys: Sequence[PageKey]) -> KVMatch:
        """The prompt whose page keys are ``keys``: its leading pages in L1, then the pages
        after those that L2 or L3 hold (what the worker's match would load back)."""
        blocks, ps, w = self.blocks, self.hasher.page_size if self.hasher else 1, self.tier_weights
        i, n = 0, len(keys)
        while i < n and blocks.get(keys[i], 0) & _L1:
            i += 1
        l1 = i
        worth = float(l1 * ps)
        while i < n:
            bits = blocks.get(keys[i], 0)
            if bits & _L2:
                worth += ps * w["L2"]
            elif bits & _L3:
                worth += ps * w["L3"]
            else:
                break
            i += 1
        return KVMatch(l1 * ps, (i - l1) * ps, worth)

    @property
    def l1_tokens(self) -> int:
        """Tokens the worker holds in L1 (its cache's fill, for tie-breaks)."""
        return self.l1_pages * (self.hasher.page_size if self.hasher else 1)
