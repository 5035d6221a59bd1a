"""L2/L3 tiers under the radix cache: demotion, load-back, restarts, corruption, full disk, tenants.

Pages hold their own token ids (one layer, one head, head_dim 1), so reading a page back
shows exactly which prefix's KV it holds.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from radixserve.memory import KVPool, PageAllocator
from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy

PS = 2


class Tiered:
    """An L1 of ``l1`` pages over an L2 of ``l2`` pages and an optional L3 directory."""

    def __init__(self, l1: int, l2: int, storage: Path | None = None, model: str = "m") -> None:
        self.pool = KVPool(1, l1, PS, 1, 1)
        self.flat = self.pool.k_data[0].view(-1)
        self.alloc = PageAllocator(l1)
        self.hier = KVHierarchy(self.pool, l2, storage, model)
        self.cache = HiRadixCache(self.alloc, PS, self.hier)

    def put(self, tokens: list[int], ns: str | None = None) -> None:
        """Compute (write) ``tokens``' KV and cache it, as a finished request would."""
        pages = self.alloc.alloc(len(tokens) // PS)
        for i, t in enumerate(tokens):
            self.flat[pages[i // PS] * PS + i % PS] = t
        cached = self.cache.insert(tokens, pages, ns)
        self.alloc.free(pages[: cached // PS])
        self.cache.check_invariants()

    def match(self, tokens: list[int], ns: str | None = None) -> tuple[int, list[int]]:
        """Matched length and the tokens the matched pages hold."""
        m = self.cache.match_prefix(tokens, ns)
        self.cache.check_invariants()
        held = [int(self.flat[p * PS + i]) for p in m.pages for i in range(PS)]
        return m.matched_len, held


A = list(range(100, 108))  # 4 pages
B = list(range(200, 208))
C = list(range(300, 308))


def test_eviction_demotes_and_a_match_loads_the_whole_prefix_back() -> None:
    t = Tiered(l1=4, l2=8)
    t.put(A)
    t.put(B)  # L1 holds 4 pages: A is evicted to L2 to make room
    assert t.hier.stats.demoted_pages == 4 and t.cache.num_cached_pages == 4
    n, held = t.match(A + [1])
    assert n == 8 and held == A  # B goes down to L2, A comes back
    s = t.hier.stats
    assert s.loaded_l2_pages == 4 and s.demoted_pages == 8
    assert all(tiers == {"L1", "L2"} for tiers in t.cache.tiers(t.cache.match_prefix(A).node))
    assert t.cache.stats.hit_tokens == 16  # the explicit re-match counted too


def test_partial_l1_hit_continues_from_l2() -> None:
    t = Tiered(l1=4, l2=8)
    t.put(A)
    t.cache.evict(2)  # A's last two pages go to L2; its first two stay in L1
    assert t.cache.num_cached_pages == 2 and t.hier.host.num_cached == 2
    n, held = t.match(A)
    assert n == 8 and held == A and t.hier.stats.loaded_l2_pages == 2


def test_l2_spills_to_l3_by_lru_and_loads_from_there(tmp_path: Path) -> None:
    t = Tiered(l1=4, l2=4, storage=tmp_path)
    for seq in (A, B, C):  # A: L1 -> L2; B: L1 -> L2 pushes A to L3
        t.put(seq)
    assert (
        t.hier.stats.l3_written_pages == 4
        and t.hier.disk is not None
        and t.hier.disk.num_files() == 4
    )
    n, held = t.match(A)
    assert n == 8 and held == A and t.hier.stats.loaded_l3_pages == 4


def test_restart_over_the_same_directory_is_warm(tmp_path: Path) -> None:
    t = Tiered(l1=8, l2=4, storage=tmp_path)
    t.put(A)
    t.put(B)
    assert t.cache.persist() == 8  # what a clean shutdown writes
    fresh = Tiered(l1=8, l2=4, storage=tmp_path)
    assert fresh.cache.num_cached_pages == 0
    assert fresh.match(B + [9]) == (8, B)
    assert fresh.hier.stats.loaded_l3_pages == 4
    other_model = Tiered(l1=8, l2=4, storage=tmp_path, model="another")
    assert other_model.match(B)[0] == 0  # never another model's (or layout's) pages


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_page_files_are_misses_never_served(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = Tiered(l1=8, l2=4, storage=tmp_path)
    t.put(A)
    t.cache.persist()
    disk = t.hier.disk
    assert disk is not None
    third = disk.path(t.hier.hasher.keys(A)[2])  # page 3 of A
    data = bytearray(third.read_bytes())
    if damage == "truncate":
        data = data[:-3]
    else:
        data[-1] ^= 0x01
    third.write_bytes(bytes(data))
    fresh = Tiered(l1=8, l2=4, storage=tmp_path)
    with caplog.at_level(logging.WARNING):
        n, held = fresh.match(A)
    assert n == 4 and held == A[:4]  # stops before the bad page: the rest is recomputed
    assert fresh.hier.stats.l3_corrupt_pages == 1 and not third.exists()
    assert "corrupt" in caplog.text


def test_full_disk_degrades_to_no_l3_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = Tiered(l1=4, l2=4, storage=tmp_path)

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("radixserve.memory.disk_store.os.replace", full)
    with caplog.at_level(logging.WARNING):
        for seq in (A, B, C):
            t.put(seq)
    assert not t.hier.l3_enabled and "L3 disk storage is off" in caplog.text
    assert caplog.text.count("L3 disk storage is off") == 1
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))
    assert t.match(B) == (8, B)  # L1 + L2 still serve
    t.put(A)


def test_namespaces_never_share_pages_in_any_tier(tmp_path: Path) -> None:
    t = Tiered(l1=4, l2=8, storage=tmp_path)
    t.put(A, ns="tenant-a")
    t.put(B, ns="tenant-a")  # A demoted to L2 under tenant-a's keys
    t.cache.persist()
    assert set(t.hier.hasher.keys(A, "tenant-a")).isdisjoint(t.hier.hasher.keys(A, "tenant-b"))
    assert set(t.hier.hasher.keys(A, "tenant-a")).isdisjoint(t.hier.hasher.keys(A))
    assert t.match(A, ns="tenant-b")[0] == 0
    assert t.match(A)[0] == 0
    assert t.match(A, ns="tenant-a") == (8, A)
