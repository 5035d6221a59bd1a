"""Sampling parameters end to end: validation, stopping, seeds, logprobs, prompt logprobs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, random_prompts, run_to_completion, tokens_of

from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from radixserve.engine.engine import Engine

    return Engine(str(tiny_llama_dir), page_size=4, num_pages=1024, max_num_tokens=64)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=0), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logprobs=50), "logprobs"),
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(stop=[""]), "stop strings"),
        (SamplingParams(temperature=float("inf")), "temperature must be a finite"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
        (SamplingParams(max_tokens=2**64), "max_tokens must be below 2"),
        (SamplingParams(stop_token_ids=[2**64]), "stop_token_ids must be token ids"),
        (SamplingParams(json_schema="[" * 5000 + "]" * 5000), "nested too deeply"),
    ],
)
def test_invalid_params_rejected(engine, params: SamplingParams, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        engine.add_request([5, 6, 7], params)
    assert not engine.has_unfinished()


def test_invalid_prompts_rejected(engine) -> None:  # type: ignore[no-untyped-def]
    for bad, match in (([], "empty"), ([5, 10**6], "token ids"), ([-1], "token ids")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(bad, greedy())
    engine.add_request([5, 6], greedy(1), request_id="dup")
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request([5, 6], greedy(1), request_id="dup")
    with pytest.raises(ValueError, match="too long"):  # generate validates all before queueing any
        engine.generate([[5, 6], [7] * 5000], greedy(1))
    run_to_completion(engine)


def test_stop_token_ids_min_tokens_and_max_tokens(engine, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([12], seed=30)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, 10)
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    out = engine.generate([prompt], greedy(10, stop_token_ids=[stop_tok], min_tokens=first + 1))[0]
    assert out.token_ids[first] != stop_tok  # masked while fewer than min_tokens are out
    out = engine.generate([prompt], greedy(4))[0]
    assert (
        out.token_ids == ref[:4]
        and out.finish_reason == "length"
        and out.usage.completion_tokens == 4
    )


def test_eos_stops_unless_ignored(engine, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([9], seed=31)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, 10)
    # Make the model's own greedy token look like EOS by asking for it as a stop id; and EOS proper:
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, min_tokens=0))[0]
    eos = 2
    expect = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert out.token_ids == expect


def test_stop_strings_via_generate(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([10], seed=32)[0]
    full = engine.generate([prompt], greedy(12))[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = engine.generate([prompt], greedy(12, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)] and out.matched_stop == stop
    kept = engine.generate([prompt], greedy(12, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    assert full.matched_stop is None
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0


def test_stop_regex_via_generate(engine) -> None:  # type: ignore[no-untyped-def]
    """``generate`` ends the text at a stop pattern's first match, and fails a request whose
    pattern backtracks past its budget with an error, its KV freed, the others unharmed."""
    prompt = random_prompts([10], seed=32)[0]
    full = engine.generate([prompt], greedy(12))[0]
    pattern = re.escape(full.text[2]) + "."
    m = re.search(pattern, full.text)
    assert m is not None
    out = engine.generate([prompt], greedy(12, stop_regex=[pattern]))[0]
    assert out.finish_reason == "stop" and out.matched_stop == pattern
    assert out.text == full.text[: m.start()]
    bomb = greedy(64, stop_regex=["(?:.|.)*[\x00\x01]"])  # never matches; 2^n ways to fail
    hostile, other = engine.generate([prompt, prompt], [bomb, greedy(12)])
    assert hostile.finish_reason == "error" and "stop_regex" in (hostile.error or "")
    assert other.text == full.text
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0


def test_seeded_sampling_is_reproducible_regardless_of_batch(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([15], seed=33)[0]
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = engine.generate([prompt], p)[0].token_ids
    others = random_prompts([4, 30, 8], seed=34)
    batch = engine.generate(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(max_tokens=12, temperature=0.8),
            p,
            SamplingParams(max_tokens=5, seed=7),
            greedy(3),
        ],
    )
    assert batch[1].token_ids == alone
    other_seed = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=99)
    )[0]
    assert other_seed.token_ids != alone


def test_logprobs_match_the_model(engine, hf_model, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([11], seed=35)[0]
    out = engine.generate([prompt], greedy(5, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    seq = prompt + out.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top_v, top_i = row.topk(3)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    # logprobs=0: the chosen token only.
    out0 = engine.generate([prompt], greedy(2, logprobs=0))[0]
    assert out0.logprobs is not None and all(lp.top == [] for lp in out0.logprobs)


@pytest.mark.parametrize("start", [0, 1, 7, 40])
def test_prompt_logprobs_from_start_even_when_cached(engine, hf_model, start: int) -> None:  # type: ignore[no-untyped-def]
    prompt = random_prompts([40], seed=36)[0]
    engine.generate([prompt], greedy(1))  # the whole prompt is now cached
    out = engine.generate([prompt], greedy(2, prompt_logprobs_start=start))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expect: list[float | None] = [None] if start == 0 else []
    expect += [ref[p - 1, prompt[p]].item() for p in range(max(start, 1), len(prompt))]
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(expect)
    assert not got or (got[0] is None) == (start == 0)
    assert [g for g in got if g is not None] == pytest.approx(
        [e for e in expect if e is not None], abs=1e-4
    )


def test_prompt_logprobs_across_chunks_and_with_sampling(tiny_llama_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    from radixserve.engine.engine import Engine

    engine = Engine(str(tiny_llama_dir), page_size=1, num_pages=512, max_num_tokens=6)
    prompt = random_prompts([23], seed=37)[0]
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=1, prompt_logprobs_start=5)
    )
    outs = run_to_completion(engine)[rid]
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert outs[0].prompt_logprobs == pytest.approx(
        [ref[p - 1, prompt[p]].item() for p in range(5, 23)], abs=1e-4
    )
    assert len(tokens_of(outs)) == 3


def test_prompt_top_logprobs_match_the_model_per_request_k(tiny_llama_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Each prompt position's k likeliest tokens (k: the request's ``logprobs``), from the
    distribution that scores the prompt token, over chunks and beside a request asking for
    fewer in the same steps."""
    from radixserve.engine.engine import Engine

    engine = Engine(str(tiny_llama_dir), page_size=2, num_pages=512, max_num_tokens=16)
    prompts = random_prompts([23, 19, 9], seed=38)
    ks, starts = [4, 1, 0], [0, 6, 2]
    outs = engine.generate(
        prompts,
        [greedy(2, logprobs=k, prompt_logprobs_start=s) for k, s in zip(ks, starts)],
    )
    for prompt, out, k, start in zip(prompts, outs, ks, starts):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        # Every scored token's rank (vLLM's): 1 + the tokens the model finds likelier.
        ranks = out.prompt_logprob_ranks or []
        first = max(start, 1)
        assert len(ranks) == len(prompt) - start and (start or ranks[0] is None)
        for p, rank in zip(range(first, len(prompt)), ranks[start == 0 :]):
            likelier = int((ref[p - 1] > ref[p - 1, prompt[p]]).sum())
            assert abs(rank - 1 - likelier) <= 1  # a tie at the scored logprob's last bit
        tops = out.prompt_top_logprobs
        if k == 0:
            assert tops is None and out.prompt_logprobs is not None
            continue
        assert (
            tops is not None and len(tops) == len(out.prompt_logprobs or []) == len(prompt) - start
        )
        if start == 0:
            assert tops[0] == [] and (out.prompt_logprobs or [0])[0] is None
        for p, top in zip(range(max(start, 1), len(prompt)), tops[start == 0 :]):
            values, ids = ref[p - 1].topk(k)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    engine.check_invariants()


