"""L3 on a Mooncake Store cluster: KV pages any worker on any host can find by page key.

::

    worker A ──put(key, record)──> Mooncake Store (master: object index; every client's
    worker B <──get(key)────────── mounted segment: the bytes, moved by the transfer engine
                                   over tcp or rdma)

Keys are ``rs/<layout digest>/<page key hex>``: the page key already chains the model, the
KV layout, the page size and the tenant namespace (``page_hash``), and the digest names the
L3 record layout (L2's dtype), so two workers share a page only when its bytes mean the same
to both. Records are ``kv_storage`` records (checksummed): a mismatch is a miss.

Nothing here may stall a decode step: every call runs on a thread of this store and is
waited for at most ``timeout_s``; one that takes longer is a miss (counted as a timeout)
and, while it is still stuck, further reads are misses at once instead of queueing behind
it (a stalled master holds a call for its RPC timeout, 30 s). Writes are handed to a writer
thread (at most ``max_pending_writes`` queued; more are dropped and counted). A master that
is gone answers at once with an error: a miss. The one wait that is not bounded is the
client's ``setup`` at start-up (Mooncake's binding holds the GIL through it): it runs before
the worker is ready, so no step waits on it; a master that refuses fails it at once (L3
off, with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from radixserve.memory.kv_storage import KVStorage, StorageMetrics, pack_page, unpack_page
from radixserve.memory.page_hash import PageKey

if TYPE_CHECKING:
    from radixserve.memory.interfaces import TierListener

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SIZE_SUFFIXES: tuple[tuple[str, int], ...] = (
    ("kb", 2**10),
    ("mb", 2**20),
    ("gb", 2**30),
    ("tb", 2**40),
    ("k", 2**10),
    ("m", 2**20),
    ("g", 2**30),
    ("t", 2**40),
    ("b", 1),
)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a Mooncake size string ("64mb", "3.125gb")."""
    if isinstance(value, int):
        return value
    s = value.strip().lower()
    for suffix, mult in _SIZE_SUFFIXES:
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """Mooncake's own config-file fields (``MOONCAKE_CONFIG_PATH`` format), plus our waits.

    ``metadata_server`` is the transfer engine's metadata service: ``http://host:port/metadata``
    (the master's built-in HTTP one), an etcd address, or ``P2PHANDSHAKE``.
    ``global_segment_size`` is the memory this worker contributes to the cluster's store;
    ``local_buffer_size`` its transfer buffer.
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"  # tcp | rdma
    device_name: str = ""  # RDMA NICs ("mlx5_0,mlx5_1"); "" with tcp
    global_segment_size: int = 256 * 2**20
    local_buffer_size: int = 64 * 2**20
    # radixserve's own: how long a read, and the start-up, may take before it is a miss.
    timeout_s: float = 0.5
    close_timeout_s: float = 10.0  # flushing writes and closing the client at shutdown
    max_pending_writes: int = 1024

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> MooncakeStoreConfig:
        """Read a Mooncake config file (JSON); ``overrides`` (flags) win over it."""
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            logger.info("mooncake config %s: ignoring %s", path, ", ".join(unknown))
        kw = {k: v for k, v in raw.items() if k in known}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls.create(**kw)

    @classmethod
    def create(cls, **kw: Any) -> MooncakeStoreConfig:
        for k in ("global_segment_size", "local_buffer_size"):
            if k in kw:
                kw[k] = parse_size(kw[k])
        if "protocol" in kw:
            kw["protocol"] = str(kw["protocol"]).strip().lower()
        if not kw.get("master_server_address"):
            raise ValueError("the Mooncake store needs master_server_address (HOST:PORT)")
        return replace(cls(master_server_address=kw.pop("master_server_address")), **kw)


class _Lane:
    """One daemon thread running calls in order. Not a ThreadPoolExecutor: the interpreter
    joins those at exit, and a call stuck on a stalled master must not hold up a shutdown."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fut, fn))
        return fut

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)


