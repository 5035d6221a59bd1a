"""Greedy outputs are token-for-token transformers' greedy ``generate``, however they are batched."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts, run_to_completion, tokens_of

LENGTHS = [5, 23, 1, 40, 16, 9]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("max_num_tokens", [2048, 7])
def test_together_cold_and_warm(
    tiny_llama_dir: Path, make_engine, page_size: int, max_num_tokens: int
) -> None:
    prompts = random_prompts(LENGTHS, seed=1)
    refs = [hf_greedy(tiny_llama_dir, p, 10) for p in prompts]
    engine = make_engine(
        tiny_llama_dir,
        page_size=page_size,
        num_pages=4096 // page_size,
        max_num_tokens=max_num_tokens,
    )
    for rnd in ("cold", "warm"):
        rids = [engine.add_request(p, greedy()) for p in prompts]
        outs = run_to_completion(engine)
        assert [tokens_of(outs[r]) for r in rids] == refs, rnd
        assert all(outs[r][-1].finish_reason == "length" for r in rids)
    # The warm round reused every whole page of every prompt (minus the always-computed last token).
    usage = [outs[r][-1].usage for r in rids]
    assert [u.cached_tokens for u in usage] == [(n - 1) // page_size * page_size for n in LENGTHS]


@pytest.mark.parametrize("page_size", [1, 16])
def test_staggered_with_small_chunks(tiny_llama_dir: Path, make_engine, page_size: int) -> None:
    """Requests arrive while others prefill in chunks and decode; shared prefixes across them."""
    base = random_prompts([30], seed=2)[0]
    tails = random_prompts([3, 20, 1, 11, 37], seed=3)
    prompts = [base[:k] + t for k, t in zip([30, 12, 30, 0, 25], tails)]
    refs = [hf_greedy(tiny_llama_dir, p, 10) for p in prompts]
    engine = make_engine(
        tiny_llama_dir, page_size=page_size, num_pages=2048 // page_size, max_num_tokens=9
    )
    pending = list(enumerate(prompts))
    rids: dict[int, str] = {}

    def arrive(step: int) -> None:
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            rids[i] = engine.add_request(p, greedy())

    arrive(0)
    outs = run_to_completion(engine, on_step=arrive)
    assert not pending
    assert [tokens_of(outs[rids[i]]) for i in range(len(prompts))] == refs


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_mqa_dir"])
def test_other_architectures(fixture: str, request: pytest.FixtureRequest, make_engine) -> None:
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts([7, 33, 2, 18], seed=4)
    refs = [hf_greedy(model_dir, p, 10) for p in prompts]
    engine = make_engine(model_dir, page_size=4, max_num_tokens=16)
    outs = engine.generate(prompts, greedy())
    engine.check_invariants()
    assert [o.token_ids for o in outs] == refs
    outs = engine.generate(prompts, greedy())  # warm
    assert [o.token_ids for o in outs] == refs


def test_fcfs_and_disabled_cache(tiny_llama_dir: Path, make_engine) -> None:
    prompts = random_prompts(LENGTHS, seed=5)
    refs = [hf_greedy(tiny_llama_dir, p, 10) for p in prompts]
    for kw in ({"schedule_policy": "fcfs"}, {"disable_radix_cache": True}):
        engine = make_engine(tiny_llama_dir, max_num_tokens=16, **kw)
        for _ in range(2):
            assert [o.token_ids for o in engine.generate(prompts, greedy())] == refs
            engine.check_invariants()
        if kw.get("disable_radix_cache"):
            assert engine.stats().cached_prompt_tokens_total == 0
            assert engine.stats().pages_free == engine.stats().num_pages


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "int4"])
def test_quantized_kv_cache_runs_cold_and_warm(
    tiny_llama_dir: Path, make_engine, kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized pools: same tokens cold and warm (reused pages hold the same codes), close to
    fp32. int8 and fp8 attend through the CPU kernel over their codes (every layer call of
    every step: from the one-call decoder stack, or layer by layer where a forward takes the
    per-layer path), int4 likewise over its rotated codes."""
    from radixserve.model import native
    from radixserve.model.attention.base import NativeLayersPlan
    from radixserve.model.decoder_stack import DecoderStack

    kernel_calls = 0
    kernel, stack_run = native.paged_attention, DecoderStack.run

    def counted(*args: object, **kw: object) -> None:
        nonlocal kernel_calls
        kernel_calls += kw.get("scales") is not None
        kernel(*args, **kw)  # type: ignore[arg-type]

    def counted_stack(
        self: DecoderStack, h: object, cos_sin: object, attn: NativeLayersPlan, *a: object
    ) -> None:
        nonlocal kernel_calls
        kernel_calls += bool(attn.k_scales)  # the stack's layers call the quantized op
        stack_run(self, h, cos_sin, attn, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "paged_attention", counted)
    monkeypatch.setattr(DecoderStack, "run", counted_stack)
    prompts = random_prompts([12, 30, 5], seed=6)
    engine = make_engine(tiny_llama_dir, kv_cache_dtype=kv_dtype, max_num_tokens=16)
    on_kernel = native.load()
    assert getattr(engine.runner.attn, "row_exact", False) == on_kernel
    cold = [o.token_ids for o in engine.generate(prompts, greedy())]
    assert (kernel_calls > 0) == on_kernel
    warm = [o.token_ids for o in engine.generate(prompts, greedy())]
    engine.check_invariants()
    assert cold == warm
    refs = [hf_greedy(tiny_llama_dir, p, 10) for p in prompts]
    assert [c[0] for c in cold] == [
        r[0] for r in refs
    ]  # the first token survives quantization here
