"""A Gemma-3-shaped model's window layers keep their KV in a pool of their own, freed as
requests move past the window (memory.window_pool, memory.swa_cache), and hits stay exact.

The tiny checkpoint (transformers' own Gemma 3 text classes, random weights): 3 layers, two
sliding (window 8) and one global, page size 4, prompts of 40-56 tokens (5-7 windows),
prefill in chunks of at most 12 tokens. Every run compares greedy tokens and per-token
logprobs with transformers' (float32, within 1e-4) and checks every page invariant (both
pools, the device window map) after every engine step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch

from radixserve.engine.engine import Engine
from radixserve.memory.swa_cache import SWARadixCache
from radixserve.sampling_params import SamplingParams

WINDOW = 8
PAGE = 4
LOGPROB_ATOL = 1e-4
GEMMA3 = tiny_models.GEMMA3_SWA
assert GEMMA3["sliding_window"] == WINDOW


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma3_swa"), "gemma3_text", tokenizer=True, **GEMMA3
    )


@pytest.fixture(scope="module")
def hf(gemma3: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma3), dtype=torch.float32).eval()


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist()


def _engine(
    path: Path, num_pages: int, ratio: float = 0.5, overlap: str = "off", kv: str = "auto"
) -> Engine:
    return Engine(
        str(path),
        page_size=PAGE,
        num_pages=num_pages,
        max_num_tokens=12,
        window_kv_ratio=ratio,
        overlap_schedule=overlap,
        kv_cache_dtype=kv,
    )


def _run(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    trace: list[tuple[int, int]] | None = None,
) -> list[tuple[list[int], list[float], int]]:
    """Run ``prompts`` to the end one engine step at a time, checking every invariant after
    each step; returns (tokens, logprobs, cached prompt tokens) per prompt. ``trace`` gets
    (window pages in use, global pages held by running requests) after every step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    toks: dict[str, list[int]] = {i: [] for i in ids}
    lps: dict[str, list[float]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    cache = engine.cache
    assert trace is None or isinstance(cache, SWARadixCache)
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [lp.logprob for lp in o.new_logprobs or []]
            if o.usage is not None:
                cached[o.request_id] = o.usage.cached_tokens
        engine.check_invariants()
        if trace is not None:
            assert isinstance(cache, SWARadixCache)
            held = sum(len(r.pages) for r in engine.scheduler.running)
            trace.append((cache.num_window_in_use, held))
    return [(toks[i], lps[i], cached[i]) for i in ids]


def _check_vs_hf(hf: Any, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    seq = prompt + tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    rows = ref[len(prompt) - 1 : len(seq) - 1]
    assert tokens == rows.argmax(-1).tolist()
    want = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_window_pages_are_freed_as_requests_advance(gemma3: Path, hf: Any) -> None:
    """Two requests of 40 and 44 prompt tokens decoding 24 more: the global pages they hold
    grow to 16 and 17, while the window pages in use stay within a few windows' worth."""
    engine = _engine(gemma3, num_pages=64)
    try:
        pool = engine.pool
        assert pool.window_layers == frozenset({0, 1}) and pool.num_window_pages == 32 + 1
        # Two sliding layers of three live in 33 pages instead of 65: the pool's bytes.
        full = pool.bytes_per_page * 65
        assert pool.nbytes == full // 3 + 2 * full // 3 * 33 // 65
        prompts = [_seq(40, 1), _seq(44, 2)]
        trace: list[tuple[int, int]] = []
        outs = _run(engine, prompts, 24, trace)
        for p, (t, lp, _) in zip(prompts, outs):
            _check_vs_hf(hf, p, t, lp)
        peak_held = max(h for _, h in trace)
        assert peak_held >= 32  # the requests' global pages
        # Each request: its lock's last window (3 pages) + its own window and next page.
        assert max(w for w, _ in trace) <= 2 * (3 + 4)
        decoding = [w for w, h in trace if h >= 24]  # both past their prompts
        assert decoding and max(decoding) <= 2 * (3 + 4)
        cache = engine.cache
        assert isinstance(cache, SWARadixCache)
        assert cache.num_window_in_use == 0  # all finished: only evictable window pages left
        # Their decoded tails' window pages went while they ran: tombstones from the start.
        assert cache.window.num_evictable < cache.num_cached_pages
    finally:
        engine.close()


def test_hit_after_window_eviction_is_cut_back_and_exact(gemma3: Path, hf: Any) -> None:
    """Window-pool pressure tombstones every cached window page (the global pages stay); a
    request recomputing the first 24 tokens hands its window pages to the tree's tombstones
    there; the 48-token prompt's continuation then reuses exactly those 24 tokens (the
    longest prefix whose last window is whole), and its tokens and logprobs equal a cold
    run's and transformers'."""
    a, b = _seq(48, 3), _seq(48, 4)
    follow = a + _seq(9, 5)
    cold = _engine(gemma3, num_pages=64)
    try:
        want = _run(cold, [follow], 6)[0]
    finally:
        cold.close()
    _check_vs_hf(hf, follow, want[0], want[1])
    engine = _engine(gemma3, num_pages=48, ratio=0.34)  # 17 window pages
    try:
        cache = engine.cache
        assert isinstance(cache, SWARadixCache)
        _run(engine, [a], 2)
        _run(engine, [b], 2)  # takes window pages a's prefix held: tombstones there
        assert cache.window_evicted_pages > 0
        # Pressure: an allocation of every window page evicts all unreferenced ones.
        w = cache.window
        taken = w.allocator.alloc(w.allocator.num_free + w.num_evictable)
        w.allocator.free(taken)
        engine.check_invariants()
        assert w.num_evictable == 0 and cache.total_cached_tokens >= 96  # globals stay
        assert cache.peek_prefix_len(follow) == 0  # scoring sees the cut-back too
        ((_, _, hit0),) = _run(engine, [a[:24] + _seq(8, 6)], 2)
        assert hit0 == 0  # no prefix of a has its last window
        cut_before = cache.window_cut_tokens
        ((tokens, logprobs, hit),) = _run(engine, [follow], 6)
        assert hit == 24 and cache.window_cut_tokens - cut_before == 48 - 24
        assert tokens == want[0]
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want[1]), atol=LOGPROB_ATOL, rtol=0
        )
        # Recomputed, the prompt's windows are whole again: its next run reuses all of it.
        ((tokens2, _, hit2),) = _run(engine, [follow], 6)
        assert hit2 == (len(follow) - 1) // PAGE * PAGE and tokens2 == want[0]
    finally:
        engine.close()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_kv_scales_live_in_the_window_pool(gemma3: Path, kv: str) -> None:
    """int8/int4 KV: the window layers' per-token scales are paged in the window pool with
    their data. Two prompts of 5 windows (one sharing the other's first 24 tokens, so the
    second is a hit) give the same tokens and logprobs as the same model keeping full KV, and
    the window pages in use stay within a few windows while the requests' pages grow."""
    prompts = [_seq(40, 8), _seq(24, 8) + _seq(16, 9)]
    full = _engine(gemma3, num_pages=48, ratio=0.0, kv=kv)
    try:
        assert not full.pool.window_layers
        want = [_run(full, [p], 12)[0] for p in prompts]
    finally:
        full.close()
    engine = _engine(gemma3, num_pages=48, kv=kv)
    try:
        pool = engine.pool
        assert pool.window_layers == frozenset({0, 1}) and pool.k_scale is not None
        wpages = pool.num_window_pages
        assert [tuple(s.shape[:1]) for s in pool.k_scale] == [(wpages,), (wpages,), (48 + 1,)]
        trace: list[tuple[int, int]] = []
        got = [_run(engine, [p], 12, trace)[0] for p in prompts]
        assert got[1][2] == 24  # the second prompt's hit
        for (t, lp, _), (wt, wlp, _) in zip(got, want):
            assert t == wt
            torch.testing.assert_close(
                torch.tensor(lp), torch.tensor(wlp), atol=LOGPROB_ATOL, rtol=0
            )
        assert max(h for _, h in trace) >= 13  # 52 tokens of global pages held at the end
        assert max(w for w, _ in trace) <= 3 + 4  # its lock's last window + its own window
        cache = engine.cache
        assert isinstance(cache, SWARadixCache)
        assert cache.window.num_evictable < cache.num_cached_pages  # tails went as they ran
    finally:
        engine.close()


