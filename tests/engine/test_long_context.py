"""32k tokens of context on a RoPE-scaled (YaRN) tiny Llama: greedy tokens equal
transformers' (float32, SDPA), the prompt prefilled in chunks of 4,096, and a chunk's
transient memory bounded by the chunk, not by the context it attends over.

Memory is counted with torch's allocator events (``alloc_peak.py``): the peak bytes a step
holds at once, the attention kernels' own buffers included. The chunk at 28k-32k must peak
no higher than the chunk at 8k-12k: what grows with the context (the KV pages) lives in the
pool, allocated before the first step; step metadata (page lists, slots) grows by a few
bytes per token, far under any per-layer buffer.
"""

from __future__ import annotations

from pathlib import Path

import engine_helpers
import pytest
import torch
from alloc_peak import peak_bytes
from engine_helpers import greedy, hf_greedy, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput

CONTEXT = 32 * 1024
CHUNK = 4096
TOKENS = 4
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def yarn_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 2 query heads over 1 KV head (head_dim 16): cheap at 32k, still grouped."""
    import tiny_models

    return tiny_models.build_tiny_llama(
        tmp_path_factory.mktemp("yarn_llama"),
        num_q_heads=2,
        num_kv_heads=1,
        rope_scaling=YARN,
        max_position_embeddings=CONTEXT + 1024,
    )


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(44)
    return torch.randint(3, 512, (CONTEXT - TOKENS,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(yarn_llama: Path, prompt: list[int]) -> list[int]:
    tokens = hf_greedy(yarn_llama, prompt, TOKENS)  # float32
    # transformers' default here: SDPA, memory-efficient at 32k (no [32k, 32k] scores)
    assert engine_helpers._HF_MODELS[str(yarn_llama)].config._attn_implementation == "sdpa"
    return tokens


def _serve(engine: Engine, prompt: list[int]) -> tuple[list[int], dict[int, int]]:
    """Greedy tokens of ``prompt``, stepping by hand; the peak bytes of the prefill chunks
    over 8k-12k and 28k-32k, keyed by their first position."""
    rid = engine.add_request(prompt, greedy(TOKENS))
    outs: list[StepOutput] = []
    peaks: dict[int, int] = {}
    step = 0
    while engine.has_unfinished():
        if step * CHUNK in (2 * CHUNK, 7 * CHUNK):
            peaks[step * CHUNK] = peak_bytes(lambda: outs.extend(engine.step()))
        else:
            outs.extend(engine.step())
        step += 1
    engine.check_invariants()
    return tokens_of([o for o in outs if o.request_id == rid]), peaks


def _engine(model: Path, kv_dtype: str) -> Engine:
    return Engine(
        str(model),
        dtype="float32",
        kv_cache_dtype=kv_dtype,
        page_size=16,
        num_pages=CONTEXT // 16 + 16,
        max_num_tokens=CHUNK,
    )


def _assert_bounded(peaks: dict[int, int]) -> None:
    """The last chunk (28k-32k) peaks within 5% of the third (8k-12k): about 13 MB each
    here, while a [chunk, context] float32 score matrix or mask alone would be 512 MiB."""
    short, long = peaks[2 * CHUNK], peaks[7 * CHUNK]
    assert long <= short * 1.05, f"chunk peak grew with the context: {short} -> {long} bytes"


@pytest.mark.slow
def test_32k_context_greedy_equals_transformers(
    yarn_llama: Path, prompt: list[int], reference: list[int]
) -> None:
    engine = _engine(yarn_llama, "auto")
    try:
        tokens, peaks = _serve(engine, prompt)
    finally:
        engine.close()
    assert tokens == reference
    _assert_bounded(peaks)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_at_32k(
    yarn_llama: Path, prompt: list[int], reference: list[int], kv_dtype: str
) -> None:
    """The torch path's key blocks at 32k: the same tokens cold and warm (the whole prompt
    then comes from the cache), the first one transformers' (the quantized-KV criterion of
    ``test_greedy_vs_hf``), and chunk memory bounded as unquantized."""
    engine = _engine(yarn_llama, kv_dtype)
    try:
        cold, peaks = _serve(engine, prompt)
        warm, _ = _serve(engine, prompt)
    finally:
        engine.close()
    assert cold == warm
    assert cold[0] == reference[0]
    _assert_bounded(peaks)
