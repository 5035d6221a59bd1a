"""Miss reports through the real engine (tiny Llama): asked per request
(``return_cache_report``) or for all (``cache_report``), sent once in usage, counted in
the engine's stats (divergence positions for every prompt; a flush as its own reason); a
session closed from the API releases its lease."""

from __future__ import annotations

from pathlib import Path

import msgspec
from engine_helpers import greedy, random_prompts

from radixserve.engine.outputs import CacheReport


def test_a_request_that_asks_gets_where_its_prompt_diverged(
    tiny_llama_dir: Path, make_engine
) -> None:
    engine = make_engine(tiny_llama_dir, num_pages=64)
    head, a, b = random_prompts([30, 10, 10], seed=5)
    first = engine.generate([head + a], greedy(2))[0]
    assert first.usage.cache_report is msgspec.UNSET  # not asked: absent
    out = engine.generate([head + b], greedy(2, return_cache_report=True))[0]
    rep = out.usage.cache_report
    assert isinstance(rep, CacheReport)
    assert rep.reason == "never_cached" and rep.diverged_at == 30 and rep.cached_tokens == 28
    assert rep.before == head[-4:] and rep.after == b[:4] and rep.cached_after == a[:4]
    assert out.usage.cached_tokens == 28
    stats = engine.stats()
    assert stats.cache_reports_total == 1 and stats.cache_miss_reasons["never_cached"] == 1
    assert {e["index"]: e["count"] for e in stats.cache_divergence_top} == {0: 1, 30: 1}
    # Positions count every prompt (the first, not asked, diverged at 0 in an empty tree).
    assert stats.cache_divergence_prompts_total == 2
    assert stats.cache_divergence_buckets["0"] == 1 and stats.cache_divergence_buckets["64"] == 2
    # A flush is its own reason, not an eviction.
    assert engine.flush_cache()
    again = engine.generate([head + b], greedy(2, return_cache_report=True))[0]
    rep = again.usage.cache_report
    assert isinstance(rep, CacheReport) and rep.reason == "flushed" and rep.evicted_by is None
    stats = engine.stats()
    assert stats.cache_flushes_total == 1 and stats.cache_flushed_pages_total > 0
    assert stats.evicted_pages_total == 0


def test_cache_report_for_every_request_and_session_close(
    tiny_llama_dir: Path, make_engine
) -> None:
    engine = make_engine(tiny_llama_dir, num_pages=64, cache_report=True)
    prompt = random_prompts([21], seed=6)[0]
    rid = engine.add_request(prompt, greedy(3), session_id="agent")
    while engine.has_unfinished():
        engine.step()
    again = engine.generate([prompt], greedy(2))[0]  # not asked, reported anyway
    assert isinstance(again.usage.cache_report, CacheReport)
    assert again.usage.cache_report.reason == "fully_cached"
    assert engine.stats().leases_active == 1 and rid
    assert engine.close_session("agent") and not engine.close_session("agent")
    stats = engine.stats()
    assert stats.leases_active == 0 and stats.leased_pages == 0
    assert stats.cache_reports_total == 2
