"""Usage says where a request's cached prompt tokens came from: device memory (L1), the
hierarchical cache's host memory (L2) or its page files on disk (L3)."""

from __future__ import annotations

from pathlib import Path

from engine_helpers import greedy, random_prompts


def test_cached_tokens_split_by_tier(tiny_llama_dir: Path, make_engine, tmp_path: Path) -> None:
    a, b = random_prompts([40, 40], seed=90)
    engine = make_engine(
        tiny_llama_dir,
        page_size=4,
        num_pages=14,  # one 40-token prompt and its output at a time
        enable_hierarchical_cache=True,
        hicache_size=0.001,
        hicache_storage_dir=str(tmp_path),
        session_leases="off",
    )
    (cold,) = engine.generate([a], greedy(4))
    assert cold.usage.cached_tokens == 0
    (again,) = engine.generate([a + [5]], greedy(4))  # still in L1
    u = again.usage
    assert u.cached_tokens == 40 and u.cached_host_tokens == u.cached_disk_tokens == 0
    engine.generate([b], greedy(4))  # pushes a out of L1 into L2
    (back,) = engine.generate([a + [6]], greedy(4))
    u = back.usage
    assert u.cached_tokens == 40 and u.cached_host_tokens > 0
    assert u.cached_host_tokens + u.cached_disk_tokens <= u.cached_tokens
    engine.check_invariants()
    engine.close()

    warm = make_engine(tiny_llama_dir, page_size=4, num_pages=64, hicache_storage_dir=str(tmp_path))
    (restart,) = warm.generate([b + [7]], greedy(4))  # a restart: only L3 has it
    u = restart.usage
    assert u.cached_tokens == 40 and u.cached_disk_tokens == 40 and u.cached_host_tokens == 0
