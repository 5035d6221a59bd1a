"""``allowed_token_ids`` (vLLM's): a row draws from its listed tokens only, on every path.

Checked against transformers' greedy decoding with every other token masked (tiny random
Llama), in a batch that mixes limited, unlimited and sampled rows; and with ``min_tokens``
when the only allowed tokens are end tokens (the draw keeps them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, hf_model, random_prompts

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

N = 6


def hf_limited_greedy(model_dir: Path, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    """Greedy decoding over ``allowed`` only, with transformers' logits."""
    model = hf_model(model_dir)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(allowed[int(logits[allowed].argmax())])
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(str(tiny_llama_dir), page_size=4, num_pages=512, seed=0)


def test_limited_rows_match_transformers_and_leave_others_alone(
    tiny_llama_dir: Path, engine: Engine
) -> None:
    prompt = random_prompts([11], seed=6)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, N)
    allowed = [5, 17, 42, 99, 230]
    expected = hf_limited_greedy(tiny_llama_dir, prompt, allowed, N)
    sampled = SamplingParams(
        max_tokens=N, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed
    )
    outs = engine.generate(
        [prompt] * 4,
        [greedy(N), greedy(N, allowed_token_ids=allowed), sampled, greedy(N, logit_bias={7: 1})],
    )
    assert outs[0].token_ids == ref  # batched with the limited rows, unchanged
    assert outs[1].token_ids == expected
    assert set(outs[2].token_ids) <= set(allowed) and len(outs[2].token_ids) == N
    engine.check_invariants()


def test_only_end_tokens_allowed_end_the_output_despite_min_tokens(engine: Engine) -> None:
    """``min_tokens`` blocks the end tokens; where they are all a row may draw, blocking
    them would leave nothing: the row draws one and ends."""
    prompt = random_prompts([9], seed=7)[0]
    eos = 2  # the tiny model's end-of-sequence token
    params = SamplingParams(max_tokens=4, min_tokens=3, temperature=0.0, allowed_token_ids=[eos])
    (out,) = engine.generate([prompt], params)
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0
