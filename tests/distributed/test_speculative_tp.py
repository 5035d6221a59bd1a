"""Speculative decoding under tensor parallelism (two CPU ranks over gloo, tiny random
Llama, bfloat16): greedy tokens and logprobs identical to the same two-rank engine without
speculation, with drafts accepted (the ``radix`` drafter, a prompt's second run)."""

from __future__ import annotations

from pathlib import Path

from engine_helpers import random_prompts

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

PROMPTS = [p + p[:12] for p in random_prompts([9, 31], seed=1)]


def _run(model: Path, **kw: object) -> list[tuple[list[int], list[float], int]]:
    """Each prompt twice, alone from an empty cache: (tokens, logprobs, drafts accepted)."""
    engine = Engine(
        str(model),
        dtype="bfloat16",
        num_threads=1,
        num_pages=256,
        page_size=4,
        tensor_parallel_size=2,
        **kw,
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        out = []
        for prompt in PROMPTS + PROMPTS:
            assert engine.flush_cache()
            (o,) = engine.generate([prompt], params)
            engine.check_invariants()
            out.append(
                (o.token_ids, [lp.logprob for lp in o.logprobs or []], o.usage.spec_accepted_tokens)
            )
        assert engine.flush_cache()
        assert engine.allocator.num_free == engine.allocator.num_pages
        return out
    finally:
        engine.close()


def test_tensor_parallel_greedy_identical_with_drafts(tiny_llama_hd64_dir: Path) -> None:
    want = _run(tiny_llama_hd64_dir)
    got = _run(tiny_llama_hd64_dir, speculative_algorithm="radix", speculative_num_tokens=8)
    for (w_ids, w_lp, _), (g_ids, g_lp, _) in zip(want, got, strict=True):
        assert g_ids == w_ids
        assert g_lp == w_lp
    assert sum(a for _, _, a in got) > 0, "no draft stood"
