"""Rank 0's :class:`~.rank_transfer.RankLink` over its tensor-parallel rank group.

A module of its own because it needs :class:`~radixserve.distributed.ranks.RankGroup`, and
``ranks`` imports :mod:`.rank_transfer` (the other ranks answer a ``KVWrite`` there): kept
apart, the two import no cycle.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from radixserve.distributed.disagg.kv_layout import PoolDescriptor
from radixserve.distributed.disagg.rank_transfer import pool_key
from radixserve.distributed.ranks import RankGroup
from radixserve.distributed.step_wire import KVWrite

__all__ = ["GroupLink"]


class GroupLink:
    """:class:`RankLink` over a tensor-parallel :class:`RankGroup` (the plan channel, the
    model's group for the all-gather, the start-up store for the descriptors)."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks

    def pools(self) -> list[PoolDescriptor]:
        store = self.ranks.rv.store
        return [
            msgspec.msgpack.decode(store.get(pool_key(r)), type=PoolDescriptor)
            for r in range(1, self.ranks.world_size)
        ]

    def write(self, msg: KVWrite, own: Callable[[], int]) -> list[int]:
        g = self.ranks
        try:
            g.channel.send(msg)
            mine = torch.tensor([own()], dtype=torch.int64, device=g.device)
            return [int(t[0]) for t in g.tp.all_gather(mine)]
        except Exception as exc:  # a rank died or hung: the worker cannot go on
            raise g.explain(exc) from exc
