"""Session leases through the real engine (tiny Llama): an agent's turn keeps its KV while
unkeyed traffic passes more than twice the pool through the cache, and a running request
still gets every page when it needs them."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, random_prompts, run_to_completion, tokens_of

from radixserve.engine.engine import Engine

PAGE = 4
POOL_PAGES = 48  # 192 tokens


def _turn(
    engine: Engine, prompt: list[int], session: str | None, n: int = 8
) -> tuple[int, list[int]]:
    """Run one request to its end; returns (cached prompt tokens, output tokens)."""
    rid = engine.add_request(prompt, greedy(n), session_id=session)
    outs = run_to_completion(engine)[rid]
    usage = outs[-1].usage
    assert usage is not None and outs[-1].finish_reason == "length"
    return usage.cached_tokens, tokens_of(outs)


def _agent_then_churn(engine: Engine, session: str | None) -> tuple[int, int]:
    """Turn 1 of an agent (64-token prompt, 8 out), churn of 6 x 64 tokens (2x the pool),
    then turn 2 re-sending turn 1 + a tool result. Returns (turn-1 tokens with KV, cached)."""
    first = random_prompts([64], seed=40)[0]
    _, out = _turn(engine, first, session)
    for p in random_prompts([56] * 6, seed=41):
        _turn(engine, p, None)
    history = first + out + random_prompts([12], seed=42)[0]
    cached, _ = _turn(engine, history, session)
    had_kv = (len(first) + len(out) - 1) // PAGE * PAGE  # the last sampled token has no KV
    return had_kv, cached


@pytest.mark.parametrize("leases", ["on", "off"])
def test_agent_turn_survives_churn_only_with_a_lease(
    tiny_llama_dir: Path, make_engine, leases: str
) -> None:
    engine = make_engine(
        tiny_llama_dir, num_pages=POOL_PAGES, page_size=PAGE, session_leases=leases
    )
    had_kv, cached = _agent_then_churn(engine, "agent-1")
    s = engine.stats()
    if leases == "on":
        assert cached == had_kv
        assert s.lease_hits_total == 1 and s.leases_granted_total == 2
        assert s.leased_pages == (64 + 8 + 12 + 8 - 1) // PAGE  # turn 2's path, whole pages
    else:
        assert cached < had_kv // 2
        assert s.leased_pages == 0 and s.leases_granted_total == 0
    assert s.evicted_pages_total > 0
    engine.check_invariants()


def test_unkeyed_chat_is_adopted_as_a_session(tiny_llama_dir: Path, make_engine) -> None:
    """Turn 2 of a chat without a key extends turn 1's prompt + answer: adopted, so turn 3
    finds turn 2's context after the churn."""
    engine = make_engine(tiny_llama_dir, num_pages=POOL_PAGES, page_size=PAGE)
    first = random_prompts([40], seed=50)[0]
    _, out1 = _turn(engine, first, None)
    second = first + out1 + random_prompts([8], seed=51)[0]
    _, out2 = _turn(engine, second, None)  # adopted: its path is leased when it ends
    assert engine.stats().sessions_adopted_total == 1 and engine.stats().leases_active == 1
    for p in random_prompts([56] * 6, seed=52):
        _turn(engine, p, None)
    third = second + out2 + random_prompts([8], seed=53)[0]
    cached, _ = _turn(engine, third, None)
    assert cached == (len(second) + len(out2) - 1) // PAGE * PAGE
    assert engine.stats().lease_hits_total == 1


def test_a_running_request_takes_every_leased_page(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, num_pages=POOL_PAGES, page_size=PAGE)
    for i, p in enumerate(random_prompts([40] * 4, seed=60)):
        _turn(engine, p, f"s{i}")
    assert engine.stats().leased_pages >= 4 * 40 // PAGE
    big = random_prompts([150], seed=61)[0]  # needs almost all 48 pages with its output
    cached, out = _turn(engine, big, None, n=30)
    assert len(out) == 30 and cached == 0
    s = engine.stats()
    assert s.lease_yielded_total >= 3 and s.retractions_total == 0
    engine.check_invariants()


def test_priority_policy_keeps_the_high_priority_prefix(tiny_llama_dir: Path, make_engine) -> None:
    """--eviction-policy priority: a priority-5 request's prefix outlives churn that LRU
    would let push it out; the request's priority travels with it into the tree."""
    system = random_prompts([48], seed=70)[0]
    for policy, want in (("lru", 0), ("priority", 48)):
        engine = make_engine(
            tiny_llama_dir,
            num_pages=POOL_PAGES,
            page_size=PAGE,
            session_leases="off",
            eviction_policy=policy,
        )
        rid = engine.add_request(system + [7], greedy(4), priority=5)
        run_to_completion(engine)
        for p in random_prompts([56] * 6, seed=71):
            _turn(engine, p, None)
        cached, _ = _turn(engine, system + [9, 9, 9], None)
        assert cached == want, (policy, rid)
        s = engine.stats()
        assert s.eviction_policy == policy
        # The live cache's regret: LRU evicted the 48-token prefix that came back.
        assert s.cache_regret_tokens == ({"lru": 48} if policy == "lru" else {})


def test_adaptive_policy_reports_every_candidates_regret(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(
        tiny_llama_dir, num_pages=POOL_PAGES, page_size=PAGE, eviction_policy="adaptive"
    )
    hot = random_prompts([32], seed=80)[0]
    for i, p in enumerate(random_prompts([56] * 6, seed=81)):
        _turn(engine, hot + [i + 3], None, n=2)
        _turn(engine, p, None, n=2)
    s = engine.stats()
    assert set(s.eviction_regret_tokens) == {"lru", "lfu", "slru", "priority"}
    assert s.eviction_policy == "adaptive" and s.eviction_policy_active in s.eviction_regret_tokens
    engine.check_invariants()
