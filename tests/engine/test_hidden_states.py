"""Hidden states (``return_hidden_states``, SGLang's): the final norm's output at every
position the model reads (the prompt's, then each output token's but the last) equals
transformers' ``hidden_states[-1]`` over the prompt and the output less its last token, as
SGLang's test_hidden_states compares; over prompts prefilled in chunks beside a request
that does not ask, with overlap scheduling on and off, for a prompt whose prefix is cached
(recomputed, as prompt logprobs are), retracted and run again, through speculative
decoding's verify rows, and
refused where too large or where rank 0 does not hold the final norm's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import check_hidden_states as check
from engine_helpers import (
    greedy,
    hf_hidden_states,
    random_prompts,
    run_to_completion,
    tokens_of,
)

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import MAX_HIDDEN_STATE_FLOATS


def _engine(model: Path, **kw: object) -> Engine:
    """An engine of 256 pages of 4 tokens with ``kw`` besides."""
    return Engine(str(model), num_pages=256, page_size=4, **kw)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_chunked_prompts_beside_a_request_not_asking(tiny_llama_dir: Path, overlap: str) -> None:
    prompts = random_prompts([23, 9], seed=61)
    engine = _engine(tiny_llama_dir, max_num_tokens=8, overlap_schedule=overlap)
    plain = engine.add_request(random_prompts([5], seed=62)[0], greedy(10))
    rids = [engine.add_request(p, greedy(6, return_hidden_states=True)) for p in prompts]
    outs = run_to_completion(engine)
    assert all(o.hidden_states is None for o in outs[plain])
    for rid, prompt in zip(rids, prompts):
        check(tiny_llama_dir, prompt, outs[rid])
    engine.check_invariants()


def test_a_cached_prefix_is_recomputed(tiny_llama_dir: Path) -> None:
    head = random_prompts([24], seed=63)[0]
    longer = head + [7, 8, 9, 10, 11]
    engine = _engine(tiny_llama_dir)
    engine.generate([head], greedy(2))
    rid = engine.add_request(longer, greedy(4, return_hidden_states=True))
    outs = run_to_completion(engine)[rid]
    check(tiny_llama_dir, longer, outs)
    usage = outs[-1].usage
    assert usage is not None and usage.cached_tokens == 0  # every prompt position computed
    engine.check_invariants()


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_retracted_and_run_again(tiny_llama_dir: Path, overlap: str) -> None:
    """Retracted mid-output and recomputed from the cache: each position's hidden state is
    kept once, none recomputed twice or skipped."""
    prompt = random_prompts([13], seed=66)[0]
    engine = _engine(tiny_llama_dir, overlap_schedule=overlap)
    rid = engine.add_request(prompt, greedy(10, return_hidden_states=True))
    outs: list[StepOutput] = []
    while len(tokens_of(outs)) < 4:
        outs += engine.step()
    assert engine.retract_running() == 1
    outs += engine.take_outputs()  # the step that was in flight, read (overlap)
    outs += run_to_completion(engine)[rid]
    check(tiny_llama_dir, prompt, outs)
    engine.check_invariants()


def test_a_stop_token_ends_them_at_the_output(tiny_llama_dir: Path) -> None:
    prompt = random_prompts([11], seed=64)[0]
    engine = Engine(str(tiny_llama_dir), num_pages=128, page_size=4)
    free = engine.generate([prompt], greedy(6))[0].token_ids
    rid = engine.add_request(prompt, greedy(6, stop_token_ids=[free[2]], return_hidden_states=True))
    outs = run_to_completion(engine)[rid]
    assert tokens_of(outs) == free[: free.index(free[2]) + 1]
    check(tiny_llama_dir, prompt, outs)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_generate_cut_at_a_stop_string(tiny_llama_dir: Path, overlap: str) -> None:
    """Engine.generate ends the output at a stop string, the engine a step or more later:
    the hidden states are those of the output it returns, whole."""
    prompt = random_prompts([7], seed=67)[0]
    engine = _engine(tiny_llama_dir, overlap_schedule=overlap)
    free = engine.generate([prompt], greedy(10))[0]
    stop = engine.tokenizer.decode([free.token_ids[3]]).strip()
    assert stop and stop not in free.text[:4]  # a stop the output meets later
    out = engine.generate([prompt], greedy(10, stop=[stop], return_hidden_states=True))[0]
    assert out.finish_reason == "stop" and 0 < len(out.token_ids) < 10
    assert out.hidden_states is not None
    ref = hf_hidden_states(tiny_llama_dir, prompt + out.token_ids[:-1])
    assert len(out.hidden_states) == len(ref)
    torch.testing.assert_close(torch.tensor(out.hidden_states), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["ngram", "radix"])
def test_speculative_verify_rows(tiny_llama_hd64_dir: Path, algorithm: str) -> None:
    """A draft that stood gives its row's hidden state; a rejected one's row gives none."""
    prompt = (lambda p: p + p[:12])(random_prompts([14], seed=65)[0])
    engine = _engine(
        tiny_llama_hd64_dir,
        num_threads=1,
        speculative_algorithm=algorithm,
        speculative_num_tokens=8,
    )
    rid = engine.add_request(prompt, greedy(30, return_hidden_states=True))
    outs = run_to_completion(engine)[rid]
    usage = outs[-1].usage
    assert usage is not None and usage.spec_accepted_tokens > 0
    check(tiny_llama_hd64_dir, prompt, outs)
    engine.check_invariants()


def test_refused_when_too_large_or_not_held(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    hidden = engine.model_config.hidden_size
    too_many = MAX_HIDDEN_STATE_FLOATS // hidden + 1  # positions, with the prompt's 3
    with pytest.raises(ValueError, match="return_hidden_states would return"):
        engine.add_request([1, 2, 3], greedy(too_many - 1, return_hidden_states=True))
    engine.intake.no_embeddings = "with pipeline parallelism"  # as _no_embeddings says there
    with pytest.raises(ValueError, match="hidden states are not returned with pipeline"):
        engine.add_request([1, 2, 3], greedy(2, return_hidden_states=True))
