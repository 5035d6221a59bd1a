"""The hierarchical cache in the engine: greedy outputs identical with it on and off, through
demotion, load-back, restart and a corrupt page file; a restart is served from L3."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_helpers import greedy, random_prompts

from radixserve.engine.engine import Engine

N = 6


def _workload() -> list[list[int]]:
    """Four 32-token system prompts, three questions each, interleaved so that each system
    prompt returns after the others have pushed it out of a small L1."""
    systems = random_prompts([32] * 4, seed=40)
    questions = random_prompts([5] * 12, seed=41)
    prompts = [systems[i % 4] + q for i, q in enumerate(questions)]
    random.Random(0).shuffle(prompts)
    return prompts


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One request at a time (each arrives after the previous finished): tokens and cached counts."""
    tokens, cached = [], []
    for p in prompts:
        (out,) = engine.generate([p], greedy(N))
        tokens.append(out.token_ids)
        cached.append(out.usage.cached_tokens)
        engine.check_invariants()
    return tokens, cached


def test_outputs_identical_and_hits_recovered_through_demotion_and_load_back(
    tiny_llama_dir: Path, make_engine
) -> None:
    prompts = _workload()
    # 12 pages of 4 tokens: one system prompt (8 pages) and its request, never two.
    plain = make_engine(tiny_llama_dir, page_size=4, num_pages=12)
    tiered = make_engine(
        tiny_llama_dir,
        page_size=4,
        num_pages=12,
        enable_hierarchical_cache=True,
        hicache_size=0.001,
    )
    ref, plain_cached = _run(plain, prompts)
    got, tiered_cached = _run(tiered, prompts)
    assert got == ref
    s = tiered.stats()
    assert s.demoted_pages_total > 0 and s.loaded_host_pages_total > 0
    # Every return of a system prompt is a hit with L2; without it, only back-to-back repeats are.
    assert sum(tiered_cached) >= 8 * 32 > sum(plain_cached)
    assert s.pages_in_use == 0


def test_restart_with_the_same_storage_dir_serves_from_l3(
    tiny_llama_dir: Path, make_engine, tmp_path: Path
) -> None:
    prompt = random_prompts([40], seed=42)[0]
    first = make_engine(
        tiny_llama_dir, page_size=4, num_pages=64, hicache_storage_dir=str(tmp_path)
    )
    (cold,) = first.generate([prompt], greedy(N))
    assert cold.usage.cached_tokens == 0
    first.close()
    assert first.stats().storage_written_pages_total >= 40 // 4

    second = make_engine(
        tiny_llama_dir, page_size=4, num_pages=64, hicache_storage_dir=str(tmp_path)
    )
    (warm,) = second.generate([prompt], greedy(N))
    assert warm.token_ids == cold.token_ids
    assert (
        warm.usage.cached_tokens == 40 // 4 * 4 - 4
    )  # whole pages of the prompt but its last token's
    assert second.stats().loaded_storage_pages_total == warm.usage.cached_tokens // 4
    second.check_invariants()

    # A damaged page file is detected and recomputed, never served.
    second.close()
    files = sorted(tmp_path.rglob("*.kv"))
    for f in files:
        f.write_bytes(f.read_bytes()[:-1])
    third = make_engine(
        tiny_llama_dir, page_size=4, num_pages=64, hicache_storage_dir=str(tmp_path)
    )
    (again,) = third.generate([prompt], greedy(N))
    assert again.token_ids == cold.token_ids and again.usage.cached_tokens == 0
    assert third.stats().storage_corrupt_pages_total == 1  # the first page: the match stops there


