"""Speculative decoding on the real default model (SmolLM2-135M-Instruct), float32 and
bfloat16, k = 8: a prompt whose answer quotes it, tokens and logprobs identical to the plain
engine's, drafts accepted (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import run_to_completion, tokens_of

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The radix tree indexes the pages of a paged KV cache. A prefix that many requests "
    "share is computed once and reused while it stays in memory. Pages in use are "
    "reference-counted; an evictor frees unreferenced ones when memory is needed."
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quoting_answer_identical_with_drafts_accepted(smollm2_dir: Path, dtype: str) -> None:
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=1)
    outs = {}
    for algo in (None, "ngram"):
        engine = Engine(
            str(smollm2_dir),
            dtype=dtype,
            num_pages=64,
            page_size=16,
            num_threads=1,
            speculative_algorithm=algo,
            speculative_num_tokens=8,
        )
        try:
            text = engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            rid = engine.add_request(engine.tokenizer.encode(text), params)
            outs[algo] = run_to_completion(engine)[rid]
        finally:
            engine.close()
    base, spec = outs[None], outs["ngram"]
    assert tokens_of(spec) == tokens_of(base)
    lps = [[lp for o in run for lp in (o.new_logprobs or [])] for run in (base, spec)]
    assert lps[0] == lps[1]
    usage = spec[-1].usage
    assert usage is not None and usage.spec_accepted_tokens >= 16
    assert len(spec) < len(base)  # fewer steps than tokens