def test_vllm_prompt_logprobs_have_their_own_k(tiny_llama_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    """vLLM's ``prompt_logprobs=k``: every prompt token from the first scored, each position
    with its own k likeliest (not ``logprobs``' k), beside a request asking for none."""
    from radixserve.engine.engine import Engine

    engine = Engine(str(tiny_llama_dir), page_size=2, num_pages=512, max_num_tokens=16)
    prompt = random_prompts([13], seed=39)[0]
    vllm, plain = engine.generate(
        [prompt, prompt], [greedy(2, logprobs=1, prompt_logprobs=3), greedy(2)]
    )
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    tops, lps = vllm.prompt_top_logprobs or [], vllm.prompt_logprobs or []
    assert len(tops) == len(lps) == len(prompt) and lps[0] is None and tops[0] == []
    for p in range(1, len(prompt)):
        assert [t for t, _ in tops[p]] == ref[p - 1].topk(3).indices.tolist()
        assert lps[p] == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
    assert all(len(lp.top) == 1 for lp in vllm.logprobs or [])  # the output's own k
    assert plain.prompt_logprobs is None and plain.prompt_logprob_ranks is None
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21).validate()
    engine.check_invariants()


def test_truncate_prompt_tokens_keeps_the_prompts_end(engine) -> None:  # type: ignore[no-untyped-def]
    """vLLM's ``truncate_prompt_tokens`` in ``generate`` as through the router: the answer is
    the one to the prompt's last k tokens, and the output names the prompt it read."""
    prompt = random_prompts([20], seed=40)[0]
    cut, tail = engine.generate(
        [prompt, prompt[-6:]], [greedy(4, truncate_prompt_tokens=6), greedy(4)]
    )
    assert cut.prompt_token_ids == prompt[-6:] and cut.usage.prompt_tokens == 6
    assert cut.token_ids == tail.token_ids
    engine.check_invariants()