def test_flags_map_to_the_engine_config() -> None:
    import argparse

    from radixserve.commands.engine_args import add_engine_arguments, engine_config
    from radixserve.engine.config import EngineConfig

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    cfg = engine_config(
        ap.parse_args(
            [
                "--enable-hierarchical-cache",
                "--hicache-size",
                "1.5",
                "--hicache-storage-dir",
                "/tmp/kv",
                "--hicache-dtype",
                "fp8_e4m3",
            ]
        )
    )
    assert cfg == {
        "enable_hierarchical_cache": True,
        "hicache_size": 1.5,
        "hicache_storage_dir": "/tmp/kv",
        "hicache_dtype": "fp8_e4m3",
    }
    with pytest.raises(ValueError, match="hicache_dtype"):
        EngineConfig(hicache_dtype="int4")
    assert EngineConfig(
        hicache_storage_dir="/tmp/kv"
    ).hierarchical_cache  # a directory implies the hierarchy
    assert not EngineConfig().hierarchical_cache
    with pytest.raises(ValueError, match="needs the radix cache"):
        EngineConfig(disable_radix_cache=True, enable_hierarchical_cache=True)


def test_a_pinned_prompt_survives_pressure_that_evicts_an_unpinned_one(
    tiny_llama_dir: Path, make_engine
) -> None:
    pinned, unpinned = random_prompts([32, 32], seed=43)
    others = random_prompts([40] * 4, seed=44)
    engine = make_engine(tiny_llama_dir, page_size=4, num_pages=24, pin_budget_fraction=0.5)
    engine.generate([pinned], greedy(N, pin_ttl_s=60.0))
    engine.generate([unpinned], greedy(N))
    assert len(engine.cache.pins) == 1
    for p in others:  # 12 pages each: everything unpinned is evicted in turn
        engine.generate([p], greedy(N))
    (again,) = engine.generate([pinned], greedy(N))
    (cold,) = engine.generate([unpinned], greedy(N))
    assert again.usage.cached_tokens == 28 and cold.usage.cached_tokens == 0
    engine.check_invariants()


def test_pin_ttl_is_an_api_field() -> None:
    from radixserve.serving.http.openai_protocol import CompletionRequest
    from radixserve.serving.http.sglang_protocol import SGLSamplingParams

    params, _ = SGLSamplingParams(pin_ttl_s=30.0).to_params(2048, 1000, None, None, 0)
    assert params.pin_ttl_s == 30.0
    body = CompletionRequest(model="m", prompt="hi", pin_ttl_s=45.0)
    assert body.sampling(16, None).pin_ttl_s == 45.0
    with pytest.raises(Exception, match="pin_ttl_s"):
        CompletionRequest(model="m", prompt="hi", pin_ttl_s=-1.0).sampling(16, None)


def test_a_smaller_l2_dtype_keeps_the_hits_and_fits_more_pages(
    tiny_llama_dir: Path, make_engine
) -> None:
    """``hicache_dtype="int8"``: the same GiB holds ~3x the pages of an fp32 L2 and every
    return of a system prompt is still a hit. The pages loaded back carry exactly the int8
    reference rounding (tests/memory/test_kv_convert.py), which moves logits slightly: the
    first token after every prompt is the full-precision hierarchy's, and the sequences
    agree almost everywhere (a random tiny model has near-ties that a rounding may flip; the
    accuracy cost on a real model is in benchmarks/README.md)."""
    prompts = _workload()
    full = make_engine(
        tiny_llama_dir,
        page_size=4,
        num_pages=12,
        enable_hierarchical_cache=True,
        hicache_size=0.001,
    )
    small = make_engine(
        tiny_llama_dir,
        page_size=4,
        num_pages=12,
        enable_hierarchical_cache=True,
        hicache_size=0.001,
        hicache_dtype="int8",
    )
    assert small.cache.hierarchy.host.num_pages >= 3 * full.cache.hierarchy.host.num_pages
    ref, ref_cached = _run(full, prompts)
    got, got_cached = _run(small, prompts)
    assert got_cached == ref_cached and small.stats().loaded_host_pages_total > 0
    assert [g[0] for g in got] == [r[0] for r in ref]
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    assert same >= 0.9 * N * len(prompts), (got, ref)
    small.check_invariants()
