"""A deliberately small KV pool: eviction, retraction, errors, aborts, and no page ever lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts, run_to_completion, tokens_of


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_pool_evicts_and_retracts_with_identical_outputs(
    tiny_llama_dir: Path, make_engine, page_size: int
) -> None:
    system = random_prompts([24], seed=20)[0]
    prompts = [system + q for q in random_prompts([6, 10, 3, 14, 8, 5, 12, 9], seed=21)]
    n = 24
    refs = [hf_greedy(tiny_llama_dir, p, n) for p in prompts]
    engine = make_engine(
        tiny_llama_dir,
        page_size=page_size,
        num_pages=160 // page_size,
        max_num_tokens=64,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,  # admit greedily: decode must retract
    )
    rids = [engine.add_request(p, greedy(n)) for p in prompts]
    outs = run_to_completion(engine)
    assert [tokens_of(outs[r]) for r in rids] == refs
    s = engine.stats()
    assert s.retractions_total > 0
    assert s.evicted_pages_total > 0
    assert s.running == s.waiting == 0 and s.pages_in_use == 0
    assert s.pages_free + s.pages_evictable == s.num_pages
    # A retracted request keeps its first-admission usage figures and its whole output.
    assert all(outs[r][-1].usage.completion_tokens == n for r in rids)


def test_default_admission_reserves_decode_room(tiny_llama_dir: Path, make_engine) -> None:
    prompts = random_prompts([20, 25, 30, 18, 22, 27], seed=22)
    refs = [hf_greedy(tiny_llama_dir, p, 20) for p in prompts]
    engine = make_engine(tiny_llama_dir, page_size=4, num_pages=40, max_num_tokens=128)
    outs = engine.generate(prompts, greedy(20))
    assert [o.token_ids for o in outs] == refs
    engine.check_invariants()


def test_prompt_that_can_never_fit_is_rejected(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, num_pages=8)  # 32 tokens of KV
    with pytest.raises(ValueError, match="too long"):
        engine.add_request(list(range(3, 35)), greedy())
    rid = engine.add_request(
        list(range(3, 30)), greedy(50)
    )  # fits; output stops at the pool's size
    outs = run_to_completion(engine)
    assert outs[rid][-1].finish_reason == "length"
    assert outs[rid][-1].usage.completion_tokens == 32 - 27


def test_max_model_len_bounds_output(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, max_model_len=20)
    with pytest.raises(ValueError, match="too long"):
        engine.add_request(list(range(3, 23)), greedy())
    out = engine.generate([list(range(3, 13))], greedy(50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_frees_everything(tiny_llama_dir: Path, make_engine, when: str) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, max_num_tokens=8)
    prompts = random_prompts([30, 5], seed=23)
    a = engine.add_request(prompts[0], greedy(50))
    b = engine.add_request(prompts[1], greedy(3))
    steps = {"waiting": 0, "prefilling": 2, "decoding": 6}[when]
    early = []
    for _ in range(steps):
        early += engine.step()
        engine.check_invariants()
    assert (when == "decoding") == any(o.request_id == a for o in early)
    engine.abort(a)
    engine.abort("no-such-request")  # ignored
    engine.check_invariants()
    outs = run_to_completion(engine)
    outs[b] = [o for o in early if o.request_id == b] + outs.get(b, [])
    assert outs[a][-1].finished and outs[a][-1].finish_reason == "abort"
    assert tokens_of(outs[b]) == hf_greedy(tiny_llama_dir, prompts[1], 3)
    s = engine.stats()
    assert s.pages_in_use == 0 and s.running == 0 and s.waiting == 0
    assert s.aborted_total == 1
    engine.abort(a)  # already finished: ignored
    assert not engine.has_unfinished()


def test_failed_forward_finishes_batch_with_error(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4)
    rid = engine.add_request(random_prompts([12], seed=24)[0], greedy(5))
    engine.step()
    real = engine.runner.model.forward

    def broken(batch, attn):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    engine.runner.model.forward = broken
    outs = engine.step()
    engine.runner.model.forward = real
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
    assert "device lost" in (outs[0].error or "")
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0 and not engine.has_unfinished()


def test_max_model_len_past_the_models_positions_is_refused(
    tiny_llama_dir: Path, make_engine
) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_engine(tiny_llama_dir, max_model_len=4096)  # the tiny model has 2048 positions
