"""The engine on the real default model: greedy == transformers, and the cache pays off (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy

pytestmark = pytest.mark.slow

N = 8


def test_smollm2_greedy_matches_transformers_cold_and_warm(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from radixserve.engine.engine import Engine

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    system = "You are a concise assistant. Answer with one short sentence."
    chats = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in ("What is the capital of France?", "Name a primary color.")
    ]
    prompts = [tok.encode(p) for p in ["The capital of France is", "def fibonacci(n):", *chats]]
    refs = [hf_greedy(smollm2_dir, p, N) for p in prompts]
    engine = Engine(
        str(smollm2_dir), page_size=16, num_pages=256, max_num_tokens=48
    )  # chunked prefill
    for _ in ("cold", "warm"):
        outs = engine.generate(prompts, greedy(N))
        engine.check_invariants()
        assert [o.token_ids for o in outs] == refs
    assert outs[0].text.strip().startswith("Paris")
    assert all(o.usage.cached_tokens >= (o.usage.prompt_tokens - 1) // 16 * 16 for o in outs)
