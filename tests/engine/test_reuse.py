"""Prefix reuse: what the radix cache saves, asserted on the counters."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts, run_to_completion, tokens_of


@pytest.mark.parametrize("page_size", [1, 16])
def test_second_request_computes_only_its_suffix(
    tiny_llama_dir: Path, make_engine, page_size: int
) -> None:
    system, q1, q2 = random_prompts([100, 7, 12], seed=10)
    engine = make_engine(tiny_llama_dir, page_size=page_size, num_pages=2048 // page_size)
    first = engine.generate([system + q1], greedy(4))[0]
    assert first.usage.cached_tokens == 0
    before = engine.stats().computed_tokens_total
    second = engine.generate([system + q2], greedy(4))[0]
    computed = engine.stats().computed_tokens_total - before
    hit = 100 // page_size * page_size
    assert second.usage.cached_tokens == hit
    # Only the suffix is prefilled, then one row per decode step after the first token.
    assert computed == (100 + 12 - hit) + (4 - 1)
    assert second.token_ids == hf_greedy(tiny_llama_dir, system + q2, 4)
    engine.check_invariants()


def test_multi_turn_chat_hits_whole_history(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=1, num_pages=2048)
    history = random_prompts([40], seed=11)[0]
    for turn, user in enumerate(random_prompts([9, 14, 5], seed=12)):
        prompt = history + user
        out = engine.generate([prompt], greedy(6))[0]
        if turn:
            # Everything but the previous answer's last token (never run through the model) hits.
            assert out.usage.cached_tokens == len(history) - 1
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 6)
        history = prompt + out.token_ids
    assert engine.stats().hit_rate > 0.5


def test_concurrent_requests_share_an_uncached_prefix(tiny_llama_dir: Path, make_engine) -> None:
    """Submitted together, requests sharing an uncached prefix compute it once, not once each."""
    system = random_prompts([64], seed=13)[0]
    prompts = [system + q for q in random_prompts([5, 6, 7, 8], seed=14)]
    engine = make_engine(tiny_llama_dir, page_size=4, num_pages=1024, max_num_tokens=512)
    outs = engine.generate(prompts, greedy(3))
    assert [o.usage.cached_tokens for o in outs] == [0, 64, 64, 64]
    assert engine.stats().computed_tokens_total == 64 + sum(5 + 6 + 7 + 8 for _ in [0]) + 4 * 2
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir, p, 3) for p in prompts]


def test_chunks_are_cached_while_the_prompt_is_still_prefilling(
    tiny_llama_dir: Path, make_engine
) -> None:
    """A long prompt prefilled in chunks: a request arriving mid-way reuses the finished chunks."""
    long_prompt = random_prompts([80], seed=15)[0]
    engine = make_engine(
        tiny_llama_dir, page_size=4, num_pages=1024, max_num_tokens=16, defer_shared_prefix_tokens=0
    )
    a = engine.add_request(long_prompt, greedy(3))
    for _ in range(3):  # 3 chunks of 16 tokens
        engine.step()
        engine.check_invariants()
    b = engine.add_request(long_prompt[:48] + [7, 8, 9], greedy(3))
    outs = run_to_completion(engine)
    assert outs[b][-1].usage.cached_tokens == 48
    assert tokens_of(outs[a]) == hf_greedy(tiny_llama_dir, long_prompt, 3)
    assert tokens_of(outs[b]) == hf_greedy(tiny_llama_dir, long_prompt[:48] + [7, 8, 9], 3)


def test_namespaces_do_not_share(tiny_llama_dir: Path, make_engine) -> None:
    prompt = random_prompts([40], seed=16)[0]
    engine = make_engine(tiny_llama_dir, page_size=4)
    engine.add_request(prompt, greedy(2), namespace="a")
    run_to_completion(engine)
    rid = engine.add_request(prompt, greedy(2), namespace="b")
    outs = run_to_completion(engine)
    assert outs[rid][-1].usage.cached_tokens == 0
    rid = engine.add_request(prompt, greedy(2), namespace="a")
    outs = run_to_completion(engine)
    assert outs[rid][-1].usage.cached_tokens == 36


def test_flush_cache(tiny_llama_dir: Path, make_engine) -> None:
    prompt = random_prompts([40], seed=17)[0]
    engine = make_engine(tiny_llama_dir, page_size=4)
    engine.generate([prompt], greedy(2))
    assert engine.stats().cached_tokens > 0
    engine.add_request(prompt, greedy(2))
    assert engine.flush_cache() is False  # busy
    run_to_completion(engine)
    assert engine.flush_cache() is True
    s = engine.stats()
    assert s.cached_tokens == 0 and s.pages_free == s.num_pages
    assert engine.generate([prompt], greedy(2))[0].usage.cached_tokens == 0
