"""KV pages from this engine's pool straight into a peer's pool, over Mooncake's transfer engine.

::

    prefill pool (registered)                           decode pool (registered)
    K[layer] | p0 | p1 | p2 | p3 | ...   ──tcp/rdma──>   K[layer] | q0 | q1 | q2 | ...
    V[layer]   same                                      V[layer]   same
    (+ int8/int4 per-token scales, indexed like the data)

Each of the pool's page tensors (:meth:`KVPool.page_tensors`) is one allocation shaped
``[num_layers, num_pages, ...]``, so page ``p`` of layer ``l`` starts at
``base + (l * num_pages + p) * page_bytes``. Both sides register those allocations once; a
transfer is one ``batch_transfer_sync_write`` of ``(src address, dst address, length)``
entries, one per tensor, layer and run of pages consecutive on both sides (a prompt's pages
are often allocated in runs, so a run costs one entry per layer, not one per page); when the
two pools hold different KV heads (different tensor-parallel sizes) one entry per token's
slice of heads instead (:mod:`.kv_layout`).

The peer is named by its transfer-engine session (``host:rpc_port``); the engines find each
other by Mooncake's P2P handshake (``P2PHANDSHAKE``: no metadata server) as SGLang's
disaggregation does. A :class:`PoolDescriptor` is what the decode side sends so the prefill
side can address its pool; a pool whose layout differs (model, layers, page size, head dim,
KV dtype, total KV heads) is refused, never written. One ``KVTransfer`` moves one pool: with
tensor parallelism each rank has its own (:mod:`.rank_transfer`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

from radixserve.distributed.disagg.kv_layout import (
    PoolDescriptor,
    Segment,
    check_peer,
    head_sources,
    page_runs,
    transfer_entries,
)
from radixserve.memory.pool import KVPool

__all__ = [
    "KVTransfer",
    "PoolDescriptor",
    "TransferError",
    "TransferStats",
    "head_sources",
    "page_runs",
]


class TransferError(RuntimeError):
    """A transfer the engine refused or could not finish (peer gone, unregistered range)."""


class TransferStats(NamedTuple):
    """Counters since start (``seconds``: wall time inside the transfer engine)."""

    transfers: int
    failures: int
    pages: int
    bytes: int
    seconds: float

    def counted(self, ok: bool, pages: int, nbytes: int, seconds: float) -> TransferStats:
        """These counters with one more transfer (its pages and bytes count only if ``ok``)."""
        if not ok:
            return self._replace(failures=self.failures + 1, seconds=self.seconds + seconds)
        return TransferStats(
            self.transfers + 1,
            self.failures,
            self.pages + pages,
            self.bytes + nbytes,
            self.seconds + seconds,
        )


def _new_engine(hostname: str, protocol: str, device_name: str) -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel, or libibverbs under it
        raise RuntimeError(
            "prefill/decode disaggregation needs Mooncake's transfer engine: "
            f"pip install 'radixserve[mooncake]' (and libibverbs1): {e}"
        ) from e
    engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
        raise RuntimeError(f"Mooncake transfer engine did not start on {hostname} ({protocol})")
    return engine


class KVTransfer:
    """One pool registered with one transfer engine; writes its pages into peers' pools.

    ``heads``: the global KV heads ``[lo, hi)`` this pool holds, of ``total_heads`` (a
    tensor-parallel rank's shard; default: all of the pool's heads)."""

    def __init__(
        self,
        pool: KVPool,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        heads: tuple[int, int] | None = None,
        total_heads: int | None = None,
    ) -> None:
        self.pool = pool
        self.heads = heads or (0, pool.kv_heads)
        self.total_heads = total_heads or pool.kv_heads
        if self.heads[1] - self.heads[0] != pool.kv_heads:
            raise ValueError(f"heads {self.heads} for a pool of {pool.kv_heads} KV heads")
        self._engine = _new_engine(hostname, protocol, device_name)
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._tensors = pool.page_tensors()
        for t in self._tensors:
            if self._engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError(f"could not register {t.nbytes} bytes of KV with Mooncake")
        self._lock = threading.Lock()
        self._stats = TransferStats(0, 0, 0, 0, 0.0)

    def descriptor(self) -> PoolDescriptor:
        """This pool, as a peer addresses it."""
        n = self.pool.num_pages
        return PoolDescriptor(
            session=self.session,
            layout=self.pool.layout(heads=False),
            num_layers=self.pool.num_layers,
            num_pages=n,
            bases=[t.data_ptr() for t in self._tensors],
            page_bytes=[t.nbytes // (t.shape[0] * n) for t in self._tensors],
            page_size=self.pool.page_size,
            heads=self.heads,
            total_heads=self.total_heads,
        )

    def stats(self) -> TransferStats:
        return self._stats

    def write_pages(
        self,
        peer: PoolDescriptor,
        src: list[int],
        dst: list[int],
        heads: tuple[int, int] | None = None,
    ) -> int:
        """Copy heads ``heads`` (default: every head both pools hold) of pages ``src`` of this
        pool (every layer, K, V and per-token scales) into pages ``dst`` of ``peer``'s pool;
        returns the bytes written. Raises :class:`TransferError` when the engine fails,
        ``ValueError`` for a layout mismatch or page ids out of range (nothing written then)."""
        mine = self.descriptor()
        check_peer(mine, peer, src, dst)
        lo, hi = heads or (max(mine.heads[0], peer.heads[0]), min(mine.heads[1], peer.heads[1]))
        if not (max(mine.heads[0], peer.heads[0]) <= lo < hi <= min(mine.heads[1], peer.heads[1])):
            raise ValueError(f"heads [{lo}, {hi}) are not held by both pools")
        if not src:
            return 0
        srcs, dsts, lengths = transfer_entries(mine, peer, src, dst, Segment(0, lo, hi))
        start = time.perf_counter()
        rc = self._engine.batch_transfer_sync_write(peer.session, srcs, dsts, lengths)
        elapsed = time.perf_counter() - start
        total = sum(lengths)
        with self._lock:
            self._stats = self._stats.counted(rc == 0, len(src), total, elapsed)
        if rc != 0:
            raise TransferError(f"transfer of {len(src)} pages to {peer.session} failed")
        return total

    def close(self) -> None:
        """Unregister the pool (the engine itself stops when it is collected)."""
        for t in self._tensors:
            self._engine.unregister_memory(t.data_ptr())
        self._tensors = []
