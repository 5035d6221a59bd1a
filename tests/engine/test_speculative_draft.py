"""The ``draft`` drafter in the engine (tiny random Llama target, the CPU kernels): greedy
output and logprobs identical to decoding without speculation; with the target itself as
draft every draft is accepted (the draft's KV, positions, catch-up and rollback are right);
a draft of other dims (its own pool) in a mixed batch with chunked prefill and a sampled
request; the draft's KV in its own radix cache, per namespace, all given back, kept through a
retraction; the invariants (the draft pool's included) after every step; start-up refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_models
from engine_helpers import random_prompts, run_to_completion, speculative_mixed_batch, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams
from radixserve.speculative.draft_model import DraftModelDrafter
from radixserve.speculative.drafter import DraftSource

PROMPTS = [p + p[:12] for p in random_prompts([9, 31, 14], seed=1)]


def _params(n: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2, **kw)  # type: ignore[arg-type]


def _engine(model: Path, dtype: str = "float32", draft: Path | None = None, **kw: object) -> Engine:
    if draft is not None:
        kw.update(speculative_algorithm="draft", speculative_draft_model=str(draft))
        kw.setdefault("speculative_num_tokens", 8)
    return Engine(str(model), dtype=dtype, num_threads=1, num_pages=256, page_size=4, **kw)


def _solo(engine: Engine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    assert engine.flush_cache()  # the draft's cache too
    rid = engine.add_request(prompt, params)
    return run_to_completion(engine)[rid]


def _lps(outs: list[StepOutput]) -> list[object]:
    return [lp for o in outs for lp in (o.new_logprobs or [])]


def _drafter(engine: Engine) -> DraftModelDrafter:
    spec = engine.scheduler.speculation
    assert spec is not None and isinstance(spec.drafter.base, DraftModelDrafter)
    return spec.drafter.base


def _all_back(engine: Engine) -> None:
    """Nothing held in either pool: every page free or cached-and-evictable."""
    for alloc, cache in (
        (engine.allocator, engine.cache),
        (_drafter(engine).kv.allocator, _drafter(engine).kv.cache),
    ):
        assert alloc.num_free + cache.num_evictable_pages == alloc.num_pages
    assert _drafter(engine).tracked == 0


@dataclass
class _Context:
    """A request's context as the drafter reads it (DraftSource)."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    namespace: str | None = None