def test_l2_carries_window_kv_and_hits_from_it_stay_exact(gemma3: Path) -> None:
    """The hierarchical cache (L2 alone) over a window pool: a 48-token prompt pushed out of
    L1 by two others goes to L2 with its window KV; its continuation loads it back, reuses
    all 48 tokens, and its tokens and logprobs equal a cold run's; every invariant (both
    pools, L2) after every step. (Tombstones through L2: tests/memory/test_swa_cache.py.)"""
    a = _seq(48, 10)
    follow = a + _seq(9, 11)
    cold = _engine(gemma3, num_pages=64)
    try:
        want = _run(cold, [follow], 6)[0]
    finally:
        cold.close()
    engine = Engine(
        str(gemma3),
        page_size=PAGE,
        num_pages=24,
        max_num_tokens=12,
        window_kv_ratio=1.0,  # no window-pool pressure: a's pages keep their window KV
        enable_hierarchical_cache=True,
    )
    try:
        from radixserve.memory.swa_hi_cache import SWAHiRadixCache

        cache = engine.cache
        assert isinstance(cache, SWAHiRadixCache) and engine.pool.window_layers
        _run(engine, [a], 2)
        _run(engine, [_seq(48, 12)], 2)
        _run(engine, [_seq(48, 13)], 2)
        h = cache.hierarchy
        assert h.stats.demoted_pages >= 12 and cache.peek_prefix_len(follow) < 48
        loaded = h.stats.loaded_l2_pages
        ((tokens, logprobs, hit),) = _run(engine, [follow], 6)
        assert h.stats.loaded_l2_pages > loaded and hit == 48
        assert tokens == want[0]
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want[1]), atol=LOGPROB_ATOL, rtol=0
        )
    finally:
        engine.close()


