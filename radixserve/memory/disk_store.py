"""L3: KV pages as files in a directory, keyed by page key, shared across restarts and workers.

::

    <storage_dir>/<layout digest>/<key[:2] hex>/<key hex>.kv

    file = header | payload
    header  magic "RSKV", version u16, reserved u16, payload bytes u64, key 16 B, BLAKE2b-16 of payload
    payload the page's rows of every page-indexed pool tensor (K, V, per-token scales), raw bytes

The directory level named after the layout (model + KV layout digest) keeps pools of
different shapes apart even before the key (which also folds them in) is compared. Files
are written to a temporary name and renamed into place, so a reader (a restarted server,
another worker on this host) sees a whole file or none. A read checks size, magic, version,
key and checksum: a truncated or corrupt file is a miss (and is removed), never served.
A failed write (disk full, read-only, permissions) turns the store off with one warning: the
cache keeps working with L1 and L2 only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve.memory.page_hash import DIGEST_SIZE, PageKey

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHQ16s16s")
_MAGIC = b"RSKV"
_VERSION = 1


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()


class DiskKVStore:
    """Page files for one model and KV layout (``identity``) under ``root``."""

    def __init__(self, root: str | os.PathLike[str], identity: str) -> None:
        self.root = Path(root)
        self.dir = self.root / hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.enabled = True
        self.writes = self.reads = self.corrupt = 0
        self.listener: TierListener | None = None  # KV events (the hierarchy sets it)

    def path(self, key: PageKey) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def contains(self, key: PageKey) -> bool:
        """Whether a file for ``key`` exists (not yet verified: :meth:`read` does that)."""
        return self.enabled and self.path(key).is_file()

    def write(self, key: PageKey, rows: list[torch.Tensor]) -> bool:
        """Write one page (``rows``: its slice of every page tensor, on the host). Returns
        False when the store is (or just got) disabled. An existing file is kept."""
        if not self.enabled:
            return False
        path = self.path(key)
        if path.is_file():
            return True
        payload = b"".join(r.contiguous().view(torch.uint8).numpy().tobytes() for r in rows)
        header = _HEADER.pack(_MAGIC, _VERSION, 0, len(payload), key, _checksum(payload))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self.enabled = False
            logger.warning(
                "hierarchical cache: writing %s failed (%s); L3 disk storage is off from now on",
                path,
                e,
            )
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        self.writes += 1
        if self.listener is not None:
            self.listener.tier_stored("L3", [key])
        return True

    def read(self, key: PageKey, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Read the page ``key`` as tensors shaped and typed like ``like`` (one page's rows),
        or None when absent, truncated or corrupt (the bad file is removed)."""
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        sizes = [t.numel() * t.element_size() for t in like]
        ok = len(data) == _HEADER.size + sum(sizes)
        if ok:
            magic, version, _, n, stored_key, checksum = _HEADER.unpack_from(data)
            view = memoryview(data)[_HEADER.size :]
            ok = (magic, version, n, stored_key) == (
                _MAGIC,
                _VERSION,
                sum(sizes),
                key,
            ) and _checksum(view) == checksum
        if not ok:
            self.corrupt += 1
            logger.warning(
                "hierarchical cache: %s is truncated or corrupt; recomputing that page", path
            )
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            if self.listener is not None:
                self.listener.tier_removed("L3", [key])
            return None
        out: list[torch.Tensor] = []
        buf = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        off = 0
        for t, size in zip(like, sizes):
            out.append(buf[off : off + size].view(t.dtype).view(t.shape))
            off += size
        self.reads += 1
        return out

    def num_files(self) -> int:
        """Page files present (O(files); for tests and stats)."""
        return sum(1 for _ in self.dir.glob("*/*.kv"))
