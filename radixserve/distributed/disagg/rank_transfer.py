"""A prompt's KV moved from every tensor-parallel rank of the prefill engine into every rank of
the decode engine: each rank's pool slice goes straight from its process to the decode ranks
that hold its heads.

Design: Mooncake's transfer engine writes from memory registered in the calling process, and
rank 0 cannot address another process's pool, so every rank registers its own pool with a
transfer engine of its own and writes its own share; rank 0 only decides and collects::

    decode rank 0 (scheduler) ── PrefillTicket(pools: one PoolDescriptor per decode rank) ──>
    prefill rank 0:  check every (prefill rank, decode rank) pair; head_sources -> KVWrite
                     ── plan channel ──> prefill ranks 1..N-1 (behind the steps before it,
                                         so the prompt's KV is in every pool)
    every prefill rank: batch_transfer_sync_write of its segments into the decode ranks' pools
    every prefill rank: all-gather of the bytes it wrote (-1: failed)
    prefill rank 0:  the request's pages landed only when every rank's did; else it fails
                     (PrefillResult.error) and both sides give its pages back as for one rank

The decode ranks take no part in a transfer (the writes land in their registered memory);
each publishes its pool's descriptor in the rank group's store before it reports ready, and
decode rank 0 puts them all in its tickets. Equal tensor-parallel sizes write rank ``r`` to
rank ``r``, whole pages; differing sizes write each token's slice of heads (:mod:`.kv_layout`),
as SGLang's ``send_kvcache_slice`` does. The message goes over the plan channel, which the
step loop also uses, so a rank never sees a write before the steps that computed the KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import torch

from radixserve.distributed.disagg.kv_layout import PoolDescriptor, check_peer, head_sources
from radixserve.distributed.disagg.kv_transfer import KVTransfer, TransferError, TransferStats
from radixserve.distributed.step_wire import KVWrite
from radixserve.engine.config import EngineConfig
from radixserve.memory.pool import KVPool

__all__ = [
    "RankLink",
    "RankedTransfer",
    "follower_transfer",
    "open_transfer",
    "pool_key",
    "write_share",
]

log = logging.getLogger(__name__)


def pool_key(rank: int) -> str:
    """Where rank ``rank`` publishes its pool's descriptor in the rank group's store."""
    return f"disagg/pool/{rank}"


def open_transfer(cfg: EngineConfig, pool: KVPool, model: Any) -> KVTransfer:
    """``pool`` registered with a transfer engine on ``cfg``'s disaggregation address, as the
    KV heads of ``model``'s tensor-parallel shard (the whole model without one)."""
    if pool.device.type != "cpu":
        raise ValueError("disaggregation moves host pools only here (the non-CUDA Mooncake wheel)")
    shard = getattr(model, "shard", None)
    heads, total = (None, None) if shard is None else (shard.kv_heads, shard.kv_heads_total)
    return KVTransfer(
        pool,
        cfg.disaggregation_hostname,
        cfg.disaggregation_protocol,
        cfg.disaggregation_ib_device,
        heads=heads,
        total_heads=total,
    )


def write_share(transfer: KVTransfer | None, msg: KVWrite, rank: int) -> int:
    """Rank ``rank``'s part of ``msg``: the bytes it wrote, or -1 when a write failed (every
    rank must reach the all-gather after it, so nothing is raised)."""
    if transfer is None:
        log.error("rank %d has no KV transfer engine (not started in a disaggregation mode)", rank)
        return -1
    total = 0
    try:
        for seg in msg.shares[rank]:
            total += transfer.write_pages(msg.peers[seg.rank], msg.src, msg.dst, (seg.lo, seg.hi))
    except Exception:
        log.exception("rank %d: KV write of %d pages failed", rank, len(msg.src))
        return -1
    return total


def follower_transfer(
    cfg: EngineConfig, pool: KVPool, model: Any, store: Any, rank: int
) -> KVTransfer | None:
    """A rank other than 0, at start-up: its pool's transfer engine (None without
    ``disaggregation_mode``), its descriptor published for rank 0 in the rank group's store."""
    if cfg.disaggregation_mode is None:
        return None
    transfer = open_transfer(cfg, pool, model)
    store.set(pool_key(rank), msgspec.msgpack.encode(transfer.descriptor()))
    return transfer


def answer_write(
    transfer: KVTransfer | None,
    msg: KVWrite,
    rank: int,
    all_gather: Callable[[torch.Tensor], Any],
    device: torch.device,
) -> None:
    """A rank other than 0, on a :class:`KVWrite`: write its share, join the all-gather."""
    all_gather(torch.tensor([write_share(transfer, msg, rank)], dtype=torch.int64, device=device))


class RankLink(Protocol):
    """Rank 0's line to the other ranks of its engine."""

    def pools(self) -> list[PoolDescriptor]:
        """The other ranks' pools, in rank order."""
        ...

    def write(self, msg: KVWrite, own: Callable[[], int]) -> list[int]:
        """Send ``msg`` to the other ranks, run ``own`` (rank 0's share) meanwhile, and
        return every rank's bytes written (-1: failed), in rank order."""
        ...


class RankedTransfer:
    """Rank 0's view of its engine's pools, one per tensor-parallel rank (one without)."""

    def __init__(self, local: KVTransfer, link: RankLink | None = None) -> None:
        self.local = local
        self.link = link
        self.pools = [local.descriptor(), *(link.pools() if link is not None else [])]
        self._stats = TransferStats(0, 0, 0, 0, 0.0)

    @property
    def pool(self) -> KVPool:
        """Rank 0's pool (its page ids are every rank's)."""
        return self.local.pool

    def stats(self) -> TransferStats:
        """Counters over whole requests: bytes summed over the ranks."""
        return self._stats

    def write(self, peers: list[PoolDescriptor], src: list[int], dst: list[int]) -> int:
        """Pages ``src`` of every rank's pool into pages ``dst`` of the decode ranks' pools
        ``peers``; the bytes written by all ranks. ``ValueError`` when the pools cannot be
        paired (nothing written), :class:`TransferError` when any rank's write failed."""
        shares = head_sources([p.heads for p in self.pools], [p.heads for p in peers])
        for mine, segs in zip(self.pools, shares):
            for seg in segs:
                check_peer(mine, peers[seg.rank], src, dst)
        if not src:
            return 0
        msg = KVWrite(peers, shares, src, dst)
        start = time.perf_counter()
        own = lambda: write_share(self.local, msg, 0)  # noqa: E731
        written = self.link.write(msg, own) if self.link is not None else [own()]
        failed = [r for r, n in enumerate(written) if n < 0]
        total = sum(n for n in written if n > 0)
        self._stats = self._stats.counted(not failed, len(src), total, time.perf_counter() - start)
        if failed:
            raise TransferError(
                f"the KV write of {len(src)} pages to {peers[0].session} failed on prefill "
                f"rank(s) {failed} of {len(written)}"
            )
        return total

    def close(self) -> None:
        self.local.close()
