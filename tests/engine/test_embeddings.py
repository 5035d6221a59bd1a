"""A prompt's embedding (``return_embedding``): the final norm's output at its last token
equals transformers' ``last_hidden_state`` there, for prompts prefilled in several chunks
beside other requests' decode rows, for a prompt whose prefix came from the cache, and for
a family with its own norms (Qwen3's q/k norms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import greedy, hf_greedy, hf_last_hidden, random_prompts, run_to_completion
from tiny_models import build_tiny_family

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

EMBED = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("qwen3_embed"), "qwen3")


def test_chunked_prompts_beside_decode_rows(tiny_llama_dir: Path) -> None:
    prompts = random_prompts([23, 9, 31], seed=51)
    engine = Engine(str(tiny_llama_dir), num_pages=256, page_size=4, max_num_tokens=8)
    decoding = engine.add_request(random_prompts([5], seed=52)[0], greedy(12))
    rids = [engine.add_request(p, EMBED) for p in prompts]
    outs = run_to_completion(engine)
    assert len(outs[decoding]) > 1 and all(o.embedding is None for o in outs[decoding])
    for rid, ref in zip(rids, [hf_last_hidden(tiny_llama_dir, p) for p in prompts]):
        got = [o.embedding for o in outs[rid] if o.embedding is not None]
        assert len(got) == 1, "sent once"
        torch.testing.assert_close(torch.tensor(got[0]), ref, atol=1e-4, rtol=1e-4)
    engine.check_invariants()


def test_a_prefix_from_the_cache(tiny_llama_dir: Path) -> None:
    head = random_prompts([24], seed=53)[0]
    longer = head + [7, 8, 9, 10, 11]
    engine = Engine(str(tiny_llama_dir), num_pages=256, page_size=4)
    engine.generate([head], EMBED)
    out = engine.generate([longer], EMBED)[0]
    assert out.usage.cached_tokens == 24
    assert out.embedding is not None
    ref = hf_last_hidden(tiny_llama_dir, longer)
    torch.testing.assert_close(torch.tensor(out.embedding), ref, atol=1e-4, rtol=1e-4)


def test_qwen3_through_encode(tiny_qwen3_dir: Path) -> None:
    prompts = random_prompts([6, 19], seed=54)
    engine = Engine(str(tiny_qwen3_dir), num_pages=128, page_size=4)
    refs = [hf_last_hidden(tiny_qwen3_dir, p) for p in prompts]
    for got, ref in zip(engine.encode(prompts), refs):
        torch.testing.assert_close(torch.tensor(got), ref, atol=1e-4, rtol=1e-4)


def test_refused_where_the_engine_cannot_return_them(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    engine.intake.no_embeddings = "with pipeline parallelism"  # as _no_embeddings says there
    with pytest.raises(ValueError, match="embeddings are not returned with pipeline"):
        engine.add_request([1, 2, 3], EMBED)


@pytest.mark.parametrize("tied", [True, False])
def test_a_base_model_checkpoint(tmp_path: Path, tied: bool) -> None:
    """An embedding model saved as its base model (Qwen3Model: no ``model.`` prefix, no LM
    head; Qwen3-Embedding's layout): served with its embeddings equal to transformers'. With
    its head tied to the embedding it generates as the causal LM does; without a head it
    serves embeddings only and refuses generation."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = build_tiny_family(tmp_path / "src", "qwen3", tie_word_embeddings=tied, tokenizer=True)
    lm: Any = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    base = tmp_path / "base"
    lm.model.save_pretrained(str(base))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, base / f.name)
    prompts = random_prompts([8, 13], seed=55)
    engine = Engine(str(base), num_pages=64, page_size=4)
    for o, p in zip(engine.generate(prompts, EMBED), prompts):
        assert o.embedding is not None
        with torch.inference_mode():
            ref = lm.model(torch.tensor([p])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(o.embedding), ref, atol=1e-4, rtol=1e-4)
    if tied:
        got = engine.generate(prompts[:1], greedy(4))[0].token_ids
        want = hf_greedy(src, prompts[0], 4)  # the causal LM's own checkpoint
        assert got == want
    else:
        with pytest.raises(ValueError, match="serves embeddings only"):
            engine.add_request(prompts[0], greedy(4))