class MooncakeKVStore(KVStorage):
    """Pages for one model and KV layout (``identity``) in a Mooncake Store cluster."""

    write_through = True
    name = "mooncake"

    def __init__(self, config: MooncakeStoreConfig, identity: str) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                f"--hicache-storage-backend mooncake needs the Mooncake wheel "
                f"(pip install 'radixserve[mooncake]') and its libraries: {e}"
            ) from e
        self.config = config
        self.prefix = "rs/" + hashlib.blake2b(identity.encode(), digest_size=8).hexdigest() + "/"
        self.enabled = True
        self.writes = self.reads = self.corrupt = 0
        self.dropped_writes = self.failed_writes = 0
        self.listener: TierListener | None = None
        self._m = StorageMetrics()
        self._lock = threading.Lock()  # the writer thread updates counters too
        self._written: OrderedDict[PageKey, None] = OrderedDict()  # keys this process stored
        self._pending = 0
        self._stuck: Future[Any] | None = None
        self._reader = _Lane("mooncake-read")
        self._writer = _Lane("mooncake-write")
        self._store = MooncakeDistributedStore()
        self._ready = self._closed = self._master_lost = False
        self._setup()

    def _setup(self) -> None:
        c = self.config
        rc = self._store.setup(
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device_name,
            c.master_server_address,
        )
        if rc != 0:
            self.enabled = False
            logger.warning(
                "mooncake store: setup with master %s failed (code %d); L3 is off",
                c.master_server_address,
                rc,
            )
        else:
            self._ready = True

    # ------------------------------------------------------------------ bounded calls
    def _call(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` on the reader thread, or None when the store is off, not ready, still
        stuck in an earlier call, or slower than ``timeout_s``."""
        if not (self.enabled and self._ready):
            return None
        if self._stuck is not None:
            if not self._stuck.done():
                self._count(timeouts=1)
                return None
            self._stuck = None
        fut = self._reader.submit(fn)
        try:
            return fut.result(self.config.timeout_s)
        except FutureTimeout:
            self._stuck = fut
            self._master_lost = True  # until a later call answers
            self._count(timeouts=1)
            return None
        except Exception as e:  # the binding raising is the store failing: a miss
            logger.debug("mooncake store: %s", e)
            return None

    def _count(self, **inc: float) -> None:
        with self._lock:
            m = self._m
            self._m = m._replace(**{k: getattr(m, k) + v for k, v in inc.items()})

    def metrics(self) -> StorageMetrics:
        return self._m

    def object_key(self, key: PageKey) -> str:
        return self.prefix + key.hex()

    # ------------------------------------------------------------------ KVStorage
    def contains(self, key: PageKey) -> bool:
        k = self.object_key(key)
        rc = self._call(lambda: self._store.is_exist(k))
        if rc is not None:  # RPC_FAIL and the like (< 0): the master is unreachable
            self._master_lost = rc < 0
        if rc != 1:  # a lookup that L3 cannot serve (absent, store gone, too slow)
            self._count(misses=1)
        return rc == 1

    def write(self, key: PageKey, rows: list[torch.Tensor]) -> bool:
        if not self.enabled:
            return False
        if key in self._written:
            self._written.move_to_end(key)
            return True
        # With the master unreachable a put takes seconds to fail: drop the page (a later
        # lookup that the master answers clears _master_lost).
        if self._pending >= self.config.max_pending_writes or not self._ready or self._master_lost:
            self.dropped_writes += 1
            return True
        record = pack_page(key, rows)  # copied now: the slot may be reused before the put
        with self._lock:
            self._pending += 1
        self._writer.submit(lambda: self._put(key, record))
        self._written[key] = None
        if len(self._written) > 1 << 16:
            self._written.popitem(last=False)
        self.writes += 1
        if self.listener is not None:
            self.listener.tier_stored("L3", [key])
        return True

    def _put(self, key: PageKey, record: bytes) -> None:
        if self._master_lost:  # queued before the master was lost: it would take seconds to fail
            with self._lock:
                self._pending -= 1
                self.dropped_writes += 1
            self._written.pop(key, None)
            return
        try:
            rc = self._store.put(self.object_key(key), record)
        except Exception:
            rc = -1
        with self._lock:
            self._pending -= 1
        # An object already there (another worker stored the same prefix) is fine.
        if rc == 0:
            self._count(written_bytes=len(record))
            self._master_lost = False
        elif not self._store_has(key):
            self.failed_writes += 1
            self._written.pop(key, None)

    def _store_has(self, key: PageKey) -> bool:
        try:
            return bool(self._store.is_exist(self.object_key(key)) == 1)
        except Exception:
            return False

    def read(self, key: PageKey, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        k = self.object_key(key)
        t0 = time.perf_counter()
        data = self._call(lambda: self._store.get(k))
        out = unpack_page(key, data, like) if data else None
        self._count(
            hits=out is not None,
            misses=out is None,
            read_bytes=len(data) if data else 0,
            read_seconds=time.perf_counter() - t0,
        )
        if data and out is None:
            self.corrupt += 1
            logger.warning("mooncake store: page %s failed its checksum; recomputing it", k)
            self._written.pop(key, None)
            self._writer.submit(lambda: self._remove(k))
            if self.listener is not None:
                self.listener.tier_removed("L3", [key])
            return None
        if out is not None:
            self.reads += 1
        return out

    def _remove(self, k: str) -> None:
        try:
            self._store.remove(k)
        except Exception:
            pass

    def flush(self, timeout_s: float | None = None) -> None:
        try:
            self._writer.submit(lambda: None).result(timeout_s)
        except FutureTimeout:
            logger.warning("mooncake store: %d writes still pending", self._pending)

    def close(self) -> None:
        """Flush (bounded) and close the client, only when no call is in flight: closing it
        under one crashes the process, so a client still stuck in a call (a stalled master)
        is left to the process's exit."""
        if self._closed:
            return
        self._closed = True
        t = self.config.close_timeout_s
        idle = self._drained(self._writer, t) and self._drained(self._reader, t)
        self.enabled = False
        self._reader.stop()
        self._writer.stop()
        if not idle:
            logger.warning("mooncake store: a call is still in flight; leaving the client open")
            return
        self._store.close()

    @staticmethod
    def _drained(lane: _Lane, timeout_s: float) -> bool:
        """Whether every call handed to ``lane`` so far finished within ``timeout_s``."""
        try:
            lane.submit(lambda: None).result(timeout_s)
        except FutureTimeout:
            return False
        return True
