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
are often allocated in runs, so a run costs one entry per layer, not one per page).

The peer is named by its transfer-engine session (``host:rpc_port``); the engines find each
other by Mooncake's P2P handshake (``P2PHANDSHAKE``: no metadata server) as SGLang's
disaggregation does. A :class:`PoolDescriptor` is what the decode side sends so the prefill
side can address its pool; a pool whose layout differs (layers, page size, KV heads, head
dim, KV dtype: e.g. a different tensor-parallel size) is refused, never written.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import msgspec

from radixserve.memory.pool import KVPool

__all__ = ["KVTransfer", "PoolDescriptor", "TransferError", "TransferStats", "page_runs"]


class TransferError(RuntimeError):
    """A transfer the engine refused or could not finish (peer gone, unregistered range)."""


class PoolDescriptor(msgspec.Struct, frozen=True):
    """Where a pool's pages live in its process, as its peer needs to write them."""

    session: str  # the transfer engine's "host:rpc_port"
    layout: str  # KVPool.layout(): equal on both sides, or no transfer
    num_layers: int
    num_pages: int
    bases: list[int]  # address of each page tensor (K, V[, K scales, V scales])
    page_bytes: list[int]  # bytes of one page of one layer, per tensor


class TransferStats(NamedTuple):
    """Counters since start (``seconds``: wall time inside the transfer engine)."""

    transfers: int
    failures: int
    pages: int
    bytes: int
    seconds: float


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` for runs of pages consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


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
    """One pool registered with one transfer engine; writes its pages into peers' pools."""

    def __init__(
        self,
        pool: KVPool,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        self.pool = pool
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
            layout=self.pool.layout(),
            num_layers=self.pool.num_layers,
            num_pages=n,
            bases=[t.data_ptr() for t in self._tensors],
            page_bytes=[t.nbytes // (t.shape[0] * n) for t in self._tensors],
        )

    def stats(self) -> TransferStats:
        return self._stats

    def write_pages(self, peer: PoolDescriptor, src: list[int], dst: list[int]) -> int:
        """Copy pages ``src`` of this pool (every layer, K, V and per-token scales) into
        pages ``dst`` of ``peer``'s pool; returns the bytes written. Raises
        :class:`TransferError` when the engine fails, ``ValueError`` for a layout mismatch or
        page ids out of range (nothing written then)."""
        mine = self.descriptor()
        if peer.layout != mine.layout or peer.page_bytes != mine.page_bytes:
            raise ValueError(
                f"KV layouts differ: this pool {mine.layout}, the peer's {peer.layout} "
                "(tensor-parallel sizes, KV dtype, page size and model must match)"
            )
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
        if any(not 0 <= p < mine.num_pages for p in src) or any(
            not 0 <= p < peer.num_pages for p in dst
        ):
            raise ValueError("page id out of range")
        if not src:
            return 0
        srcs, dsts, lengths = self._entries(mine, peer, page_runs(src, dst))
        start = time.perf_counter()
        rc = self._engine.batch_transfer_sync_write(peer.session, srcs, dsts, lengths)
        elapsed = time.perf_counter() - start
        total = sum(lengths)
        with self._lock:
            s = self._stats
            if rc != 0:
                self._stats = s._replace(failures=s.failures + 1, seconds=s.seconds + elapsed)
                raise TransferError(f"transfer of {len(src)} pages to {peer.session} failed")
            self._stats = TransferStats(
                s.transfers + 1,
                s.failures,
                s.pages + len(src),
                s.bytes + total,
                s.seconds + elapsed,
            )
        return total

    @staticmethod
    def _entries(
        mine: PoolDescriptor, peer: PoolDescriptor, runs: list[tuple[int, int, int]]
    ) -> tuple[list[int], list[int], list[int]]:
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        for i, pb in enumerate(mine.page_bytes):
            for layer in range(mine.num_layers):
                src_layer = mine.bases[i] + layer * mine.num_pages * pb
                dst_layer = peer.bases[i] + layer * peer.num_pages * pb
                for s, d, n in runs:
                    srcs.append(src_layer + s * pb)
                    dsts.append(dst_layer + d * pb)
                    lengths.append(n * pb)
        return srcs, dsts, lengths

    def close(self) -> None:
        """Unregister the pool (the engine itself stops when it is collected)."""
        for t in self._tensors:
            self._engine.unregister_memory(t.data_ptr())
        self._tensors = []
