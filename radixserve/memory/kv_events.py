"""KV cache events in vLLM's format (``vllm.distributed.kv_events``), recorded by the radix cache.

What enters and leaves each tier, for external cache-aware routers (vLLM's router, llm-d,
Dynamo)::

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
        L1: a new leaf: its pages' keys, the key of the page before it (None at the root),
        the tokens the pages hold. L2/L3: pages copied into that tier (demoted to host
        memory, loaded from disk into L2, written to a page file): keys only, no parent and
        no tokens, as vLLM's offloading connector reports its CPU blocks
    BlockRemoved(block_hashes, medium)   pages leaving a tier (L1 eviction, L2 eviction or
                                         flush, a corrupt page file removed)
    AllBlocksCleared()                   a cache flush (L1 and L2; L3 files stay, unannounced)

``medium`` names the tier: L1 is "GPU" on CUDA (vLLM's name) or "CPU" for a CPU pool; L2 is
"CPU" (host memory, vLLM's offloading medium) behind a GPU, "CPU_L2" behind a CPU pool (so
the two tiers stay apart); L3 is "DISK". Pages already on disk when a worker starts are not
announced.

A block is one page; its hash is the page key (``page_hash``: chained BLAKE2b of the prefix,
seeded with model, KV layout and namespace), so block hashes are stable across restarts and
equal on every worker serving the same model. Routers that hash tokens themselves use
``token_ids``. Structs are msgspec ``array_like`` tagged unions exactly like vLLM's, so its
decoder (``msgspec.msgpack.Decoder(KVEventBatch)``) reads ours. The recorder only collects;
the serving layer batches and publishes (``radixserve.serving.worker.kv_events``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from radixserve.memory.page_hash import PageKey, PrefixHasher
from radixserve.memory.tree_node import node_page_keys

if TYPE_CHECKING:
    from radixserve.memory.tree_node import TreeNode

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def tier_mediums(l1_medium: str) -> dict[str, str]:
    """The event medium of each tier when L1 is ``l1_medium`` (see the module doc)."""
    return {"L1": l1_medium, "L2": "CPU" if l1_medium != "CPU" else "CPU_L2", "L3": "DISK"}


class KVEventRecorder:
    """A radix cache (and hierarchy) listener that turns tier changes into events, buffered
    until :meth:`drain`.

    ``medium`` names L1 in the events ("GPU" on CUDA, as vLLM; "CPU" for a CPU pool); the
    lower tiers' names follow from it (:func:`tier_mediums`).
    """

    def __init__(self, hasher: PrefixHasher, medium: str, max_buffered: int = 100_000) -> None:
        self.hasher = hasher
        self.medium = medium
        self.mediums = tier_mediums(medium)
        self.max_buffered = max_buffered
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self.dropped = 0

    def _add(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if len(self._events) >= self.max_buffered:  # nobody drains: keep memory bounded
            self._events.clear()
            self.dropped += 1
            event = AllBlocksCleared()  # subscribers must resync rather than trust a gap
        self._events.append(event)

    def stored(self, node: TreeNode) -> None:
        """``node`` (a new leaf) entered the tree."""
        self._add(self._block_stored(node))

    def _block_stored(self, node: TreeNode) -> BlockStored:
        """The L1 ``BlockStored`` of ``node``: its pages' keys, the key of the page before it
        (None at a namespace root), its tokens."""
        keys = node_page_keys(node, self.hasher)
        parent = node.parent
        assert parent is not None
        parent_keys = node_page_keys(parent, self.hasher) if parent.parent is not None else []
        return BlockStored(
            list(keys),
            parent_keys[-1] if parent_keys else None,
            list(node.key),
            self.hasher.page_size,
            None,
            self.medium,
        )

    def removed(self, node: TreeNode, keep: int) -> None:
        """``node.pages[keep:]`` are leaving L1."""
        keys = node_page_keys(node, self.hasher)[keep:]
        if keys:
            self._add(BlockRemoved(list(keys), self.medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def tier_stored(self, tier: str, keys: Sequence[PageKey]) -> None:
        if not keys:
            return
        medium = self.mediums[tier]
        last = self._events[-1] if self._events else None
        if (  # one page file at a time: runs of them become one event
            isinstance(last, BlockStored)
            and last.medium == medium
            and not last.token_ids
            and len(last.block_hashes) < 1024
        ):
            last.block_hashes.extend(keys)
            return
        self._add(BlockStored(list(keys), None, [], self.hasher.page_size, None, medium))

    def tier_removed(self, tier: str, keys: Sequence[PageKey]) -> None:
        if not keys:
            return
        medium = self.mediums[tier]
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockRemoved)
            and last.medium == medium
            and len(last.block_hashes) < 1024
        ):
            last.block_hashes.extend(keys)
            return
        self._add(BlockRemoved(list(keys), medium))

    def snapshot(self, nodes: Iterable[TreeNode], l2_keys: Sequence[PageKey] = ()) -> KVEventBatch:
        """What the cache holds now, as events a subscriber can start from: ``AllBlocksCleared``,
        then a ``BlockStored`` per L1 node (``nodes``: each after its parent, as
        :meth:`~radixserve.memory.radix_cache.RadixCache.nodes` walks them), then the L2 pages
        (``l2_keys``). L3 files are not listed (as at a worker's start). Take it right after a
        :meth:`drain`, so that later batches continue it exactly."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]
        events += [self._block_stored(node) for node in nodes if node.pages]
        for i in range(0, len(l2_keys), 1024):
            events.append(
                BlockStored(
                    list(l2_keys[i : i + 1024]),
                    None,
                    [],
                    self.hasher.page_size,
                    None,
                    self.mediums["L2"],
                )
            )
        return KVEventBatch(ts=time.time(), events=events)

    def drain(self) -> KVEventBatch | None:
        """The events since the last drain, as one batch (None when there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(ts=time.time(), events=events)
