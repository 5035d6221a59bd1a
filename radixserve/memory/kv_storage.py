"""The L3 contract: a store of whole KV pages keyed by page key, and the page record it keeps.

Two implementations: :class:`~radixserve.memory.disk_store.DiskKVStore` (files in a
directory, one host) and :class:`~radixserve.memory.mooncake_store.MooncakeKVStore` (a
Mooncake Store cluster, any host). :class:`~radixserve.memory.hierarchy.KVHierarchy` writes
L2's spilled pages to it and reads pages back ahead of L1, and never needs to know which.

A page's key hashes only its token prefix (``page_hash``), so a store could hand back bytes
that are not what was written (a torn write, a bad node, a bug): every record carries a
checksum of its payload, checked on read; a mismatch is a miss, never KV.

::

    record  = header | payload
    header  magic "RSKV", version u16, reserved u16, payload bytes u64, key 16 B, BLAKE2b-16 of payload
    payload the page's rows of every page-indexed pool tensor (K, V, per-token scales), raw bytes
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixserve.memory.page_hash import DIGEST_SIZE, PageKey

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener

HEADER = struct.Struct("<4sHHQ16s16s")
MAGIC = b"RSKV"
VERSION = 1


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()


def pack_page(key: PageKey, rows: list[torch.Tensor]) -> bytes:
    """One page's record: header (with the payload's checksum) and the rows' raw bytes."""
    payload = b"".join(r.contiguous().view(torch.uint8).numpy().tobytes() for r in rows)
    return HEADER.pack(MAGIC, VERSION, 0, len(payload), key, checksum(payload)) + payload


def unpack_page(
    key: PageKey, data: bytes | bytearray, like: list[torch.Tensor]
) -> list[torch.Tensor] | None:
    """The rows of a record shaped and typed like ``like``, or None when its size, magic,
    version, key or checksum is wrong."""
    sizes = [t.numel() * t.element_size() for t in like]
    if len(data) != HEADER.size + sum(sizes):
        return None
    magic, version, _, n, stored_key, digest = HEADER.unpack_from(data)
    view = memoryview(data)[HEADER.size :]
    if (magic, version, n, stored_key) != (MAGIC, VERSION, sum(sizes), key):
        return None
    if checksum(view) != digest:
        return None
    buf = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    out: list[torch.Tensor] = []
    off = 0
    for t, size in zip(like, sizes):
        out.append(buf[off : off + size].view(t.dtype).view(t.shape))
        off += size
    return out


class StorageMetrics(NamedTuple):
    """Monotonic L3 counters (hits/misses count page reads; a timeout is also a miss)."""

    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    timeouts: int = 0
    read_seconds: float = 0.0


class KVStorage(ABC):
    """An L3 page store for one model and KV layout.

    Every method is a best effort that never raises for the store's own failures: a
    store that cannot answer in time answers "absent" (a miss), and one that failed for
    good turns ``enabled`` off; the cache then runs on L1 and L2 alone.
    """

    enabled: bool
    writes: int  # pages stored
    corrupt: int  # records rejected by the size/checksum check
    listener: TierListener | None
    # Write each page into L3 as soon as the tree takes it (a store shared by workers), not
    # only when L2 spills it (a store for restarts).
    write_through: bool = False
    name: str = "L3"

    @abstractmethod
    def contains(self, key: PageKey) -> bool:
        """Whether ``key`` is (probably) stored; :meth:`read` verifies."""

    @abstractmethod
    def write(self, key: PageKey, rows: list[torch.Tensor]) -> bool:
        """Store one page (``rows``: its slice of every page tensor, on the host). Returns
        False when the store is off."""

    @abstractmethod
    def read(self, key: PageKey, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The page ``key`` shaped like ``like``, or None (absent, corrupt, too slow)."""

    def metrics(self) -> StorageMetrics:
        return StorageMetrics()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s``) until the writes handed over so far are stored."""
        return None

    def close(self) -> None:
        """Release the store's connections (bounded; never raises)."""
        return None
