"""KV cache events in vLLM's format (``vllm.distributed.kv_events``), recorded by the radix cache.

What enters and leaves L1, for external cache-aware routers (vLLM's router, llm-d, Dynamo)::

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
        a new leaf: its pages' keys, the key of the page before it (None at the root), the
        tokens the pages hold
    BlockRemoved(block_hashes, medium)   pages evicted from L1 (to L2 with the hierarchy)
    AllBlocksCleared()                   a cache flush

A block is one page; its hash is the page key (``page_hash``: chained BLAKE2b of the prefix,
seeded with model, KV layout and namespace), so block hashes are stable across restarts and
equal on every worker serving the same model. Routers that hash tokens themselves use
``token_ids``. Structs are msgspec ``array_like`` tagged unions exactly like vLLM's, so its
decoder (``msgspec.msgpack.Decoder(KVEventBatch)``) reads ours. The recorder only collects;
the serving layer batches and publishes (``radixserve.serving.kv_events``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from radixserve.memory.page_hash import PrefixHasher
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


class KVEventRecorder:
    """A radix cache listener that turns L1 changes into events, buffered until :meth:`drain`.

    ``medium`` names L1 in the events ("GPU" on CUDA, as vLLM; "CPU" for a CPU pool).
    """

    def __init__(self, hasher: PrefixHasher, medium: str, max_buffered: int = 100_000) -> None:
        self.hasher = hasher
        self.medium = medium
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
        keys = node_page_keys(node, self.hasher)
        parent = node.parent
        assert parent is not None
        parent_keys = node_page_keys(parent, self.hasher) if parent.parent is not None else []
        self._add(
            BlockStored(
                list(keys),
                parent_keys[-1] if parent_keys else None,
                list(node.key),
                self.hasher.page_size,
                None,
                self.medium,
            )
        )

    def removed(self, node: TreeNode, keep: int) -> None:
        """``node.pages[keep:]`` are leaving L1."""
        keys = node_page_keys(node, self.hasher)[keep:]
        if keys:
            self._add(BlockRemoved(list(keys), self.medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def drain(self) -> KVEventBatch | None:
        """The events since the last drain, as one batch (None when there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(ts=time.time(), events=events)