def test_penalties_change_greedy_choice(engine, tiny_llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    prompt = [5, 6, 5, 6, 5, 6]
    plain = engine.generate([prompt], greedy(8))[0].token_ids
    assert plain == hf_greedy(tiny_llama_dir, prompt, 8)
    rep = engine.generate([prompt], greedy(8, repetition_penalty=50.0))[0].token_ids
    assert not set(rep) & set(prompt) and len(set(rep)) == len(rep)  # nothing seen is chosen again
    freq = engine.generate([prompt], greedy(8, frequency_penalty=2.0, presence_penalty=2.0))[
        0
    ].token_ids
    assert freq != plain or len(set(plain)) == len(plain)


def test_logprobs_of_named_tokens_at_prompt_and_output_positions(
    tiny_llama_dir: Path,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    """SGLang's token_ids_logprob: at every reported prompt position (over prefill chunks)
    and output position, the named tokens' logprobs, in the order named (repeats kept),
    equal transformers' log-softmax there; beside, in the same steps, a request naming
    other tokens and one naming none."""
    from radixserve.engine.engine import Engine

    engine = Engine(str(tiny_llama_dir), page_size=2, num_pages=512, max_num_tokens=8)
    prompts = random_prompts([21, 13, 9], seed=39)
    named: list[list[int] | None] = [[5, 300, 5, 17], [2], None]
    params = [
        greedy(4, logprobs=1, prompt_logprobs_start=3, logprob_token_ids=named[0]),
        greedy(4, logprobs=0, prompt_logprobs_start=0, logprob_token_ids=named[1]),
        greedy(4, logprobs=2, prompt_logprobs_start=1),
    ]
    outs = engine.generate(prompts, params)
    for prompt, ids, p, out in zip(prompts, named, params, outs):
        seq = prompt + out.token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1)
        assert out.logprobs is not None
        if ids is None:
            assert all(lp.asked == [] for lp in out.logprobs)
            assert out.prompt_asked_logprobs is None
            continue
        for i, lp in enumerate(out.logprobs):
            want = [ref[len(prompt) - 1 + i, t].item() for t in ids]
            assert lp.asked == pytest.approx(want, abs=1e-4)
        start = p.prompt_logprobs_start
        assert start is not None and out.prompt_asked_logprobs is not None
        got = out.prompt_asked_logprobs
        assert len(got) == len(prompt) - start and (start > 0 or got[0] == [])
        for k, values in enumerate(got):
            pos = start + k
            if pos == 0:
                continue
            assert values == pytest.approx([ref[pos - 1, t].item() for t in ids], abs=1e-4)
