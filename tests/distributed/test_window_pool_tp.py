"""The window pool under tensor parallelism 2: rank 0's scheduler owns both allocators, every
step's message carries the window map entries it changed, and each rank applies them to its
own map over its own heads (``distributed.step_wire``, ``engine.window_setup``).

A Gemma-3-shaped tiny checkpoint (3 layers: two sliding with window 8, one global; tied
embeddings), page size 4, prefill in chunks of at most 12 tokens, a window pool of 22 pages
beside 64 global ones. Two rounds, each a batch of mixed lengths longer than the window
(cold, then hits on the first round's prefixes, some cut back where the window pool evicted
their window pages): greedy tokens, logprobs and cached-token counts equal to one process
keeping the same pools, and the cold round's to transformers'. After every step every
invariant holds on rank 0 (both pools, the device window map) and every rank's page table
and window map equal rank 0's (``RankGroup.audit``), so every rank's accounting balances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
from engine_helpers import greedy, run_to_completion, tokens_of

from radixserve.distributed.topology import TensorParallel
from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.memory.swa_cache import SWARadixCache

PAGE = 4
WINDOW = 8
NEW_TOKENS = 16  # 4 pages: decoding passes the window (2 pages)
LOGPROB_ATOL = 1e-4
CONFIG: dict[str, Any] = {
    "page_size": PAGE,
    "num_pages": 64,
    "max_num_tokens": 12,
    "window_kv_ratio": 0.34,  # 22 window pages: the second round evicts the first's
}
# A vocabulary-parallel tied head at TP 2, besides the window pool's model's quirks.
GEMMA3 = {**tiny_models.GEMMA3_SWA, "tie_word_embeddings": True}
assert GEMMA3["sliding_window"] == WINDOW

# One round's result per prompt: (tokens, logprobs, cached prompt tokens).
Outputs = list[tuple[list[int], list[float], int]]


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist()


def _rounds() -> list[list[list[int]]]:
    """Cold: 44, 37 and 13 tokens. Warm: the first two continued (hits on their prefixes,
    where their last windows survived), and a fresh one."""
    a, b = _seq(44, 1), _seq(37, 2)
    return [[a, b, _seq(13, 3)], [a + _seq(7, 4), b + _seq(11, 5), _seq(30, 6)]]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma3_swa_tp"), "gemma3_text", tokenizer=True, **GEMMA3
    )


# After each step at TP 2: global pages the running requests hold, every rank's KV digest.
Trace = list[tuple[int, list[list[int]]]]


def _run(engine: Engine, prompts: list[list[int]], trace: Trace) -> Outputs:
    """Run ``prompts`` together to the end one step at a time, checking every invariant after
    each step (at TP 2 that includes every rank's agreement); ``trace`` gets what each step
    left (TP 2 only)."""
    ids = [engine.add_request(p, greedy(NEW_TOKENS, logprobs=0)) for p in prompts]
    topo = engine.topology

    def audit(_: int) -> None:
        if isinstance(topo, TensorParallel):
            held = sum(len(r.pages) for r in engine.scheduler.running)
            trace.append((held, topo.ranks.audit(engine.runner)))

    outs = run_to_completion(engine, audit)
    return [_result(outs[i]) for i in ids]


def _result(outs: list[StepOutput]) -> tuple[list[int], list[float], int]:
    """One request's tokens, their logprobs and its cached prompt tokens."""
    logprobs = [lp.logprob for o in outs for lp in o.new_logprobs or []]
    cached = [o.usage.cached_tokens for o in outs if o.usage is not None]
    return tokens_of(outs), logprobs, cached[-1]


def _check_vs_hf(path: Path, prompts: list[list[int]], outs: Outputs) -> None:
    """Greedy tokens and logprobs of transformers' own Gemma 3 on the whole sequences."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, (tokens, logprobs, _) in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        assert tokens == rows.argmax(-1).tolist()
        want = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_tp2_window_pool_equals_one_process(gemma3: Path, overlap: str) -> None:
    """See the module docstring; with overlap scheduling (the GPU's default) too, where
    window pages released while a step is in flight wait for it on rank 0."""
    rounds = _rounds()
    config = {**CONFIG, "overlap_schedule": overlap}
    single = Engine(str(gemma3), **config)
    try:
        assert single.pool.window_layers == frozenset({0, 1})
        want = [_run(single, prompts, []) for prompts in rounds]
    finally:
        single.close()
    _check_vs_hf(gemma3, rounds[0], want[0])
    engine = Engine(str(gemma3), tensor_parallel_size=2, dist_timeout=30.0, **config)
    trace: Trace = []
    try:
        assert isinstance(engine.topology, TensorParallel)
        assert engine.pool.window_layers == frozenset({0, 1})
        assert engine.pool.num_window_pages == 22 + 1
        got = [_run(engine, prompts, trace) for prompts in rounds]
        for rnd, (g, w) in enumerate(zip(got, want, strict=True)):
            for (ids, lps, hit), (want_ids, want_lps, want_hit) in zip(g, w, strict=True):
                assert (ids, hit) == (want_ids, want_hit), rnd
                assert lps == pytest.approx(want_lps, abs=LOGPROB_ATOL), rnd
        assert [h for _, _, h in got[1]][:2] > [0, 0]  # the warm round hit
        cache = engine.cache
        assert isinstance(cache, SWARadixCache)
        w = cache.window
        # Requests released window pages as they passed the window; the second round
        # tombstoned some of the first's cached ones. Every rank followed (the audits).
        assert w.released_pages > 0 and cache.window_evicted_pages > 0
        _check_every_rank(trace, w.num_window_pages + 1)
    finally:
        engine.close()
    for proc in engine.topology.ranks.procs.values():
        assert not proc.is_alive()


def _check_every_rank(trace: Trace, pool_pages: int) -> None:
    """Every rank built the same window pool and, after every step, mapped the same global
    pages to the same window pages (``state_digest``: [pages, table sums, window pages,
    mapped, map sums]; rank 0's map is its allocator's, ``check_invariants``); and while the
    running requests held more global pages than the window pool has, every rank's window
    pool still had room: their pages past the window had given theirs back."""
    for _, digests in trace:
        assert len(digests) == 2 and digests[0] == digests[1]
        assert digests[1][3] == pool_pages and digests[1][4] <= pool_pages - 1
    assert max(held for held, _ in trace) > pool_pages