@pytest.mark.parametrize("why", ["ratio 0", "hierarchical cache's L3"])
def test_window_pool_off_keeps_full_kv(
    gemma3: Path, why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``window_kv_ratio`` 0, and the hierarchical cache with an L3 (page files hold whole
    pages of every layer), keep every token's KV in every layer, as before; the L3 case is
    refused with a start-up warning naming why (ratio 0 was asked for: no warning)."""
    caplog.set_level(logging.INFO, logger="radixserve.engine.window_setup")
    if why == "ratio 0":
        engine = _engine(gemma3, num_pages=16, ratio=0.0)
    else:
        engine = Engine(
            str(gemma3),
            page_size=PAGE,
            num_pages=16,
            enable_hierarchical_cache=True,
            hicache_storage_dir=str(tmp_path),
        )
    try:
        assert not engine.pool.window_layers and not isinstance(engine.cache, SWARadixCache)
    finally:
        engine.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if why == "ratio 0":
        assert not warned
    else:
        assert [m for m in warned if "no window pool" in m and "L3" in m]


@pytest.mark.parametrize("backend", ["torch", "triton", "overlap"])
def test_other_attention_paths_read_the_window_pool(gemma3: Path, hf: Any, backend: str) -> None:
    """The plain torch path and the Triton kernels (interpreted on the CPU) read the window
    layers' KV through the window view too, and overlap scheduling (window pages released
    while a step is in flight wait for it): a prompt of 3 windows, exact."""
    engine = _engine(gemma3, num_pages=32, overlap="on" if backend == "overlap" else "off")
    try:
        if backend == "torch":
            from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend

            engine.attn = TorchPagedAttentionBackend(engine.pool, native_kernel=False)
        elif backend == "triton":
            from radixserve.model.attention.triton_paged import TritonPagedAttentionBackend

            engine.attn = TritonPagedAttentionBackend(engine.pool)
        prompt = _seq(26, 7)
        ((tokens, logprobs, _),) = _run(engine, [prompt], 10)
        _check_vs_hf(hf, prompt, tokens, logprobs)
    finally:
        engine.close()


def test_only_pipeline_stages_refuse_the_window_pool(gemma3: Path) -> None:
    """One process and tensor parallelism carry the window map to every rank; pipeline
    stages do not yet, so they keep full KV, and the refusal names pipeline parallelism only
    (tensor parallelism itself: ``tests/distributed/test_window_pool_tp.py``). So does
    prefill/decode disaggregation, whatever the topology."""
    from radixserve.distributed.topology import PipelineParallel, TensorParallel, Topology
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.window_setup import plan_window_pool, window_pool_refusal
    from radixserve.model.config import ModelConfig

    assert Topology.carries_window_map and TensorParallel.carries_window_map
    assert not PipelineParallel.carries_window_map
    cfg = EngineConfig.from_kwargs(page_size=PAGE)
    mc = ModelConfig.from_pretrained(gemma3)
    assert window_pool_refusal(cfg, mc, window_map=True) is None
    why = window_pool_refusal(cfg, mc, window_map=False)
    assert why is not None and "pipeline" in why and "tensor" not in why
    assert plan_window_pool(cfg, mc, 64, window_map=False) is None
    # Disaggregation's transfers copy whole pages of every layer (KVPool.page_tensors): at
    # TP 2 as in one process, such an engine keeps full KV rather than failing at start-up.
    disagg = EngineConfig.from_kwargs(page_size=PAGE, disaggregation_mode="prefill")
    why = window_pool_refusal(disagg, mc, window_map=True)
    assert why is not None and "disaggregation" in why
    plan = plan_window_pool(cfg, mc, 64, window_map=True)
    assert plan is not None and plan.layers == frozenset({0, 1}) and plan.window == WINDOW
