"""Two workers (separate processes, separate storage roots) share a prefix through a real
Mooncake Store on 127.0.0.1; tenants do not; a master killed mid-run gives misses."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import greedy, random_prompts
from mooncake_helpers import Master, run_master, worker_main

N = 6


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    with run_master(tmp_path / "master.log") as m:
        yield m


def _engine_kw(master: Master, root: Path) -> dict[str, Any]:
    return {
        "page_size": 4,
        "num_pages": 64,
        "hicache_storage_dir": str(root),  # unused by the mooncake backend: each its own
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": json.dumps(master.config),
    }


class _Worker:
    """An Engine in a spawned process (tests/mooncake_helpers.worker_main)."""

    def __init__(self, model_dir: Path, kw: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, str(model_dir), kw))
        self.proc.start()

    def ready(self) -> None:
        assert self.conn.poll(300) and self.conn.recv() == "ready"

    def run(self, prompt: list[int], namespace: str | None = None) -> tuple[list[int], int, Any]:
        self.conn.send(("run", prompt, namespace, N))
        assert self.conn.poll(300)
        out: tuple[list[int], int, Any] = self.conn.recv()
        return out

    def flush(self) -> None:
        """Until every page this worker handed to the store has landed there."""
        self.conn.send(("flush",))
        assert self.conn.poll(60) and self.conn.recv() == "flushed"

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.conn.poll(60)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.mark.slow  # two spawned engine processes
def test_two_workers_share_a_prefix_and_tenants_do_not(
    tiny_llama_dir: Path, make_engine, master: Master, tmp_path: Path
) -> None:
    system, q1, q2 = random_prompts([32, 5, 5], seed=47)
    a = _Worker(tiny_llama_dir, _engine_kw(master, tmp_path / "a"))
    b = _Worker(tiny_llama_dir, _engine_kw(master, tmp_path / "b"))
    try:
        a.ready()
        b.ready()
        _, cached, _ = a.run(system + q1)
        assert cached == 0
        a.run(system + q1, "tenant-a")
        # A's pages went to the store as its tree took them (write-through, on a writer
        # thread: the flush waits for them to land). B, which never saw this prompt, loads
        # the 32 system tokens from L3.
        a.flush()
        tokens, cached, stats = b.run(system + q2)
        assert cached == 32
        assert stats.loaded_storage_pages_total == 8 and stats.storage_hits_total == 8
        assert stats.storage_read_bytes_total > 0
        # Another tenant's copy of the same prompt is not shared.
        _, cached_b, stats_b = b.run(system + q1, "tenant-b")
        assert cached_b == 0 and stats_b.loaded_storage_pages_total == 8
    finally:
        a.stop()
        b.stop()
    (cold,) = make_engine(tiny_llama_dir, page_size=4, num_pages=64).generate(
        [system + q2], greedy(N)
    )
    assert tokens == cold.token_ids


def test_master_killed_mid_run_gives_misses_not_errors(
    tiny_llama_dir: Path, make_engine, master: Master, tmp_path: Path
) -> None:
    p1, p2 = random_prompts([24, 24], seed=48)
    engine = make_engine(tiny_llama_dir, **_engine_kw(master, tmp_path))
    (first,) = engine.generate([p1], greedy(N))
    master.proc.kill()
    master.proc.wait(30)
    (second,) = engine.generate([p2], greedy(N))
    s = engine.stats()
    assert s.storage_misses_total >= 1 and s.storage_hits_total == 0
    assert second.usage.cached_tokens == 0
    cold = make_engine(tiny_llama_dir, page_size=4, num_pages=64)
    assert [first.token_ids, second.token_ids] == [
        o.token_ids for o in cold.generate([p1, p2], greedy(N))
    ]
    engine.check_invariants()
    engine.close()