def _compare_with_fresh_drafts(drafter: DraftModelDrafter) -> None:
    """Every proposal ``drafter`` makes must be the one a fresh drafter (no KV, no cache)
    makes from the same context: its KV after catch-ups and rollbacks is what computing
    the context from scratch gives."""
    fresh = DraftModelDrafter(drafter.model, 64, drafter.pool.page_size, prefill_chunk=16)
    propose = drafter.propose
    count = 0

    def checked(req: DraftSource, k: int) -> list[int]:
        nonlocal count
        ctx = _Context(f"fresh-{count}", list(req.token_ids), req.prompt_len)
        count += 1
        got = propose(req, k)
        want = fresh.propose(ctx, k)
        fresh.finished(ctx)
        assert got == want, f"{req.request_id} at {len(ctx.token_ids)} tokens"
        return got

    drafter.propose = checked  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def tinier_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft of other dims than the target (1 layer, width 32, head_dim 16, one KV head),
    the same tokenizer and vocabulary."""
    return tiny_models.build_tiny_llama(
        tmp_path_factory.mktemp("tinier_draft"),
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        hidden_size=32,
        num_layers=1,
        intermediate_size=64,
        seed=5,
    )


@pytest.fixture(scope="module")
def base(tiny_llama_hd64_dir: Path) -> Iterator[Engine]:
    e = _engine(tiny_llama_hd64_dir)
    yield e
    e.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_as_draft_accepts_every_token(tiny_llama_hd64_dir: Path, dtype: str) -> None:
    base = _engine(tiny_llama_hd64_dir, dtype)
    spec = _engine(tiny_llama_hd64_dir, dtype, draft=tiny_llama_hd64_dir)
    try:
        for prompt in PROMPTS:
            want = _solo(base, prompt, _params())
            got = _solo(spec, prompt, _params())
            assert tokens_of(got) == tokens_of(want)
            assert _lps(got) == _lps(want)
            usage = got[-1].usage
            assert usage is not None and usage.spec_drafted_tokens > 0
            assert usage.spec_accepted_tokens == usage.spec_drafted_tokens
            _all_back(spec)
        # Fewer verify steps than tokens: each step took several.
        assert spec.stats().spec_verifies_total < len(PROMPTS) * 31
    finally:
        base.close()
        spec.close()


def test_mixed_batch_with_chunked_prefill_and_sampling(
    base: Engine, tiny_llama_hd64_dir: Path
) -> None:
    """The target as draft keeps its solo output, every draft accepted, while another
    request prefills in chunks beside it and a sampled one decodes in the same steps."""
    spec = _engine(tiny_llama_hd64_dir, draft=tiny_llama_hd64_dir, max_num_tokens=16)
    try:
        got = speculative_mixed_batch(base, spec, PROMPTS[0], _params)
        usage_a = got["a"][-1].usage
        assert usage_a is not None and usage_a.spec_drafted_tokens > 0
        assert usage_a.spec_accepted_tokens == usage_a.spec_drafted_tokens
        # (The sampled request drafts too: rejection sampling, the greedy proposal taken as
        # a point mass; the driver checks no more is accepted than drafted.)
        _all_back(spec)
    finally:
        spec.close()


def test_draft_of_other_dims_on_its_own_pool(
    base: Engine, tiny_llama_hd64_dir: Path, tinier_draft: Path
) -> None:
    """A draft that seldom agrees: drafts rejected and rolled back every step, outputs still
    exact; its proposals keep the logits that chose them; its prefixes cached per namespace."""
    spec = _engine(tiny_llama_hd64_dir, draft=tinier_draft, speculative_num_tokens=4)
    drafter = _drafter(spec)
    assert drafter.pool.num_layers == 1 and drafter.pool.head_dim == 16
    _compare_with_fresh_drafts(drafter)
    try:
        want = [_solo(base, p, _params()) for p in PROMPTS]
        rids = [spec.add_request(p, _params(), namespace="tenant-a") for p in PROMPTS]
        proposals = 0

        def check_proposals(_: int) -> None:
            nonlocal proposals
            for rid in rids:
                prop = drafter.proposal(rid)
                if prop is not None:
                    proposals += 1
                    assert prop.logits.argmax(-1).tolist() == prop.tokens
                    assert prop.probs().sum(-1).sub(1).abs().max() < 1e-4

        got = run_to_completion(spec, check_proposals)
        for rid, ref in zip(rids, want):
            assert tokens_of(got[rid]) == tokens_of(ref)
            assert _lps(got[rid]) == _lps(ref)
        assert proposals > 0 and spec.stats().spec_drafted_tokens_total > 0
        _all_back(spec)
        assert "tenant-a" in drafter.namespaces()
        # The same prompt again: the draft's prefill starts from its cached prefix, in the
        # same namespace only.
        cache = drafter.kv.cache
        for ns, hit in (("tenant-a", True), ("tenant-b", False)):
            before = cache.stats.hit_tokens
            rid = spec.add_request(PROMPTS[1], _params(4), namespace=ns)
            assert tokens_of(run_to_completion(spec)[rid]) == tokens_of(want[1])[:4]
            assert (cache.stats.hit_tokens > before) is hit
        _all_back(spec)
    finally:
        spec.close()


def test_truncated_draft_checkpoint(tiny_llama_hd64_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    from radixserve.speculative.make_draft import make_truncated_draft

    out = make_truncated_draft(tiny_llama_hd64_dir, tmp_path / "draft", 1)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())  # noqa: SIM118
    assert any(n.startswith("model.layers.0.") for n in names)
    assert not any(n.startswith("model.layers.1.") for n in names)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert (out / "tokenizer.json").is_file()


def test_layer_subset_draft_checkpoint(tiny_llama_hd64_dir: Path, tmp_path: Path) -> None:
    """``keep``: the chosen layers, renumbered from 0, their tensors unchanged."""
    from safetensors import safe_open

    from radixserve.speculative.make_draft import make_truncated_draft

    out = make_truncated_draft(tiny_llama_hd64_dir, tmp_path / "draft", keep=[1])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    src = next(tiny_llama_hd64_dir.glob("*.safetensors"))
    with (
        safe_open(str(out / "model.safetensors"), framework="pt") as st,
        safe_open(str(src), framework="pt") as full,
    ):
        names = set(st.keys())  # noqa: SIM118
        assert {n for n in names if n.startswith("model.layers.")} == {
            n.replace("layers.1.", "layers.0.")
            for n in full.keys()  # noqa: SIM118
            if ".layers.1." in n
        }
        for n in names:
            assert st.get_tensor(n).equal(full.get_tensor(n.replace("layers.0.", "layers.1.")))
    for bad in ([], [1, 0], [0, 2]):
        with pytest.raises(ValueError, match="keep"):
            make_truncated_draft(tiny_llama_hd64_dir, tmp_path / "bad", keep=bad)


def test_vocabulary_mismatch_refused(tiny_llama_hd64_dir: Path, tmp_path: Path) -> None:
    other = tiny_models.build_tiny_llama(tmp_path / "v600", vocab_size=600, num_layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(tiny_llama_hd64_dir, draft=other)


def test_tokenizer_mismatch_refused() -> None:
    from radixserve.engine.draft_setup import check_draft_fits
    from radixserve.model.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 8,
            "max_position_embeddings": 64,
        },
        eos_token_ids=(2,),
    )
    check_draft_fits(cfg, cfg, {"a": 0}, {"a": 0}, 64)
    with pytest.raises(ValueError, match="same tokenizer"):
        check_draft_fits(cfg, cfg, {"a": 0, "b": 1}, {"a": 1, "b": 0}, 64)
    with pytest.raises(ValueError, match="positions"):
        check_draft_fits(cfg, cfg, {"a": 0}, {"a": 0}, 128)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"speculative_algorithm": "draft"}, "go together"),
        ({"speculative_algorithm": "ngram", "speculative_draft_model": "/x"}, "go together"),
        (
            {
                "speculative_algorithm": "draft",
                "speculative_draft_model": "/x",
                "tensor_parallel_size": 2,
            },
            "parallelism",
        ),
        (
            {"speculative_algorithm": "draft", "speculative_draft_model": "/x", "device": "cuda"},
            "device",
        ),
    ],
)
def test_unsupported_combinations_refused_at_start(
    options: dict[str, object], message: str
) -> None:
    from radixserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)  # type: ignore[arg-type]


def test_retraction_and_a_full_draft_pool(base: Engine, tiny_llama_hd64_dir: Path) -> None:
    """Both pools too small for every request at once: requests are retracted and resumed
    (keeping their draft KV), drafts are skipped while the draft pool is short; outputs
    exact, every page of both pools back at the end."""
    spec = Engine(
        str(tiny_llama_hd64_dir),
        dtype="float32",
        num_threads=1,
        num_pages=24,
        page_size=4,
        speculative_algorithm="draft",
        speculative_draft_model=str(tiny_llama_hd64_dir),
        speculative_num_tokens=8,
    )
    try:
        want = [_solo(base, p, _params(24)) for p in PROMPTS]
        rids = [spec.add_request(p, _params(24)) for p in PROMPTS]
        got = run_to_completion(spec)
        for rid, ref in zip(rids, want):
            assert tokens_of(got[rid]) == tokens_of(ref)
        stats = spec.stats()
        assert stats.retractions_total > 0
        # The draft pool in the stats: as many pages as the model's, every one back.
        assert stats.spec_draft_pages == spec.allocator.num_pages
        assert stats.spec_draft_pages_free + stats.spec_draft_pages_evictable == 24
        assert stats.spec_draft_pool_bytes > 0
        # The target as draft: its KV kept through the retraction is still right.
        assert 0 < stats.spec_accepted_tokens_total == stats.spec_drafted_tokens_total
        _all_back(spec)
    finally:
        spec.close()
