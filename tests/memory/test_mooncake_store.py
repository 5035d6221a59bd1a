"""The Mooncake L3 against a real ``mooncake_master`` on 127.0.0.1: pages round-trip between
two clients, a corrupt record is a miss, namespaces and layouts never share a key, and a
master killed mid-run gives misses (counted), not errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mooncake_helpers import Master, run_master

from radixserve.memory.kv_storage import pack_page
from radixserve.memory.mooncake_store import MooncakeKVStore, MooncakeStoreConfig, parse_size
from radixserve.memory.page_hash import PrefixHasher


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    with run_master(tmp_path / "master.log") as m:
        yield m


def _rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 2, 8, generator=g), torch.randn(2, 4, 2, 8, generator=g)]


def _like() -> list[torch.Tensor]:
    return [torch.empty(2, 4, 2, 8), torch.empty(2, 4, 2, 8)]


def _store(master: Master, identity: str = "m|L2") -> MooncakeKVStore:
    return MooncakeKVStore(MooncakeStoreConfig.create(**master.config), identity)


def test_config_file_in_mooncakes_format_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "mooncake.json"
    f.write_text(
        '{"local_hostname": "node1", "metadata_server": "P2PHANDSHAKE", "protocol": "RDMA",'
        ' "device_name": "mlx5_0", "master_server_address": "master:50051",'
        ' "global_segment_size": "3.125gb", "local_buffer_size": 1073741824, "tenant_id": "x"}'
    )
    c = MooncakeStoreConfig.from_file(f, master_server_address="m2:1", timeout_s=0.1)
    assert (c.protocol, c.device_name, c.local_hostname) == ("rdma", "mlx5_0", "node1")
    assert c.global_segment_size == int(3.125 * 2**30) and c.local_buffer_size == 2**30
    assert c.master_server_address == "m2:1" and c.timeout_s == 0.1
    assert parse_size("64mb") == 64 * 2**20
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeStoreConfig.create(protocol="tcp")


def test_engine_config_names_the_backend_and_needs_a_master() -> None:
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.prefix_cache import l3_factory

    with pytest.raises(ValueError, match="hicache_storage_backend"):
        EngineConfig(hicache_storage_backend="s3")
    cfg = EngineConfig(hicache_storage_backend="mooncake")
    assert cfg.hierarchical_cache and l3_factory(EngineConfig()) is None
    with pytest.raises(ValueError, match="master_server_address"):
        l3_factory(cfg)


def test_pages_round_trip_between_clients_and_a_corrupt_record_is_a_miss(master: Master) -> None:
    a, b = _store(master), _store(master)
    try:
        keys = PrefixHasher("m|L1", 4).keys(list(range(12)))
        for i, k in enumerate(keys):
            assert a.write(k, _rows(i))
        a.flush(10)
        assert a.metrics().written_bytes == sum(len(pack_page(k, _rows(0))) for k in keys)
        assert all(b.contains(k) for k in keys)
        for i, k in enumerate(keys):
            got = b.read(k, _like())
            assert got is not None and all(torch.equal(x, y) for x, y in zip(got, _rows(i)))
        # Another model's layout (another identity) never sees them.
        other = _store(master, "m|other-layout")
        try:
            assert not other.contains(keys[0]) and other.read(keys[0], _like()) is None
        finally:
            other.close()
        # Flip one payload byte under the page's key: the checksum turns it into a miss.
        bad = bytearray(pack_page(keys[1], _rows(1)))
        bad[-1] ^= 0xFF
        ok = b._store.upsert(b.object_key(keys[1]), bytes(bad))
        assert ok == 0
        assert b.read(keys[1], _like()) is None and b.corrupt == 1
        m = b.metrics()
        assert (m.hits, m.misses) == (3, 1) and m.read_bytes > 0 and m.read_seconds > 0
    finally:
        a.close()
        b.close()


def test_tenant_namespaces_never_share_a_key(master: Master) -> None:
    h = PrefixHasher("m|L1", 4)
    tokens = list(range(8))
    s = _store(master)
    try:
        for k in h.keys(tokens, "tenant-a"):
            s.write(k, _rows(0))
        s.flush(10)
        assert all(s.contains(k) for k in h.keys(tokens, "tenant-a"))
        assert not any(s.contains(k) for k in h.keys(tokens, "tenant-b"))
        assert not any(s.contains(k) for k in h.keys(tokens))
    finally:
        s.close()


def test_a_dead_master_gives_misses_not_errors(master: Master) -> None:
    s = _store(master)
    try:
        key = PrefixHasher("m|L1", 4).keys(list(range(4)))[0]
        s.write(key, _rows(0))
        s.flush(10)
        assert s.contains(key)
        master.proc.kill()
        master.proc.wait(30)
        assert not s.contains(key)
        assert s.read(key, _like()) is None
        other = PrefixHasher("m|L1", 4).keys(list(range(4, 8)))[0]
        assert s.write(other, _rows(1)) and s.dropped_writes == 1  # no put to a lost master
        assert s.metrics().misses == 2 and s.metrics().hits == 0
    finally:
        s.close()


def test_a_stalled_master_is_a_miss_within_the_timeout(master: Master) -> None:
    """A master that stops answering (SIGSTOP): a read gives up after ``timeout_s`` and the
    next ones are misses at once while that call is stuck; nothing raises."""
    import signal

    s = MooncakeKVStore(MooncakeStoreConfig.create(**{**master.config, "timeout_s": 0.3}), "m|L2")
    key = PrefixHasher("m|L1", 4).keys(list(range(4)))[0]
    s.write(key, _rows(0))
    s.flush(10)
    master.proc.send_signal(signal.SIGSTOP)
    # The signal lands asynchronously: a request sent before the master stops is still
    # answered (a hit, seen once in CI). Wait until the kernel reports the child stopped.
    os.waitpid(master.proc.pid, os.WUNTRACED)
    try:
        assert s.read(key, _like()) is None
        assert not s.contains(key)
        m = s.metrics()
        assert (m.hits, m.misses, m.timeouts) == (0, 2, 2)
    finally:
        master.proc.send_signal(signal.SIGCONT)
        s.close()
