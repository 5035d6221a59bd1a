"""A tensor-parallel rank's share of a LoRA adapter (S-LoRA's and Punica's split).

A column-parallel layer (q/k/v, gate/up, fused or not) computes its rank's output rows:
the rank keeps A whole and B's rows of those outputs, so its delta is exactly its rows of
the whole delta. A row-parallel layer (o, down) sums the ranks' partial products in the
layer's all-reduce (``Attention._out``, ``MLP.forward``), outside the wrapped linear: the
rank keeps A's columns of its inputs and B whole, so each rank adds a partial delta before
that all-reduce, which sums them as it sums the base products. The cuts are the
checkpoint's own (:func:`~radixserve.model.tp_shard.checkpoint_slice` on the target
weight's name), so KV heads replicated over ranks (fewer KV heads than ranks) take the
same B rows on each rank that shares them.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.tp_shard import TPShard, checkpoint_slice, shard_for_rank

__all__ = ["RankCut", "rank_cut"]


class RankCut(NamedTuple):
    """Where a rank cuts one adapted layer's pair: B's rows (``dim`` 0, column-parallel) or
    A's columns (``dim`` 1, row-parallel); ``ranges``: the rank's, concatenated in order;
    ``total``: the whole layer's width along that side (what the saved matrix must have)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    total: int

    @property
    def width(self) -> int:
        """The rank's width along the cut (its local layer's)."""
        return sum(hi - lo for lo, hi in self.ranges)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The rank's part of ``t`` (a safetensors slice or a tensor): its ranges along
        ``dim``, concatenated; only those are read from the file."""
        if self.dim == 0:
            parts = [t[lo:hi] for lo, hi in self.ranges]
        else:
            parts = [t[:, lo:hi] for lo, hi in self.ranges]
        return torch.cat(parts, dim=self.dim)


def rank_cut(model: nn.Module, layer: str) -> RankCut | None:
    """How this rank of ``model`` cuts adapted ``layer``'s matrices (None: one rank, whole).
    ``ValueError`` for a layer the shard rules do not cut (the attention and MLP
    projections all are)."""
    shard: TPShard | None = getattr(model, "shard", None)
    if shard is None:
        return None
    cfg = cast("ModelConfig", model.config)
    name = f"{layer}.weight"
    mine = checkpoint_slice(name, shard, cfg.head_dim)
    whole = checkpoint_slice(name, shard_for_rank(cfg, 0, 1), cfg.head_dim)
    if mine is None or whole is None or mine.zero or mine.dim > 1:
        raise ValueError(f"the adapter adapts {layer}, which tensor parallelism does not cut")
    return RankCut(mine.dim, mine.ranges, sum(hi - lo for lo, hi in whole.ranges))
