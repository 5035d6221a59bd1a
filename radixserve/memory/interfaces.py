"""The narrow contracts the memory layer's parts hold each other and the model to.

Each is a :class:`~typing.Protocol`: the side that uses it names only what it reads, so it
need not import the class that provides it (which often imports the user back: the radix
cache holds its pin table, lease table and event listener). The wide contracts, the ones
several classes implement, have their own modules: :class:`~radixserve.memory.prefix_cache.
PrefixCache` (the radix cache, the tiered cache, the no-cache) and
:class:`~radixserve.memory.pool.KVPool` (one class for the CPU and CUDA pools and the L2 host
pool's storage).

========================  ==============================  ======================================
contract                  used by                         provided by
========================  ==============================  ======================================
:class:`PinnableCache`    ``pins.PinTable``               every ``PrefixCache``
:class:`LeasableCache`    ``leases.LeaseTable``           ``RadixCache``
:class:`TierListener`     ``host_pool``, ``disk_store``,  ``kv_events.KVEventRecorder``
                          ``hierarchy``
:class:`ModelDims`        ``footprint``, ``planner``,     ``radixserve.model.config.ModelConfig``
                          ``parallel_plan``
========================  ==============================  ======================================

(``_invariants.CacheInternals`` stays beside its checker: it names the radix cache's private
state for that one test-time check, no contract between parts.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from radixserve.memory.page_hash import PageKey
from radixserve.memory.tree_node import MatchResult, TreeNode

__all__ = ["LeasableCache", "ModelDims", "PinnableCache", "TierListener"]


class PinnableCache(Protocol):
    """What pinning needs of its cache (:class:`~radixserve.memory.radix_cache.RadixCache`,
    or :class:`~radixserve.memory.no_cache.NoPrefixCache`, which reuses nothing)."""

    page_size: int

    @property
    def reuses_prefixes(self) -> bool: ...

    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, *, record_stats: bool = True
    ) -> MatchResult: ...

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...


class LeasableCache(Protocol):
    """What leases need of the radix cache: page size and the lease references on a path."""

    page_size: int

    def add_lease(self, node: TreeNode) -> None: ...

    def drop_lease(self, node: TreeNode) -> None: ...


class TierListener(Protocol):
    """What the lower tiers (L2 host pages, L3 page files) report as pages come and go."""

    def tier_stored(self, tier: str, keys: Sequence[PageKey]) -> None:
        """Pages ``keys`` entered ``tier`` ("L2" or "L3")."""
        ...

    def tier_removed(self, tier: str, keys: Sequence[PageKey]) -> None:
        """Pages ``keys`` left ``tier``."""
        ...


class ModelDims(Protocol):
    """The model dimensions the planner sizes memory from. Memory sits below the model layer,
    so this names what it reads; ``radixserve.model.config.ModelConfig`` provides it."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def o_proj_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
