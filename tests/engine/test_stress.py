"""Randomized: arrivals, aborts, shared prefixes, chunking and a small pool, all at once.

Every request that is not aborted must produce transformers' greedy tokens; aborted ones
must give everything back; the invariants hold after every step. Both CPU attention paths
run: the C++ kernel (groups from one shared page on) and the torch path, whose cascade runs
from one shared page on and keeps shared K/V across steps (within a budget or not) while
pages are evicted and reused: a stale kept K/V would change the tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts

from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend

SEEDS = [0, 1, 2, 3]


@pytest.mark.parametrize("native_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_traffic(tiny_llama_dir: Path, make_engine, seed: int, native_kernel: bool) -> None:
    rng = random.Random(seed)
    stems = random_prompts([rng.randint(8, 40) for _ in range(3)], seed=100 + seed)
    tails = random_prompts([rng.randint(1, 12) for _ in range(14)], seed=200 + seed)
    prompts = [rng.choice(stems)[: rng.randint(0, 40)] + t for t in tails]
    lengths = [rng.randint(1, 14) for _ in prompts]
    ps = rng.choice([1, 2, 4])
    engine = make_engine(  # a 72-token pool: admission is greedy, so decode must evict and retract
        tiny_llama_dir,
        page_size=ps,
        num_pages=72 // ps,
        max_num_tokens=rng.choice([5, 16, 64]),
        max_running_requests=rng.choice([3, 8]),
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    if native_kernel and not engine.attn._native:
        pytest.skip("the CPU kernel did not build here")
    if not native_kernel:
        engine.attn = TorchPagedAttentionBackend(engine.pool, native_kernel=False)
    engine.attn.cascade_min_tokens = ps
    engine.attn.shared_kv_bytes = rng.choice([1 << 12, 1 << 30])
    kept_steps = 0  # steps that started with shared K/V kept from the step before
    grouped_steps = 0  # steps whose kernel plan had a group reading shared pages
    queue = list(range(len(prompts)))
    rid_of: dict[str, int] = {}
    got: dict[int, list[int]] = {}
    aborted: set[int] = set()
    finished: set[int] = set()
    step = 0
    while queue or engine.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if queue:
                i = queue.pop(0)
                rid_of[engine.add_request(prompts[i], greedy(lengths[i]), request_id=f"r{i}")] = i
                got[i] = []
        if rng.random() < 0.08:
            live = [i for i in got if i not in finished and i not in aborted]
            if live:
                victim = rng.choice(live)
                engine.abort(f"r{victim}")
                aborted.add(victim)
        kept_steps += bool(engine.attn._shared_kv)
        for o in engine.step():
            i = rid_of[o.request_id]
            got[i] += o.new_token_ids
            if o.finished:
                finished.add(i)
                assert (o.finish_reason == "abort") == (i in aborted)
        meta = engine.attn._meta
        grouped_steps += (
            meta is not None and meta.native is not None and meta.native.shared_pages.numel() > 0
        )
        engine.check_invariants()
        step += 1
        assert step < 5000
    s = engine.stats()
    assert s.pages_in_use == 0 and s.running == s.waiting == 0
    assert (
        s.retractions_total > 0 and s.evicted_pages_total > 0
    )  # the pool was small enough to matter
    if native_kernel:
        assert grouped_steps > 0  # the kernel's shared-prefix groups were exercised
    else:
        assert kept_steps > 0  # the cascade path and its kept K/V were exercised
    for i in got:
        if i not in aborted:
            assert got[i] == hf_greedy(tiny_llama_dir, prompts[i], lengths[i]), i
