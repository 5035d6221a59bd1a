"""A Gemma 2 checkpoint (sliding window 6 on the first of its two layers, attention soft-cap 1.0,
final soft-cap 2.0) on the Triton backend (interpreted on the CPU; under gpu_check.sh on
cuda) gives the torch backend's greedy tokens and logprobs (within 1e-4, float32), cold and
with cached prefixes, prompts longer than the window, prefill chunks of 8 beside decodes.
The torch backend's output equals transformers' (``tests/model/test_gemma_vs_hf.py``).

The same for a gpt-oss checkpoint (``tiny_models.GPT_OSS``: attention sinks, a window of 4
on alternating layers, biased experts), whose torch-backend output equals transformers'
(``tests/model/test_families_vs_hf.py``)."""

from __future__ import annotations

from pathlib import Path

import kvcases
import pytest
import tiny_models
import torch

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma2"),
        "gemma2",
        num_hidden_layers=2,
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    )


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", tokenizer=True, **tiny_models.GPT_OSS
    )


def _run(path: Path, backend: str) -> list[tuple[list[int], list[float]]]:
    g = torch.Generator().manual_seed(4)
    base = torch.randint(3, 512, (14,), generator=g).tolist()
    prompts = [base + [7, 8, 9], base[:9], torch.randint(3, 512, (3,), generator=g).tolist()]
    engine = Engine(
        str(path),
        num_pages=128,
        page_size=4,
        device=str(kvcases.DEVICE),
        dtype="float32",
        attention_backend=backend,
        max_num_tokens=8,
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    out = []
    try:
        for _ in range(2):  # cold, then warm (cached prefixes)
            for o in engine.generate(prompts, params):
                assert o.logprobs is not None
                out.append((o.token_ids, [lp.logprob for lp in o.logprobs]))
            engine.check_invariants()
    finally:
        engine.close()
    return out


def _triton_equals_torch(model_dir: Path) -> None:
    """The same greedy tokens through both backends, logprobs within 1e-4."""
    want = _run(model_dir, "torch")
    got = _run(model_dir, "triton")
    assert [t for t, _ in got] == [t for t, _ in want]
    torch.testing.assert_close(
        torch.tensor([lp for _, lps in got for lp in lps]),
        torch.tensor([lp for _, lps in want for lp in lps]),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.slow  # ~35 s of interpreted kernels on the loaded 2-core VM
def test_triton_window_softcap_engine_matches_torch(gemma2_dir: Path) -> None:
    _triton_equals_torch(gemma2_dir)


@pytest.mark.slow  # interpreted kernels, as above
def test_triton_sinks_engine_matches_torch(gpt_oss_dir: Path) -> None:
    _triton_equals_torch(gpt_oss_dir)
