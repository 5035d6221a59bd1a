"""Every dense family radixserve adds beyond Llama (``model/families/``) against transformers'
own implementation, on tiny random checkpoints saved by transformers' config and model class
with the family's quirks active (``families.py``).

Tolerance (float32): logits |ours - hf| <= 1e-4 + 1e-4 |hf| (the measured difference is
~3e-6 on logits up to ~3.5); per-token logprobs within 1e-4; greedy tokens identical.
The engine runs are cold, then warm (the prompts' cached prefixes reused), with prefill in
chunks of at most 16 tokens and a batch of mixed lengths, on the CPU's paged attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch
from families import FAMILIES

from radixserve.engine.engine import Engine
from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.sampling_params import SamplingParams

ATOL = RTOL = 1e-4
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    name: str = request.param
    model_type, overrides, _ = FAMILIES[name]
    path = tiny_models.build_tiny_family(
        tmp_path_factory.mktemp(name), model_type, tokenizer=True, **overrides
    )
    return name, path


def _hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = '"vision_config"' in (path / "config.json").read_text()
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32).eval()


def _seqs(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in lengths
    ]


def test_ragged_logits_match_transformers(family: tuple[str, Path]) -> None:
    name, path = family
    model = load_model(path)
    assert model.config.model_type == FAMILIES[name][0]
    # Which path the family runs on the CPU, and that it says so.
    assert (model.native_stack_reason is None) == FAMILIES[name][2]
    seqs = _seqs((7, 1, 23, 12), seed=0)
    ours = model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())
    hf = _hf(path)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_engine_greedy_and_logprobs_cold_and_warm(family: tuple[str, Path]) -> None:
    """Greedy continuations and their logprobs equal transformers' (teacher-forced on the
    continuation: identical argmax at every step is identical greedy decoding)."""
    _, path = family
    base = _seqs((20,), seed=1)[0]
    tails = _seqs((3, 17, 1, 9), seed=2)
    prompts = [base + tails[0], base[:11] + tails[1], tails[2], base + tails[3], _seqs((40,), 3)[0]]
    hf = _hf(path)
    engine = Engine(str(path), page_size=4, num_pages=256, max_num_tokens=16)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
        for rnd in ("cold", "warm"):
            outs = engine.generate(prompts, params)
            engine.check_invariants()
            for prompt, out in zip(prompts, outs):
                seq = prompt + out.token_ids
                with torch.no_grad():
                    ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
                rows = ref[len(prompt) - 1 : len(seq) - 1]
                assert out.token_ids == rows.argmax(-1).tolist(), rnd
                assert out.logprobs is not None
                got = torch.tensor([lp.logprob for lp in out.logprobs])
                want = rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
                torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
            if rnd == "warm":
                # Every prompt but the 1-token one reused its cached whole pages.
                cached = [o.usage.cached_tokens for o in outs]
                assert cached == [(len(p) - 1) // 4 * 4 for p in prompts]
    finally:
        engine.close()
